"""The coordinator actor and the Ray executor it drives.

The coordinator holds the global weights and runs ``Federation`` (the same round loop as the
in-process runtime). Its executor places the clients on ``ClientActor``s, puts the round's global
weights in the object store once, keeps at most as many training calls in flight as the cluster can
run at once, and turns a dead actor or a raising client into a counted ``ClientFailure``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from .actors import ClientActor
from .aggregate import StateDict
from .checkpoint import Snapshot
from .client import ClientFailure, ClientState, EvalCounts
from .config import RuntimeConfig
from .federation import Federation, Setup
from .local import RoundInput
from .runner import export_federation, save_federation
from .scheduling import LongestQueueFirst
from .storage import RunStorage

RESTART_TIMEOUT_S = 120.0


@dataclass
class Layout:
    """How clients map onto actors, what each actor asks Ray for, and how many trainings run at once."""

    num_actors: int
    clients_per_actor: int
    max_in_flight: int
    actor_resources: dict[str, float]  # Ray resources of one actor: the client's, scaled down to fit

    def assignment(self, client_ids: list[int]) -> list[list[int]]:
        """Contiguous blocks of ids, one per actor."""
        per = self.clients_per_actor
        return [client_ids[i:i + per] for i in range(0, len(client_ids), per)]


# Default actors per training slot. Clients are pinned to actors, so with one actor per core a round
# waits for whichever actor drew the most sampled clients; a few actors per core let the scheduler
# balance the round (bench/round_overhead.py: 1.08x the floor with 1 actor per core, 1.01x with 2).
ACTORS_PER_SLOT = 2


def plan_layout(rt: RuntimeConfig, num_clients: int, cluster: dict[str, float]) -> Layout:
    """Size the actor pool from the cluster's resources.

    A CPU-only training occupies a whole core whatever fraction Ray is told, so concurrency is counted
    in cores there; with a GPU share the share itself is the unit. When there are more actors than
    slots, each actor's request is scaled down so that all of them can be placed; at most ``slots``
    of them train at once.
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
    if rt.clients_per_actor > 0:
        per = rt.clients_per_actor
    else:
        per = math.ceil(num_clients / min(num_clients, ACTORS_PER_SLOT * slots))
    num_actors = math.ceil(num_clients / per)
    scale = min(1.0, slots / num_actors)
    return Layout(num_actors, per, min(num_actors, slots), {k: v * scale for k, v in req.items()})


class RayExecutor:
    def __init__(self, setup: Setup, storage: RunStorage, layout: Layout):
        cfg, ds, part = setup.cfg, setup.dataset, setup.partition
        self.layout = layout
        # The dataset enters the object store once; every actor maps it read-only and copies out only
        # the examples of its own clients.
        train_x, train_y = ray.put(ds.train_x.numpy()), ray.put(ds.train_y.numpy())
        test_x, test_y = ray.put(setup.test.x.numpy()), ray.put(setup.test.y.numpy())
        # Held for the executor's lifetime: a restarting actor re-reads its constructor arguments.
        self._data_refs = (train_x, train_y, test_x, test_y)
        meta = {"num_classes": ds.num_classes, "mean": list(ds.mean), "std": list(ds.std), "augment": setup.augment}
        rt = cfg.runtime
        res = layout.actor_resources
        options = {
            "num_cpus": res.get("num_cpus", 1.0),
            "num_gpus": res.get("num_gpus", 0.0),
            "resources": {k: v for k, v in res.items() if k not in ("num_cpus", "num_gpus")},
            # Spread the pool over the nodes: memory and a lost node's share of the clients both stay small.
            "scheduling_strategy": "SPREAD",
            "max_restarts": rt.max_restarts,
            "max_task_retries": 0,  # a lost call is reported as a failed client, never silently re-run
        }
        self.actors = []
        self.dead: set[int] = set()  # actors that did not come back within RESTART_TIMEOUT_S
        self.home: dict[int, int] = {}
        for a, ids in enumerate(layout.assignment(setup.all_client_ids)):
            self.actors.append(ClientActor.options(**options).remote(
                cfg.to_dict(), ids, train_x, train_y, {c: part.client_indices[c] for c in ids},
                {c: part.counts[c] for c in ids}, test_x, test_y, meta, storage.uri))
            self.home.update({c: a for c in ids})
        ray.get([actor.ready.remote() for actor in self.actors])

    def train(self, round_idx: int, client_ids: list[int], message: RoundInput):
        message_ref = ray.put(message)
        queues: dict[int, list[tuple[int, int]]] = {}
        for slot, cid in enumerate(client_ids):
            if self.home[cid] in self.dead:
                yield slot, ClientFailure(cid, f"actor {self.home[cid]} is dead", "")
            else:
                queues.setdefault(self.home[cid], []).append((slot, cid))
        policy = LongestQueueFirst(queues, self.layout.max_in_flight)
        in_flight: dict[ray.ObjectRef, tuple[int, int, int]] = {}

        def launch() -> None:
            for a, (slot, cid) in policy.take():
                in_flight[self.actors[a].train.remote(cid, message_ref, round_idx)] = (a, slot, cid)

        launch()
        while in_flight:
            [ref], _ = ray.wait(list(in_flight), num_returns=1)
            a, slot, cid = in_flight.pop(ref)
            try:
                result = ray.get(ref)
            except RayError as e:
                kind = "actor died" if isinstance(e, RayActorError) else "task failed"
                result = ClientFailure(cid, f"{type(e).__name__} ({kind}): {str(e).splitlines()[0]}", str(e))
                # Calls sent to a restarting actor fail at once: wait for it, so that only the client
                # it was training is lost, not the rest of its queue.
                if isinstance(e, RayActorError) and not self._wait_alive(a):
                    for q_slot, q_cid in policy.drop(a):
                        yield q_slot, ClientFailure(q_cid, f"actor {a} is dead", str(e))
            policy.release(a)
            launch()
            yield slot, result

    def _wait_alive(self, a: int) -> bool:
        """Block until actor ``a`` answers again (restarted); False once it is given up as dead."""
        if a in self.dead:
            return False
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                ray.get(self.actors[a].ready.remote(), timeout=RESTART_TIMEOUT_S)
                return True
            except (RayActorError, GetTimeoutError):
                time.sleep(0.2)
        self.dead.add(a)
        return False

    def _call_all(self, method: str, *args_per_actor):
        """One call per actor, re-sent to an actor that died once it has restarted from the checkpoint."""
        out = []
        for a, actor in enumerate(self.actors):
            args = [arg[a] for arg in args_per_actor]
            out.append(getattr(actor, method).remote(*args))
        results = []
        for a, ref in enumerate(out):
            try:
                results.append(ray.get(ref))
            except RayActorError:
                if not self._wait_alive(a):
                    raise
                args = [arg[a] for arg in args_per_actor]
                results.append(ray.get(getattr(self.actors[a], method).remote(*args)))
        return results

    def evaluate(self, client_ids: list[int], global_shared: StateDict) -> EvalCounts:
        ref = ray.put(global_shared)
        per_actor = [[c for c in client_ids if self.home[c] == a] for a in range(len(self.actors))]
        merged = EvalCounts()
        for counts in self._call_all("evaluate", per_actor, [ref] * len(self.actors)):
            merged.correct.update(counts.correct)
            merged.total.update(counts.total)
            merged.failed.update(counts.failed)
        return merged

    def get_states(self) -> dict[int, ClientState]:
        states: dict[int, ClientState] = {}
        for part in self._call_all("get_states"):
            states.update(part)
        return states

    def set_states(self, states: dict[int, ClientState]) -> None:
        per_actor = [{c: s for c, s in states.items() if self.home[c] == a} for a in range(len(self.actors))]
        self._call_all("set_states", per_actor)

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


class CoordinatorImpl:
    """Owns the federation on the cluster. It is handed the prepared setup (and, to resume, a
    snapshot) by the driver, which calls its round step and decides what is saved when."""

    def __init__(self, setup: Setup, storage_uri: str, snapshot: Snapshot | None = None):
        cfg = setup.cfg
        torch.set_num_threads(max(1, cfg.runtime.torch_threads or 1))
        self.layout = plan_layout(cfg.runtime, len(setup.all_client_ids), ray.cluster_resources())
        self.executor = RayExecutor(setup, RunStorage(storage_uri), self.layout)
        self.federation = Federation(setup, self.executor, log=print)
        if snapshot is not None:
            self.federation.restore(snapshot)

    def info(self) -> dict:
        return {"next_round": self.federation.next_round, "num_actors": self.layout.num_actors,
                "clients_per_actor": self.layout.clients_per_actor, "max_in_flight": self.layout.max_in_flight}

    def step(self, round_idx: int) -> dict:
        return self.federation.step(round_idx)

    def progress(self) -> tuple[int, int, int]:
        """(round, clients finished, clients sampled) of the round in hand; called from a second thread."""
        return self.federation.round_progress

    def save_checkpoint(self, storage_uri: str) -> None:
        save_federation(self.federation, RunStorage(storage_uri))

    def save_final(self, storage_uri: str, metrics: dict) -> None:
        export_federation(self.federation, RunStorage(storage_uri), metrics)

    def close(self) -> None:
        self.executor.close()


Coordinator = ray.remote(CoordinatorImpl)
