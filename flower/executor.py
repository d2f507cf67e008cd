"""The executor (``fedrod_ray.executors.base``) of the ServerApp: each call goes, as one Flower message per
SuperNode, to the nodes that host the clients it names; the round loop around it is fedrod-ray's own.

The server keeps of each client only what it receives anyway (its last shared weights, the rule's and method's
uploads, how many rounds it trained): the committed states it hands back hold no personal part, rule state,
objective state or momentum, which stay on the client's SuperNode (``node.NodeStates``). A node that does not
answer within ``timeout`` seconds fails its clients' calls, which the round loop counts as it counts any
client's failure (``runtime.max_failed_fraction``). Under secure aggregation a round's training goes through
Flower's SecAgg+ workflow instead: the executor is then ``sums_only`` and ``train_sums`` hands back only the
round's sums, from the sum of the nodes' vectors."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.common import parameters_to_ndarrays
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import FedAvg
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.serverapp import Grid

from fedrod_ray.algorithms import build_rule
from fedrod_ray.client_update.local import RoundInput
from fedrod_ray.clients.client import ClientFailure, EvalCounts
from fedrod_ray.config import ExperimentConfig
from fedrod_ray.config.loading import dump_config
from fedrod_ray.executors.base import (
    Executor,
    Job,
    RoundFailedError,
    RoundSkipped,
    SummedRound,
    SumRequest,
    TrainOutcome,
)
from fedrod_ray.executors.runtimes import Runtime, register
from fedrod_ray.federation_state.setup import Setup, prepare
from fedrod_ray.personalization import build_method
from fedrod_ray.server_math.aggregate import StateDict
from fedrod_ray.server_math.distributed_dp import DistributedRound

from . import distributed, wire
from .secure import MODULUS, Layout, Scales, SecAggSettings, round_sums, too_few_nodes


class NodeLostError(RuntimeError):
    """A SuperNode did not answer (it left, or was too slow)."""


class _Round(FedAvg):
    """The strategy SecAgg+'s workflow asks for one round: each node's instructions out, and the nodes' replies
    (their plain reports, the secure sum in place of their parameters) and failures kept. Nothing is averaged
    here: the round loop's server step reads the sum."""

    def __init__(self, instructions: dict[int, tuple[GridClientProxy, object]]):
        super().__init__()
        self.instructions = instructions
        self.results: list | None = None  # None: the protocol did not complete
        self.failures: list = []

    def configure_fit(self, server_round, parameters, client_manager):
        return list(self.instructions.values())

    def aggregate_fit(self, server_round, results, failures):
        self.results, self.failures = results, failures
        return None, {}


class FlowerExecutor(Executor):
    def __init__(self, grid: Grid, cfg: ExperimentConfig, timeout: float, log: Callable[[str], None] = print,
                 context: Context | None = None, secagg: SecAggSettings | None = None):
        """``context``: the ServerApp's, which SecAgg+'s workflow keeps its round in; ``secagg``: SecAgg+'s
        settings, with which every round is trained and summed by SecAgg+ (``train_sums``) and none in the clear."""
        self.grid, self.cfg, self.timeout, self.log, self.context = grid, cfg, timeout, log, context
        self.secagg, self.sums_only = secagg, secagg is not None
        if secagg is not None and cfg.privacy.enabled and cfg.privacy.mechanism != "central":
            distributed.check_settings(cfg, secagg.reconstruction_threshold)
        self.rule = build_rule(cfg.train.generic_rule, cfg.train.rule_params)
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
            if reply.has_error():  # e.g. its policy or fedrod-ray version refuses this server: it says why
                self.log(f"SuperNode {reply.metadata.src_node_id} did not report its clients: {reply.error.reason}")
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

    def train_sums(self, round_idx: int, jobs: list[Job], message: RoundInput, request: SumRequest) -> SummedRound:
        """Round ``round_idx``'s clients trained on their nodes and summed by SecAgg+, turned back into the round's
        sums (``secure.round_sums``): the server never sees one node's vector."""
        ids = [cid for cid, _ in jobs]
        layout = Layout.of(message.weights, set(request.generic_keys), request.upload, request.dp)
        scales = Scales.of(ids, request.sizes, self.rule)
        vector, done, failures, personal = self._secure_round(round_idx, ids, message, layout, scales,
                                                              request.distributed)
        if request.distributed is not None:  # each node noised its share (flower.distributed)
            sums, losses = distributed.round_sums(
                vector, layout.keys("clipped"), message.weights, request.distributed, len(done), scales.samples,
                float(sum(request.sizes[c] for c in done)), self._participants(), personal)
            return SummedRound(sums, losses, done, failures)
        sums, count, losses = round_sums(vector, layout, scales, message.weights, personal)
        if count != len(done):
            raise RoundFailedError(f"round {round_idx + 1}: the secure sum counts {count} participants, but the "
                                   f"SuperNodes in it reported {len(done)}")
        return SummedRound(sums, losses, done, failures)

    def _participants(self) -> int:
        """The most SuperNodes the distributed mechanism's sum may hold (``privacy.max_participants``)."""
        p = self.cfg.privacy
        return p.max_participants or p.min_participants

    def _instructions(self, round_idx: int, message: RoundInput, layout: Layout, scales: Scales,
                      dround: DistributedRound | None) -> tuple[dict, tuple[float, int, int]]:
        """The header of every node's SecAgg+ instructions, and SecAgg+'s clipping, quantization and modulus
        ranges (under distributed DP, those that carry the ring's integers: ``distributed.workflow_ranges``)."""
        settings = self.secagg
        header = {"config": self.config_text, "round": round_idx, "clip_norm": message.clip_norm,
                  "layout": layout.to_json(), "scales": [scales.generic, scales.samples, scales.count],
                  "clipping_range": settings.clipping_range}
        if dround is None:
            return header, (settings.clipping_range, settings.quantization_range, MODULUS)
        header["distributed"] = distributed.to_header(dround, self._participants())
        return header, distributed.workflow_ranges(dround)

    def _secure_round(self, round_idx: int, ids: list[int], message: RoundInput, layout: Layout, scales: Scales,
                      dround: DistributedRound | None = None) -> tuple[np.ndarray, list[int], list[ClientFailure], bool]:
        """Round ``round_idx``'s clients ``ids`` trained on their nodes and summed by SecAgg+: (the sum of every
        node's ``secure.node_vector`` that made it into the sum, the clients in it, the clients that failed or
        whose node dropped, whether their method has a personal loss). Every node that hosts a client takes
        part, with or without a client of the round (its vector is then zeros), so that the protocol has as
        many nodes as it can. Raises RoundFailedError when the protocol cannot complete (too few nodes)."""
        settings = self.secagg
        hosts = self.placement()
        if any(cid not in hosts for cid in ids):
            hosts = self.placement(refresh=True)
        by_node: dict[int, list[int]] = {node: [] for node in sorted(set(hosts.values()))}
        failures = [ClientFailure(cid, "NodeLostError: no connected SuperNode hosts this client", "")
                    for cid in ids if cid not in hosts]
        for cid in ids:
            if cid in hosts:
                by_node[hosts[cid]].append(cid)
        # Under the distributed mechanism every node noises its share, sampled clients or not: the total is private
        # at the stated epsilon even when one node holds them all.
        if dround is None and (why := too_few_nodes(by_node, settings)) is not None:
            raise RoundSkipped(f"round {round_idx + 1}: {why}")
        if dround is not None and len(by_node) > self._participants():
            raise RoundFailedError(f"round {round_idx + 1}: {len(by_node)} SuperNodes would sum their shares, more than "
                                   f"privacy.max_participants ({self._participants()}), for which the ring was sized")
        if dround is None and len(by_node) * settings.quantization_range >= MODULUS:
            raise RoundFailedError(f"round {round_idx + 1}: {len(by_node)} SuperNodes' sum of quantized values "
                                   "may wrap at SecAgg+'s modulus 2**32: lower run config secagg-quantization-range")
        run_id = self.context.run_id
        header, (clipping, levels, modulus) = self._instructions(round_idx, message, layout, scales, dround)
        strategy = _Round({node: (GridClientProxy(node, self.grid, run_id),
                                  wire.fit_ins({**header, "clients": cids}, message, cids))
                           for node, cids in by_node.items()})
        context = LegacyContext(self.context, strategy=strategy)
        context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: round_idx + 1})
        context.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
        # Each node's update is the same for every weight (1 = max_weight): SecAgg+ returns the mean of the
        # vectors over the nodes in the sum, which their number turns back into the sum.
        SecAggPlusWorkflow(settings.num_shares, settings.reconstruction_threshold, max_weight=1.0,
                           clipping_range=clipping, quantization_range=levels, modulus_range=modulus,
                           timeout=self.timeout)(self.grid, context)
        self.rounds_done = round_idx + 1
        if not strategy.results:
            why = "; ".join(str(f) for f in strategy.failures)[:2000]
            raise RoundFailedError(f"round {round_idx + 1}: SecAgg+ did not complete with the SuperNodes that "
                                   f"answered (run config secagg-reconstruction-threshold="
                                   f"{settings.reconstruction_threshold}){': ' + why if why else ''}")
        for f in strategy.failures:
            self.log(f"[round {round_idx + 1}] a SuperNode left SecAgg+: {f}")
        summed, done, personal = set(), [], False
        for proxy, res in strategy.results:
            summed.add(proxy.node_id)
            report = json.loads(res.metrics["json"])
            done += report["done"]
            personal |= report["personal"]
            failures += [ClientFailure(int(cid), error, "") for cid, error in report["failed"].items()]
        for node, cids in by_node.items():
            if node not in summed:
                self._nodes = set()  # ask every node again next time
                failures += [ClientFailure(cid, f"NodeLostError: SuperNode {node} left the round's SecAgg+", "")
                             for cid in cids]
        mean = parameters_to_ndarrays(strategy.results[0][1].parameters)[0]
        vector = (distributed.ring_total(mean, len(strategy.results), dround) if dround is not None
                  else mean * len(strategy.results))
        return vector, sorted(done), sorted(failures, key=lambda f: f.client_id), personal

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


def start(setup: Setup, grid: Grid, timeout: float, context: Context, secagg: SecAggSettings | None = None,
          **env) -> tuple[Setup, FlowerExecutor]:
    """The Flower runtime's executor over the SuperNodes that ``grid`` reaches (``Runtime.start``)."""
    return setup, FlowerExecutor(grid, setup.cfg, timeout, context=context, secagg=secagg)


# The ServerApp's runtime, asked for by name (``fedrod_ray.executors.runtimes``): no config selects it, the
# engine that runs the app does.
RUNTIME = Runtime("flower", on_ray=False, prepare=prepare, start=start)
register(RUNTIME)
