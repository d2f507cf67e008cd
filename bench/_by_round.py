"""The coordinator of a Ray run driven round by round, for the benchmarks that time a round's pieces
(imported as ``_by_round``; not part of the library).

``fedrod-ray train --mode ray`` runs a whole ``run.Run`` in its coordinator actor; a benchmark instead
steps the federation itself and decides when, and into which run directories, its checkpoints are saved
(on the round's path or in the background), so that each piece can be timed alone. The federation is
placed as the coordinator places it: the same layout and Ray executor.
"""

from __future__ import annotations

import ray
import torch

from fedrod_ray.executors.ray import RayExecutor, plan_layout
from fedrod_ray.federation_state.checkpoint import BackgroundSaves, CheckpointWriter
from fedrod_ray.federation_state.setup import Setup
from fedrod_ray.federation_state.state import Snapshot
from fedrod_ray.outputs.storage import RunStorage
from fedrod_ray.round_loop.federation import Federation


class CoordinatorByRound:
    def __init__(self, setup: Setup):
        cfg = setup.cfg
        torch.set_num_threads(max(1, cfg.runtime.torch_threads or 1))
        self.layout = plan_layout(cfg.runtime, len(setup.all_client_ids), ray.cluster_resources())
        self.executor = RayExecutor(setup, self.layout)
        self.federation = Federation(setup, self.executor, log=print)
        self.writers: dict[str, CheckpointWriter] = {}
        self.saves = BackgroundSaves()

    def info(self) -> dict:
        return {"num_actors": self.layout.num_actors, "clients_per_actor": self.layout.clients_per_actor,
                "max_in_flight": self.layout.max_in_flight}

    def step(self, round_idx: int) -> dict:
        return self.federation.step(round_idx)

    def snapshot(self) -> Snapshot:
        return self.federation.snapshot()

    def save_checkpoint(self, storage_uri: str) -> None:
        """Start saving the federation's snapshot of now into ``storage_uri`` (once the save before it is
        committed), in the background as a run saves; ``wait_checkpoint`` waits for it."""
        writer = self.writers.setdefault(storage_uri, CheckpointWriter(RunStorage(storage_uri)))
        self.saves.save(writer, self.federation.snapshot())

    def wait_checkpoint(self) -> str | None:
        return self.saves.wait()

    def close(self) -> None:
        self.executor.close()


Coordinator = ray.remote(CoordinatorByRound)
