"""The executor (``fedrod_ray.executors.base``) of the ServerApp: each call goes, as one Flower message per
SuperNode, to the nodes that host the clients it names; the round loop around it is fedrod-ray's own.

The server keeps of each client only what it receives anyway (its last shared weights, the rule's and method's
uploads, how many rounds it trained): the committed states it hands back hold no personal part, rule state,
objective state or momentum, which stay on the client's SuperNode (``node.NodeStates``). A node that does not
answer within ``timeout`` seconds fails its clients' calls, which the round loop counts as it counts any
client's failure (``runtime.max_failed_fraction``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from flwr.app import Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedrod_ray.client_update.local import RoundInput
from fedrod_ray.clients.client import ClientFailure, EvalCounts
from fedrod_ray.config import ExperimentConfig
from fedrod_ray.config.loading import dump_config
from fedrod_ray.executors.base import Job, TrainOutcome
from fedrod_ray.personalization import build_method
from fedrod_ray.server_math.aggregate import StateDict

from . import wire


class NodeLostError(RuntimeError):
    """A SuperNode did not answer (it left, or was too slow)."""


class FlowerExecutor:
    def __init__(self, grid: Grid, cfg: ExperimentConfig, timeout: float, log: Callable[[str], None] = print):
        self.grid, self.cfg, self.timeout, self.log = grid, cfg, timeout, log
        self.config_text = dump_config(cfg)
        self.rounds_done = 0  # the rounds trained, whose client states the nodes' evaluations read
        self._nodes: set[int] = set()
        self._hosts: dict[int, int] = {}
        self.pm_from_global = build_method(cfg.train.head, cfg.train.head_params).pm_from_global

    def wait_for_nodes(self, count: int, timeout: float) -> None:
        """Wait until ``count`` SuperNodes are connected."""
        end = time.monotonic() + timeout
        while len(list(self.grid.get_node_ids())) < count:
            if time.monotonic() > end:
                raise NodeLostError(f"{len(list(self.grid.get_node_ids()))} of the {count} SuperNodes "
                                    f"(run config min-nodes) connected within {timeout:g} s")
            time.sleep(0.5)

    def placement(self, refresh: bool = False) -> dict[int, int]:
        """Each client id -> the SuperNode that hosts it, asked again whenever the connected nodes change."""
        nodes = set(self.grid.get_node_ids())
        if refresh or nodes != self._nodes:
            self._hosts, self._nodes = self._ask(nodes), nodes
        return self._hosts

    def _ask(self, nodes: set[int]) -> dict[int, int]:
        msgs = []
        for node in nodes:
            content = RecordDict()
            wire.put_header(content)
            msgs.append(Message(content, dst_node_id=node, message_type=MessageType.QUERY))
        hosts: dict[int, int] = {}
        for reply in self.grid.send_and_receive(msgs, timeout=self.timeout):
            if reply.has_error():
                continue
            for cid in wire.header(reply.content)["clients"]:
                if cid in hosts:
                    raise ValueError(f"client {cid} is hosted by two SuperNodes ({hosts[cid]} and "
                                     f"{reply.metadata.src_node_id}): each client's data must be on one")
                hosts[cid] = reply.metadata.src_node_id
        return hosts

    def _send(self, ids: list[int], kind: str, fill: Callable[[RecordDict, list[int]], None],
              ) -> tuple[dict[int, list[int]], dict[int, RecordDict | str]]:
        """One message per node hosting some of ``ids`` (``fill`` writes its content for that node's clients);
        each node's clients, and its reply's content or why there is none."""
        hosts = self.placement()
        if any(cid not in hosts for cid in ids):
            hosts = self.placement(refresh=True)
        by_node: dict[int, list[int]] = {}
        for cid in ids:
            by_node.setdefault(hosts.get(cid, -1), []).append(cid)
        msgs = {}
        for node, cids in by_node.items():
            if node == -1:
                continue
            content = RecordDict()
            fill(content, cids)
            msgs[node] = Message(content, dst_node_id=node, message_type=kind)
        replies: dict[int, RecordDict | str] = {-1: "NodeLostError: no connected SuperNode hosts this client"}
        for reply in self.grid.send_and_receive(list(msgs.values()), timeout=self.timeout):
            node = reply.metadata.src_node_id
            replies[node] = (f"NodeLostError: SuperNode {node}: {reply.error.reason}" if reply.has_error()
                             else reply.content)
        for node in msgs:
            if node not in replies:
                replies[node] = f"NodeLostError: SuperNode {node} did not answer within {self.timeout:g} s"
                self._nodes = set()  # ask every node again next time
        return by_node, replies

    def train(self, round_idx: int, jobs: list[Job], message: RoundInput) -> Iterator[tuple[int, TrainOutcome]]:
        slots = {cid: slot for slot, (cid, _) in enumerate(jobs)}

        def fill(content: RecordDict, cids: list[int]) -> None:
            wire.put_header(content, config=self.config_text, round=round_idx, clients=cids,
                            clip_norm=message.clip_norm)
            wire.put_round_input(content, message, cids)

        by_node, replies = self._send(list(slots), MessageType.TRAIN, fill)
        self.rounds_done = round_idx + 1
        for node, cids in by_node.items():
            reply = replies[node]
            for cid in cids:
                slot = slots[cid]
                if isinstance(reply, str):
                    yield slot, ClientFailure(cid, reply, "")
                    continue
                out = wire.result(reply, cid)
                # What the server keeps of the client: the shared weights it sent, never its own state.
                yield slot, out if isinstance(out, ClientFailure) else jobs[slot][1].trained((out, None, {}))

    def ask(self, round_idx: int, phase: str, common: StateDict,
            questions: dict[int, StateDict]) -> dict[int, StateDict | ClientFailure]:
        def fill(content: RecordDict, cids: list[int]) -> None:
            wire.put_header(content, config=self.config_text, clients=cids, rounds_done=self.rounds_done,
                            action="ask", phase=phase, round_idx=round_idx)
            wire.put_round_input(content, RoundInput(common, per_client=questions), cids)

        by_node, replies = self._send(list(questions), MessageType.EVALUATE, fill)
        out: dict[int, StateDict | ClientFailure] = {}
        for node, cids in by_node.items():
            reply = replies[node]
            for cid in cids:
                out[cid] = ClientFailure(cid, reply, "") if isinstance(reply, str) else wire.answer(reply, cid)
        return out

    def _counts(self, jobs: list[Job], header: dict, message: RoundInput) -> EvalCounts:
        def fill(content: RecordDict, cids: list[int]) -> None:
            wire.put_header(content, config=self.config_text, clients=cids, rounds_done=self.rounds_done,
                            **header)
            wire.put_round_input(content, message, cids)

        by_node, replies = self._send([cid for cid, _ in jobs], MessageType.EVALUATE, fill)
        out = EvalCounts()
        for node, cids in by_node.items():
            reply = replies[node]
            if isinstance(reply, str):
                out.failed.update(dict.fromkeys(cids, reply))
            else:
                out.merge(wire.counts(reply))
        return out

    def evaluate(self, jobs: list[Job], estimate: bool = False) -> EvalCounts:
        # A PM made from the server's state (``Personalization.pm_job``: the server has no personal part to
        # put in it): the node evaluates the state the server made.
        made = {cid: state.tensors() for cid, state in jobs} if self.pm_from_global else {}
        return self._counts(jobs, {"action": "evaluate", "estimate": estimate}, RoundInput({}, per_client=made))

    def finetune(self, jobs: list[Job], message: RoundInput, epochs: int, round_idx: int) -> EvalCounts:
        return self._counts(jobs, {"action": "finetune", "epochs": epochs, "round_idx": round_idx}, message)

    def zero_shot(self, jobs: list[Job], message: RoundInput, round_idx: int) -> EvalCounts:
        return self._counts(jobs, {"action": "zero_shot", "round_idx": round_idx}, message)

    def close(self) -> None:
        pass
