"""Ray actors: ``ClientActor`` wraps a ClientHost (one or more clients with their persistent state)."""

from __future__ import annotations

import os
import warnings

import numpy as np
import ray
import torch

from .aggregate import StateDict
from .checkpoint import latest_checkpoint_name, load_checkpoint
from .client import ClientHost, ClientState
from .config import config_from_dict
from .local import RoundInput
from .metrics import TestSet
from .storage import RunStorage


class ClientActorImpl:
    """A ClientHost in its own process. Arrays arrive from the object store as zero-copy read-only views;
    the host copies only its own clients' examples out of them."""

    def __init__(self, cfg_dict: dict, client_ids: list[int], train_x: np.ndarray, train_y: np.ndarray,
                 indices: dict[int, np.ndarray], counts: dict[int, np.ndarray], test_x: np.ndarray,
                 test_y: np.ndarray, meta: dict, storage_uri: str):
        cfg = config_from_dict(cfg_dict)
        resources = cfg.runtime.client_resources
        threads = cfg.runtime.torch_threads or max(1, int(resources.get("num_cpus", 1)))
        torch.set_num_threads(threads)
        # A GPU share puts this actor's clients on the GPU; the same code runs on CPU without one.
        use_gpu = resources.get("num_gpus", 0) > 0 and bool(ray.get_gpu_ids()) and torch.cuda.is_available()
        device = "cuda" if use_gpu else "cpu"
        with warnings.catch_warnings():
            # The object store's arrays are read-only; nothing here writes to them.
            warnings.simplefilter("ignore", UserWarning)
            test = TestSet(torch.from_numpy(test_x), torch.from_numpy(test_y), meta["num_classes"])
            self.host = ClientHost(cfg, client_ids, torch.from_numpy(train_x), torch.from_numpy(train_y), indices,
                                   counts, test, tuple(meta["mean"]), tuple(meta["std"]), meta["augment"],
                                   meta["num_classes"], device)
        self.restored_round = self._restore(storage_uri)

    def _restore(self, storage_uri: str) -> int | None:
        """After a restart, take this actor's clients' state from the run's latest checkpoint.

        A first start gets its state from the coordinator (``set_states``) when a run resumes.
        """
        storage = RunStorage(storage_uri)
        with warnings.catch_warnings():
            # Ray 2.60's own implementation of this property calls a deprecated API of its own.
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if not restarted or latest_checkpoint_name(storage) is None:
            return None
        ckpt = load_checkpoint(storage)
        self.host.set_states({cid: st for cid, st in ckpt.clients.items() if cid in self.host.states})
        return ckpt.rounds_done

    def ready(self) -> dict:
        return {"clients": self.host.client_ids, "restored_round": self.restored_round,
                "device": str(self.host.device), "threads": torch.get_num_threads(), "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id()}

    def train(self, client_id: int, message: RoundInput, round_idx: int):
        return self.host.train(client_id, message, round_idx)

    def evaluate(self, client_ids: list[int], global_shared: StateDict):
        return self.host.evaluate(client_ids, global_shared)

    def get_states(self) -> dict[int, ClientState]:
        return self.host.get_states()

    def set_states(self, states: dict[int, ClientState]) -> None:
        self.host.set_states(states)


ClientActor = ray.remote(ClientActorImpl)
