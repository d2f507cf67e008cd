"""Ray actors: ``ClientActor`` wraps a ClientHost, which trains and evaluates clients whose state comes
with each call.

An actor is created bare and then handed the data with ``attach``: object references in a
constructor's arguments would pin those objects for as long as the actor may restart, and a
restarted actor comes back bare, so the executor attaches it again (``ready()['attached']``).
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import ray
import torch

from ..client_update.local import RoundInput
from ..config import config_from_dict
from ..models.metrics import TestSet
from . import faults
from .client import ClientContext, ClientHost, ClientState, EvalCounts


class ActorNotReady(RuntimeError):
    """The actor has no data (it restarted since it was attached): attach it and send the call again."""


class ClientActorImpl:
    def __init__(self, cfg_dict: dict, meta: dict):
        self.cfg = config_from_dict(cfg_dict)
        self.meta = meta
        resources = self.cfg.runtime.client_resources
        threads = self.cfg.runtime.torch_threads or max(1, int(resources.get("num_cpus", 1)))
        torch.set_num_threads(threads)
        # A GPU share puts this actor's clients on the GPU; the same code runs on CPU without one.
        use_gpu = resources.get("num_gpus", 0) > 0 and bool(ray.get_gpu_ids()) and torch.cuda.is_available()
        self.device = "cuda" if use_gpu else "cpu"
        self.host: ClientHost | None = None
        self.fault = faults.from_env()  # None but in the tests that kill an actor mid-call

    def attach(self, train_x: np.ndarray, train_y: np.ndarray, indices: dict[int, np.ndarray] | list[np.ndarray],
               counts: np.ndarray, test_x: np.ndarray, test_y: np.ndarray, meta_indices: np.ndarray,
               test_clients: np.ndarray | None = None) -> None:
        """Take the dataset: arrays from the object store arrive as zero-copy read-only views, shared by
        every actor on the node; a client's examples are copied out per call. ``test_clients``: each test
        example's client, where clients have test sets of their own."""
        meta = self.meta
        with warnings.catch_warnings():
            # The object store's arrays are read-only; nothing here writes to them.
            warnings.simplefilter("ignore", UserWarning)
            test = TestSet(torch.from_numpy(test_x), torch.from_numpy(test_y), meta["num_classes"],
                           None if test_clients is None else torch.from_numpy(test_clients))
            self.host = ClientHost(self.cfg, ClientContext(
                torch.from_numpy(train_x), torch.from_numpy(train_y), indices, counts, test, tuple(meta["mean"]),
                tuple(meta["std"]), meta["augment"], meta_indices, self.device))

    def ready(self) -> dict:
        return {"attached": self.host is not None, "device": self.device, "threads": torch.get_num_threads(),
                "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def _host(self) -> ClientHost:
        if self.host is None:
            raise ActorNotReady("this client actor restarted and has no data yet")
        return self.host

    def train(self, client_id: int, state: ClientState, message: RoundInput, round_idx: int):
        if self.fault is not None:
            self.fault.reached("train", [client_id], round_idx)
        return self._host().train(client_id, state, message, round_idx)

    def answer(self, client_id: int, phase: str, common: dict, question: dict, round_idx: int):
        return self._host().answer(client_id, phase, common, question, round_idx)

    def evaluate(self, jobs: list[tuple[int, ClientState]], estimate: bool = False) -> EvalCounts:
        if self.fault is not None:
            self.fault.reached("evaluate", [cid for cid, _ in jobs])
        return self._host().evaluate(jobs, estimate)

    def finetune(self, jobs: list[tuple[int, ClientState]], message: RoundInput, epochs: int,
                 round_idx: int) -> EvalCounts:
        return self._host().finetune(jobs, message, epochs, round_idx)

    def zero_shot(self, jobs: list[tuple[int, ClientState]], message: RoundInput, round_idx: int) -> EvalCounts:
        return self._host().zero_shot(jobs, message, round_idx)


ClientActor = ray.remote(ClientActorImpl)
