"""The round loop, shared by every runtime: configure -> local train -> aggregate -> evaluate.

``Federation`` holds the server's state (global weights, FedDyn's h) and drives an *executor* that
owns the clients: ``InProcessExecutor`` trains them one after another in this process, and the Ray
runtime's executor sends the same calls to client actors. The math lives in pure modules
(``local``, ``aggregate``, ``server``, ``metrics``); this file only sequences it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from .aggregate import OrderedAverager, StateDict
from .checkpoint import Checkpoint, save_checkpoint, save_final
from .client import ClientFailure, ClientHost, ClientState, EvalCounts
from .config import ExperimentConfig, dump_config
from .data import ImageDataset, load_dataset
from .data.transforms import normalize
from .local import LocalResult, round_lr
from .metrics import TestSet, accuracy, generic_class_correct, pfl_accuracy
from .models import FedModel, build_model, resolve_arch
from .partition import Partition, make_partition
from .results import MetricsLog
from .server import sample_clients, server_update
from .storage import RunStorage


class RoundFailedError(RuntimeError):
    """Too many clients of a round failed for its average to be trusted."""


@dataclass
class Setup:
    """Everything derived from the config before training starts (same on every machine)."""

    cfg: ExperimentConfig
    dataset: ImageDataset
    partition: Partition
    test: TestSet
    augment: bool

    @property
    def num_clients(self) -> int:
        """Training clients; ids from num_clients on are held-out new clients."""
        return self.partition.num_train_clients

    @property
    def all_client_ids(self) -> list[int]:
        return list(range(len(self.partition.client_indices)))

    @property
    def class_dists(self) -> torch.Tensor:
        counts = torch.as_tensor(self.partition.counts, dtype=torch.float64)
        return counts / counts.sum(1, keepdim=True).clamp_min(1)

    @property
    def variant(self) -> str | None:
        return self.cfg.train.variant if self.cfg.train.algorithm == "fedrod" else None

    def build_model(self) -> FedModel:
        ds = self.dataset
        return build_model(self.cfg.model.arch, ds.num_classes, ds.image_shape, self.variant,
                           self.cfg.model.hyper_hidden, self.cfg.seed)

    def model_meta(self) -> dict:
        ds = self.dataset
        return {
            "arch": resolve_arch(self.cfg.model.arch, ds.image_shape), "variant": self.variant, "algorithm": self.cfg.train.algorithm,
            "num_classes": ds.num_classes, "image_shape": list(ds.image_shape), "mean": list(ds.mean),
            "std": list(ds.std), "hyper_hidden": self.cfg.model.hyper_hidden, "dataset": ds.name,
        }


def prepare(cfg: ExperimentConfig) -> Setup:
    ds = load_dataset(cfg.data, seed=cfg.seed)
    partition = make_partition(cfg.data, ds.train_y.numpy(), ds.num_classes, cfg.seed)
    test = TestSet(normalize(ds.test_x, ds.mean, ds.std), ds.test_y, ds.num_classes)
    augment = ds.augment if cfg.train.augment is None else cfg.train.augment
    return Setup(cfg, ds, partition, test, augment)


def make_host(setup: Setup, client_ids: list[int], device: str = "cpu") -> ClientHost:
    ds, part = setup.dataset, setup.partition
    return ClientHost(
        setup.cfg, client_ids, ds.train_x, ds.train_y,
        {cid: part.client_indices[cid] for cid in client_ids}, {cid: part.counts[cid] for cid in client_ids},
        setup.test, ds.mean, ds.std, setup.augment, ds.num_classes, device,
    )


class Executor(Protocol):
    def train(self, round_idx: int, client_ids: list[int],
              global_shared: StateDict) -> Iterator[tuple[int, LocalResult | ClientFailure]]:
        """Yield (position in client_ids, result) as each client finishes, in any order."""

    def evaluate(self, client_ids: list[int], global_shared: StateDict) -> EvalCounts: ...

    def get_states(self) -> dict[int, ClientState]: ...

    def set_states(self, states: dict[int, ClientState]) -> None: ...

    def close(self) -> None: ...


class InProcessExecutor:
    """All clients in one ClientHost, trained sequentially in this process."""

    def __init__(self, host: ClientHost):
        self.host = host

    def train(self, round_idx, client_ids, global_shared):
        for slot, cid in enumerate(client_ids):
            yield slot, self.host.train(cid, global_shared, round_idx)

    def evaluate(self, client_ids, global_shared):
        return self.host.evaluate(client_ids, global_shared)

    def get_states(self):
        return self.host.get_states()

    def set_states(self, states):
        self.host.set_states(states)

    def close(self) -> None:
        pass


def run_local(cfg: ExperimentConfig, storage: RunStorage, ckpt: Checkpoint | None = None,
              log: Callable[[str], None] = print) -> dict:
    """Train in this process, every client sequentially (``runtime.mode: local``)."""
    if cfg.runtime.torch_threads:
        torch.set_num_threads(cfg.runtime.torch_threads)
    setup = prepare(cfg)
    fed = Federation(setup, InProcessExecutor(make_host(setup, setup.all_client_ids, cfg.runtime.device)),
                     storage, log)
    if ckpt is not None:
        fed.restore(ckpt)
    return fed.run()


class Federation:
    def __init__(self, setup: Setup, executor: Executor, storage: RunStorage,
                 log: Callable[[str], None] = print):
        self.setup = setup
        self.cfg = setup.cfg
        self.executor = executor
        self.storage = storage
        self.log = log
        self.model = setup.build_model()
        state = self.model.state_dict()
        self.global_shared: StateDict = {k: state[k].detach().clone() for k in self.model.shared_keys()}
        self.dyn_h: StateDict | None = None
        self.next_round = 0
        self.metrics = MetricsLog(storage)

    def restore(self, ckpt: Checkpoint) -> None:
        self.global_shared = ckpt.global_shared
        self.dyn_h = ckpt.server_state
        self.next_round = ckpt.round_idx + 1
        self.executor.set_states(ckpt.clients)
        self.metrics = MetricsLog.resume(self.storage, ckpt.round_idx)

    def start(self) -> None:
        self.storage.write_bytes("config.yaml", dump_config(self.cfg).encode())

    def finish(self) -> dict:
        """Write ``final/`` (the model the HTTP service loads); returns the last metrics record."""
        save_final(self.storage, self.global_shared, {**self.setup.model_meta(), "rounds": self.cfg.train.rounds})
        return self.metrics.records[-1] if self.metrics.records else {}

    def run(self) -> dict:
        self.start()
        for r in range(self.next_round, self.cfg.train.rounds):
            self.log(format_record(self.run_round(r), self.cfg.train.rounds))
        return self.finish()

    def run_round(self, r: int) -> dict:
        cfg = self.cfg
        t0 = time.perf_counter()
        ids = sample_clients(cfg.seed, r, self.setup.num_clients, cfg.train.client_fraction)
        averager = OrderedAverager(len(ids))
        results: list[LocalResult] = []
        failures: list[ClientFailure] = []
        for slot, res in self.executor.train(r, ids, self.global_shared):
            if isinstance(res, ClientFailure):
                averager.skip(slot)
                failures.append(res)
                self.log(f"[round {r + 1}] client {res.client_id} failed: {res.error}\n{res.traceback}")
                self._check_failures(r, len(ids), failures)
            else:
                averager.add(slot, res.shared, res.num_samples)
                results.append(res)
        self._check_failures(r, len(ids), failures)
        averaged = averager.result()
        self.global_shared, self.dyn_h = server_update(
            cfg.train, self.global_shared, averaged, self.model.generic_keys(), averager.count,
            self.setup.num_clients, self.dyn_h)
        train_seconds = time.perf_counter() - t0

        weights = np.array([res.num_samples for res in results], dtype=np.float64)
        record = {
            "round": r, "name": cfg.name, "lr": round_lr(cfg.train, r),
            "clients": len(ids), "clients_done": len(results), "clients_failed": len(failures),
            "failed_ids": [f.client_id for f in failures],
            "train_loss": float(np.average([res.loss for res in results], weights=weights)),
            "personal_loss": (float(np.average([res.personal_loss for res in results], weights=weights))
                              if results[0].personal_loss is not None else None),
            "train_seconds": round(train_seconds, 4),
        }
        if (r + 1) % cfg.eval.eval_every == 0 or r + 1 == cfg.train.rounds:
            record.update(self.evaluate())
        record["seconds"] = round(time.perf_counter() - t0, 4)
        self.metrics.append(record)
        if (r + 1) % cfg.runtime.checkpoint_every == 0 or r + 1 == cfg.train.rounds:
            save_checkpoint(self.storage, Checkpoint(r, cfg, self.global_shared, self.dyn_h,
                                                     self.executor.get_states()))
        return record

    def _check_failures(self, r: int, sampled: int, failures: list[ClientFailure]) -> None:
        rt = self.cfg.runtime
        if len(failures) > rt.max_failed_fraction * sampled or sampled - len(failures) < min(
                rt.min_clients_per_round, sampled):
            ids = ", ".join(str(f.client_id) for f in failures)
            raise RoundFailedError(
                f"round {r + 1}: {len(failures)} of {sampled} clients failed (clients {ids}); the limits are "
                f"runtime.max_failed_fraction={rt.max_failed_fraction} and "
                f"runtime.min_clients_per_round={rt.min_clients_per_round}. First error: {failures[0].error}")

    def evaluate(self) -> dict:
        """G-FL (GM), and P-FL of the GM and the PMs, for training clients and held-out new clients."""
        self.model.load_partial(self.global_shared)
        correct, total = generic_class_correct(self.model, self.setup.test, self.cfg.eval.batch_size)
        dists = self.setup.class_dists
        ids = self.setup.all_client_ids
        pm = self.executor.evaluate(ids, self.global_shared)
        for cid, error in sorted(pm.failed.items()):
            self.log(f"client {cid}: personalized model not evaluated: {error}")
        pfl_gm = pfl_accuracy(correct, total, dists)
        m = self.setup.num_clients
        ok = [c for c in ids if c in pm.correct]
        pfl_pm = dict(zip(ok, pfl_accuracy(torch.stack([pm.correct[c] for c in ok]),
                                           torch.stack([pm.total[c] for c in ok]), dists[ok]).tolist()))
        out = {
            "gfl_gm": accuracy(correct, total),
            "pfl_gm": float(pfl_gm[:m].mean()),
            # Over the clients whose PM could be evaluated (pm_eval_failed counts the others).
            "pfl_pm": _mean([pfl_pm[c] for c in ok if c < m]),
            "pm_eval_failed": len(pm.failed),
        }
        if len(ids) > m:
            out["pfl_gm_new"] = float(pfl_gm[m:].mean())
            out["pfl_pm_new"] = _mean([pfl_pm[c] for c in ok if c >= m])
        return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def format_record(rec: dict, rounds: int) -> str:
    line = (f"[round {rec['round'] + 1:>3}/{rounds}] {rec['seconds']:6.1f}s  lr {rec['lr']:.4g}  "
            f"clients {rec['clients_done']}/{rec['clients']} (failed {rec['clients_failed']})  "
            f"loss {rec['train_loss']:.3f}")
    if "gfl_gm" in rec:
        line += (f"  |  G-FL {100 * rec['gfl_gm']:.2f}  P-FL GM {100 * rec['pfl_gm']:.2f}"
                 f"  PM {100 * rec['pfl_pm']:.2f}")
        if "pfl_pm_new" in rec:
            line += f"  new GM {100 * rec['pfl_gm_new']:.2f} PM {100 * rec['pfl_pm_new']:.2f}"
    return line
