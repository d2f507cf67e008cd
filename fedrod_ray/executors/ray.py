"""The Ray executor: the round's client calls sent to a pool of client actors (``fedrod_ray.clients.actors``).

Each training call carries the client's state along with the round's message (put in the object store
once per round), and the new state comes back with the result. The client actors hold the dataset, not
client state: in the default pooled layout one actor per training slot takes whichever client is next,
largest first; with ``clients_per_actor: k`` each client has a home actor. A dead actor costs only the
call it was running: a training client is counted as failed for the round, an evaluation chunk is sent
again, the actor (restarted by Ray) is attached to the data again, and nothing committed is lost. Each
such call is logged and kept in ``RayExecutor.lost_calls``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError, RayError, RayTaskError

from ..client_update.local import RoundInput
from ..clients import faults
from ..clients.actors import ActorNotReady, ClientActor
from ..clients.client import ClientFailure, EvalCounts
from ..config import RuntimeConfig
from ..federation_state.setup import Setup
from ..server_math.aggregate import StateDict
from ..timing.scheduling import LargestFirst, LongestQueueFirst
from .base import Executor, Job
from .shared_setup import SharedSetup, share

RESTART_TIMEOUT_S = 120.0
EVAL_CHUNKS_PER_ACTOR = 2  # evaluation calls per actor: small enough to balance, large enough to amortise


@dataclass
class Layout:
    """How many actors, what each asks Ray for, how many calls run at once, and which clients each
    hosts (``clients_per_actor`` 0: pooled, any actor trains any client)."""

    num_actors: int
    clients_per_actor: int
    max_in_flight: int
    actor_resources: dict[str, float]  # Ray resources of one actor: the client's, scaled down to fit

    @property
    def pooled(self) -> bool:
        return self.clients_per_actor == 0

    def assignment(self, client_ids: list[int]) -> list[list[int]]:
        """Contiguous blocks of ids, one per actor (pinned layouts only)."""
        per = self.clients_per_actor
        return [client_ids[i:i + per] for i in range(0, len(client_ids), per)]


def plan_layout(rt: RuntimeConfig, num_clients: int, cluster: dict[str, float]) -> Layout:
    """Size the actor pool from the cluster's resources.

    A CPU-only training occupies a whole core whatever fraction Ray is told, so concurrency is counted
    in cores there; with a GPU share the share itself is the unit. Pooled, there is one actor per slot.
    Pinned, there are as many actors as blocks of clients; when that is more than the slots, each
    actor's request is scaled down so that all of them can be placed, and at most ``slots`` train at once.
    """
    req = rt.client_resources
    gpu = req.get("num_gpus", 0) > 0
    slots = math.inf
    for key, amount in req.items():
        if amount <= 0:
            continue
        have = cluster.get({"num_cpus": "CPU", "num_gpus": "GPU"}.get(key, key), 0.0)
        unit = amount if (gpu or key != "num_cpus") else max(amount, 1.0)
        slots = min(slots, math.floor(have / unit + 1e-9))
    if slots == math.inf:
        slots = max(1, int(cluster.get("CPU", 1)))
    if slots < 1:
        raise RuntimeError(f"the cluster ({cluster}) cannot fit one client with runtime.client_resources={req}")
    slots = int(slots)
    if rt.clients_per_actor == 0:
        num_actors = min(slots, num_clients)
        return Layout(num_actors, 0, num_actors, dict(req))
    per = rt.clients_per_actor
    num_actors = math.ceil(num_clients / per)
    scale = min(1.0, slots / num_actors)
    return Layout(num_actors, per, min(num_actors, slots), {k: v * scale for k, v in req.items()})


@dataclass(frozen=True)
class LostCall:
    """A call that died with its actor: which method, on which actor, for which clients, and whether it
    was sent again (calls that are safe to repeat) or its clients counted as failed (training)."""

    method: str
    actor: int
    clients: tuple[int, ...]
    retried: bool


class _Requeued:
    """A call that never ran (its actor had restarted bare): the item went back to the policy."""


class RayExecutor(Executor):
    """The executor protocol on a pool of ``ClientActor``s laid out by ``plan_layout``."""

    def __init__(self, setup: Setup, layout: Layout, log: Callable[[str], None] = print,
                 shared: SharedSetup | None = None):
        """``shared``: ``setup``'s arrays already in the object store (``share``), whose references the actors
        are handed; None: they are put there now."""
        cfg, ds, part = setup.cfg, setup.dataset, setup.partition
        self.layout = layout
        self.log = log
        self.sizes = part.sizes  # sample counts: the longest updates go first
        meta = {"num_classes": ds.num_classes, "mean": list(ds.mean), "std": list(ds.std), "augment": setup.augment}
        res = layout.actor_resources
        options = {
            "num_cpus": res.get("num_cpus", 1.0),
            "num_gpus": res.get("num_gpus", 0.0),
            "resources": {k: v for k, v in res.items() if k not in ("num_cpus", "num_gpus")},
            # Spread the pool over the nodes: memory and a lost node's share of the clients both stay small.
            # Inside a placement group (a Tune trial), the group decides: its bundles are the client slots.
            "scheduling_strategy": None if ray.util.get_current_placement_group() else "SPREAD",
            "max_restarts": cfg.runtime.max_restarts,
            "max_task_retries": 0,  # a lost call is reported as a failed client, never silently re-run
        }
        fault = faults.runtime_env()
        if fault is not None:  # only in the tests that kill an actor mid-call
            options["runtime_env"] = fault
        # Each array is in the object store once; every actor on a node maps the same copy. The executor
        # holds the references, so that a restarted actor can be attached again.
        self.shared = share(setup) if shared is None else shared
        refs = self.shared.refs
        train_x, train_y, counts, test_x, test_y = (refs[k] for k in (
            "dataset.train_x", "dataset.train_y", "partition.counts", "test.x", "test.y"))
        test_clients = refs.get("test.clients")
        self.actors = [ClientActor.options(**options).remote(cfg.to_dict(), meta) for _ in range(layout.num_actors)]
        self.home: dict[int, int] = {}
        if layout.pooled:
            self._attach_args = [[train_x, train_y, refs["partition.client_indices"], counts, test_x, test_y,
                                  refs["partition.meta_indices"], test_clients]]
        else:
            self._attach_args = []
            for a, ids in enumerate(layout.assignment(setup.all_client_ids)):
                self.home.update({c: a for c in ids})
                own = ray.put({c: part.client_indices[c] for c in ids})
                self._attach_args.append([train_x, train_y, own, counts, test_x, test_y,
                                          refs["partition.meta_indices"], test_clients])
        self.dead: set[int] = set()  # actors that did not come back within RESTART_TIMEOUT_S
        self.calls_done = [0] * layout.num_actors  # completed calls per actor: how the work was spread
        self.lost_calls: list[LostCall] = []  # calls that died with their actor, in the order they were lost
        ray.get([self._attach(a) for a in range(len(self.actors))])

    def _attach(self, a: int) -> ray.ObjectRef:
        args = self._attach_args[0 if self.layout.pooled else a]
        return self.actors[a].attach.remote(*args)

    # How long one look at a restarting actor waits for its answer (``_revive``).
    revive_poll_s = RESTART_TIMEOUT_S

    def _may_come_back(self, a: int) -> bool:
        """Whether actor ``a`` is worth waiting for (``_revive`` asks before each look)."""
        return True

    def _revive(self, a: int) -> bool:
        """Wait until actor ``a`` answers again and attach it if it restarted; False once it is given up
        as dead: it has no restarts left, or did not come back within RESTART_TIMEOUT_S. False, without
        giving it up, as soon as ``_may_come_back`` says it is not worth waiting for."""
        if a in self.dead:
            return False
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while time.monotonic() < deadline:
            if not self._may_come_back(a):
                return False
            try:
                if not ray.get(self.actors[a].ready.remote(), timeout=self.revive_poll_s)["attached"]:
                    ray.get(self._attach(a))
                return True
            except ActorDiedError:
                # A restarting actor holds new calls until it is back; one that fails them at once is
                # dead for good.
                break
            except (RayActorError, GetTimeoutError):
                time.sleep(0.2)
        self.dead.add(a)
        return False

    def _policy(self, items: list, client_of: Callable) -> LargestFirst | LongestQueueFirst:
        sizes = [float(sum(self.sizes[c] for c in client_of(item))) for item in items]
        if self.layout.pooled:
            return LargestFirst(items, sizes, list(range(len(self.actors))))
        queues: dict[int, list] = {}
        for i in sorted(range(len(items)), key=lambda i: -sizes[i]):
            queues.setdefault(self.home[client_of(items[i])[0]], []).append(items[i])
        return LongestQueueFirst(queues, self.layout.max_in_flight)

    def _run(self, method: str, items: list, client_of: Callable, submit: Callable,
             retry_lost: bool) -> Iterator[tuple[object, object]]:
        """Run ``items`` (each for the clients ``client_of(item)``) on the actors with ``submit``; yield
        (item, the call's value or the RayError that lost it).

        An actor that restarted bare gets the call again once it is attached. A call lost with its actor
        is yielded as an error, or (``retry_lost``: calls that are safe to repeat) sent again.
        """
        policy = self._policy(items, client_of)
        in_flight: dict[ray.ObjectRef, tuple[int, object]] = {}
        for a in sorted(self.dead):
            for item in policy.drop(a):
                yield item, RuntimeError(f"actor {a} is dead")

        def launch() -> None:
            for a, item in policy.take():
                in_flight[submit(self.actors[a], item)] = (a, item)

        launch()
        while in_flight:
            [ref], _ = ray.wait(list(in_flight), num_returns=1)
            a, item = in_flight.pop(ref)
            try:
                value = ray.get(ref)
                self.calls_done[a] += 1
            except RayError as e:
                value = e
                not_ready = isinstance(e, RayTaskError) and isinstance(e.cause, ActorNotReady)
                revived = self._revive(a)
                if isinstance(e, RayActorError):
                    self._lost(LostCall(method, a, tuple(client_of(item)), retry_lost and revived))
                if not revived:
                    for lost in policy.drop(a):
                        yield lost, RuntimeError(f"actor {a} is dead")
                elif not_ready or (retry_lost and isinstance(e, RayActorError)):
                    policy.requeue(a, item)
                    value = _Requeued
            policy.release(a)
            launch()
            if value is not _Requeued:
                yield item, value

    def _lost(self, call: LostCall) -> None:
        self.lost_calls.append(call)
        ids = ", ".join(map(str, call.clients))
        after = "sent again" if call.retried else "not sent again"
        self.log(f"actor {call.actor} died during {call.method} of client(s) {ids}; {after}")

    def train(self, round_idx: int, jobs: list[Job], message: RoundInput):
        message_ref = ray.put(message)
        submit = lambda actor, slot: actor.train.remote(*jobs[slot], message_ref, round_idx)
        for slot, value in self._run("train", list(range(len(jobs))), lambda slot: [jobs[slot][0]], submit,
                                     retry_lost=False):
            cid = jobs[slot][0]
            if isinstance(value, Exception):
                kind = " (actor died)" if isinstance(value, RayActorError) else ""
                # A Ray error's text holds the remote traceback.
                value = ClientFailure.from_exception(cid, value, kind, details=str(value))
            yield slot, value

    def ask(self, round_idx: int, phase: str, common: StateDict,
            questions: dict[int, StateDict]) -> dict[int, StateDict | ClientFailure]:
        common_ref = ray.put(common)
        submit = lambda actor, cid: actor.answer.remote(cid, phase, common_ref, questions[cid], round_idx)
        out: dict[int, StateDict | ClientFailure] = {}
        for cid, value in self._run("ask", list(questions), lambda cid: [cid], submit, retry_lost=True):
            if isinstance(value, Exception):
                kind = " (actor died)" if isinstance(value, RayActorError) else ""
                value = ClientFailure.from_exception(cid, value, kind, details=str(value))
            out[cid] = value
        return out

    def evaluate(self, jobs: list[Job], estimate: bool = False) -> EvalCounts:
        return self._spread("evaluate", jobs, lambda actor, chunk: actor.evaluate.remote(chunk, estimate))

    def finetune(self, jobs: list[Job], message: RoundInput, epochs: int, round_idx: int) -> EvalCounts:
        message_ref = ray.put(message)
        return self._spread("finetune", jobs,
                            lambda actor, chunk: actor.finetune.remote(chunk, message_ref, epochs, round_idx))

    def zero_shot(self, jobs: list[Job], message: RoundInput, round_idx: int) -> EvalCounts:
        message_ref = ray.put(message)
        return self._spread("zero_shot", jobs,
                            lambda actor, chunk: actor.zero_shot.remote(chunk, message_ref, round_idx))

    def _spread(self, method: str, jobs: list[Job], submit: Callable) -> EvalCounts:
        """Per-client counts from calls that are safe to repeat, in chunks over the actors."""
        if self.layout.pooled:
            n = min(len(jobs), EVAL_CHUNKS_PER_ACTOR * len(self.actors))
            chunks = [jobs[i::n] for i in range(n)]
        else:
            by_home: dict[int, list[Job]] = {}
            for job in jobs:
                by_home.setdefault(self.home[job[0]], []).append(job)
            chunks = list(by_home.values())
        merged = EvalCounts()
        for chunk, value in self._run(method, chunks, lambda chunk: [cid for cid, _ in chunk], submit,
                                      retry_lost=True):
            if isinstance(value, Exception):
                merged.failed.update({cid: f"{type(value).__name__}: {value}" for cid, _ in chunk})
            else:
                merged.merge(value)
        return merged

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
