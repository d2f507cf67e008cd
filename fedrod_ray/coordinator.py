"""The coordinator actor: it runs ``Federation`` (the same round loop as the in-process runtime) on the
cluster, with the Ray executor (``fedrod_ray.executors.ray``), and so owns every client's committed state.
"""

from __future__ import annotations

import ray
import torch

from .checkpoint import BackgroundSaves, CheckpointWriter
from .executors.ray import RayExecutor, plan_layout
from .federation import Federation
from .final import write_final
from .setup import Setup
from .state import Snapshot
from .storage import RunStorage


class CoordinatorImpl:
    """Owns the federation on the cluster. It is handed the prepared setup (and, to resume, a
    snapshot) by the driver, which calls its round step and decides what is saved when."""

    def __init__(self, setup: Setup, snapshot: Snapshot | None = None):
        cfg = setup.cfg
        torch.set_num_threads(max(1, cfg.runtime.torch_threads or 1))
        self.layout = plan_layout(cfg.runtime, len(setup.all_client_ids), ray.cluster_resources())
        self.executor = RayExecutor(setup, self.layout)
        self.federation = Federation(setup, self.executor, log=print)
        if snapshot is not None:
            self.federation.restore(snapshot)
        self.writers: dict[str, CheckpointWriter] = {}
        self.saves = BackgroundSaves()

    def info(self) -> dict:
        return {"next_round": self.federation.next_round, "rounds": self.federation.rounds,
                "num_actors": self.layout.num_actors,
                "clients_per_actor": self.layout.clients_per_actor, "max_in_flight": self.layout.max_in_flight}

    def step(self, round_idx: int) -> dict:
        return self.federation.step(round_idx)

    def progress(self) -> tuple[int, int, int]:
        """(round, clients finished, clients sampled) of the round in hand; called from a second thread."""
        return self.federation.round_progress

    def snapshot(self) -> Snapshot:
        return self.federation.snapshot()

    def save_checkpoint(self, storage_uri: str) -> None:
        """Start saving the federation's snapshot of now into ``storage_uri`` (once the save before it is
        committed); it goes on while the next round trains. ``wait_checkpoint`` waits for it."""
        writer = self.writers.setdefault(storage_uri, CheckpointWriter(RunStorage(storage_uri)))
        self.saves.save(writer, self.federation.snapshot())

    def wait_checkpoint(self) -> str | None:
        return self.saves.wait()

    def save_final(self, storage_uri: str, metrics: dict) -> None:
        write_final(RunStorage(storage_uri), self.federation.setup, self.federation.snapshot(), metrics)

    def close(self) -> None:
        self.executor.close()


Coordinator = ray.remote(CoordinatorImpl)
