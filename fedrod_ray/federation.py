"""The round loop, shared by every runtime: configure -> local train -> aggregate -> evaluate.

``Federation`` holds the server's state (global weights, the generic rule's state) and drives an
*executor* that owns the clients: ``InProcessExecutor`` trains them one after another in this
process, and the Ray runtime's executor sends the same calls to client actors. The math lives in
pure modules (``local``, ``aggregate``, ``algorithms``, ``metrics``); this file only sequences it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from .aggregate import OrderedAverager, StateDict
from .algorithms import build_rule
from .checkpoint import Snapshot
from .client import ClientContext, ClientFailure, ClientHost, ClientState, EvalCounts
from .config import ExperimentConfig
from .data import ImageDataset, class_names, load_dataset
from .data.transforms import normalize
from .export import ModelMeta
from .local import LocalResult, RoundInput, class_distribution, round_lr
from .metrics import TestSet, accuracy, class_correct, features_and_logits, pfl_accuracy
from .models import FedModel, build_model, resolve_arch
from .objectives import meta_per_class, model_parts
from .partition import Partition, make_partition
from .server import sample_clients

PM_BATCH = 64  # clients whose global-reading PM is scored at once: (64, test size, classes) logits
# The evaluation fields of a round record (what final/meta.json keeps of the last evaluation).
METRIC_KEYS = ("gfl_gm", "pfl_gm", "pfl_pm", "pfl_pm_global", "pfl_ft", "pfl_gm_new", "pfl_new_before",
               "pfl_new_after", "pm_eval_failed", "finetune_failed")


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
        # A copy: after a trip through Ray's object store the partition's arrays are read-only.
        counts = torch.tensor(self.partition.counts, dtype=torch.float64)
        return counts / counts.sum(1, keepdim=True).clamp_min(1)

    def build_model(self) -> FedModel:
        ds = self.dataset
        return build_model(self.cfg.model.arch, ds.num_classes, ds.image_shape, self.cfg.train.variant,
                           self.cfg.hyper_hidden, self.cfg.seed, model_parts(self.cfg.train), self.cfg.model.init)

    def model_meta(self, rounds_done: int, metrics: dict[str, float]) -> ModelMeta:
        ds, cfg = self.dataset, self.cfg
        return ModelMeta(
            dataset=ds.name, class_names=class_names(ds.name, ds.num_classes), image_shape=list(ds.image_shape),
            mean=list(ds.mean), std=list(ds.std), arch=resolve_arch(cfg.model.arch, ds.image_shape),
            head=cfg.train.head, hyper_hidden=cfg.hyper_hidden, rule=cfg.train.generic_rule,
            balanced_loss=cfg.train.balanced_loss, round=rounds_done, metrics=metrics,
        )


def prepare(cfg: ExperimentConfig) -> Setup:
    ds = load_dataset(cfg.data, seed=cfg.seed)
    partition = make_partition(cfg.data, ds.train_y.numpy(), ds.num_classes, cfg.seed, meta_per_class(cfg.train))
    test = TestSet(normalize(ds.test_x, ds.mean, ds.std), ds.test_y, ds.num_classes)
    augment = ds.augment if cfg.train.augment is None else cfg.train.augment
    return Setup(cfg, ds, partition, test, augment)


def make_host(setup: Setup, device: str = "cpu") -> ClientHost:
    ds, part = setup.dataset, setup.partition
    return ClientHost(setup.cfg, ClientContext(ds.train_x, ds.train_y, part.client_indices, part.counts, setup.test,
                                               ds.mean, ds.std, setup.augment, part.meta_indices, device))


Job = tuple[int, ClientState]  # a client id and the state its call starts from


class Executor(Protocol):
    def train(self, round_idx: int, jobs: list[Job],
              message: RoundInput) -> Iterator[tuple[int, tuple[LocalResult, ClientState] | ClientFailure]]:
        """Yield (position in jobs, (result, new state) or failure) as each client finishes, in any order."""

    def evaluate(self, jobs: list[Job]) -> EvalCounts:
        """PM test counts of clients that have trained (``ClientHost.evaluate``)."""

    def finetune(self, jobs: list[Job], message: RoundInput, epochs: int, round_idx: int) -> EvalCounts:
        """PM test counts after fine-tuning from the global model (``ClientHost.finetune``)."""

    def close(self) -> None: ...


class InProcessExecutor:
    """One ClientHost for every client, trained sequentially in this process."""

    def __init__(self, host: ClientHost):
        self.host = host

    def train(self, round_idx, jobs, message):
        for slot, (cid, state) in enumerate(jobs):
            yield slot, self.host.train(cid, state, message, round_idx)

    def evaluate(self, jobs):
        return self.host.evaluate(jobs)

    def finetune(self, jobs, message, epochs, round_idx):
        return self.host.finetune(jobs, message, epochs, round_idx)

    def close(self) -> None:
        pass


class Federation:
    """The server's side of a federation as a pure round step: no files, no clocks beyond the record.

    ``step(r)`` runs round r (configure -> train -> aggregate -> evaluate) and returns its record;
    ``snapshot()`` / ``restore()`` give and take the whole state. Writing metrics, checkpoints and
    ``final/`` is the caller's (``fedrod_ray.runner`` for the CLI).
    """

    def __init__(self, setup: Setup, executor: Executor, log: Callable[[str], None] = print,
                 progress: Callable[[int, int, int], None] | None = None):
        """``progress(round, clients finished, clients sampled)`` is called as each client finishes."""
        self.setup = setup
        self.progress = progress
        self.round_progress = (0, 0, 0)  # (round, finished, sampled) of the round in hand
        self.cfg = setup.cfg
        self.executor = executor
        self.log = log
        self.rule = build_rule(self.cfg.train.generic_rule, self.cfg.train.rule_params)
        self.model = setup.build_model()
        state = self.model.state_dict()
        self.shared_keys = self.model.shared_keys()
        self.generic_keys = set(self.model.generic_keys())
        self.global_shared: StateDict = {k: state[k].detach().clone() for k in self.shared_keys}
        self.server_state: StateDict = self.rule.init_server_state(self._generic(self.global_shared))
        # Every client's committed state. It is only ever replaced, never written into, so a snapshot
        # is a shallow copy and stays valid while training goes on.
        self.clients: dict[int, ClientState] = {cid: ClientState() for cid in setup.all_client_ids}
        # A PM changes only when its client trains: (rounds_trained, correct, total) of the last evaluation.
        self._pm_counts: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}
        self.next_round = 0

    def _generic(self, state: StateDict) -> StateDict:
        return {k: v for k, v in state.items() if k in self.generic_keys}

    def snapshot(self) -> Snapshot:
        return Snapshot(self.next_round, self.cfg, dict(self.global_shared), dict(self.server_state),
                        dict(self.clients))

    def restore(self, snap: Snapshot) -> None:
        if set(snap.global_shared) != set(self.shared_keys):
            raise ValueError("the snapshot's global weights do not fit this model: "
                             f"{sorted(set(snap.global_shared) ^ set(self.shared_keys))}")
        self.global_shared = dict(snap.global_shared)
        self.server_state = dict(snap.server_state)
        unknown = sorted(set(snap.clients) - set(self.clients))
        if unknown:
            raise ValueError(f"the snapshot holds clients this federation does not have: {unknown[:10]}")
        self.next_round = snap.rounds_done
        self.clients.update(snap.clients)
        self._pm_counts.clear()

    def step(self, r: int) -> dict:
        """Run round ``r`` (which must be the next one) and return its record."""
        if r != self.next_round:
            raise ValueError(f"round {r} requested, but the next round is {self.next_round}")
        cfg = self.cfg
        t0 = time.perf_counter()
        ids = sample_clients(cfg.seed, r, self.setup.num_clients, cfg.train.client_fraction)
        jobs = [(cid, self.clients[cid].for_training(self.rule.starts_from_local_model)) for cid in ids]
        message = RoundInput(self.global_shared, self.rule.broadcast(self.server_state))
        # theta, psi under the rule's weights; nu (hyper) by sample count whatever the rule; the rule's
        # uploads unweighted. Each folds in the order of ``ids``, so the runtimes agree bitwise.
        generic, rest, uploads = (OrderedAverager(len(ids)) for _ in range(3))
        results: list[LocalResult] = []
        new_states: dict[int, ClientState] = {}
        failures: list[ClientFailure] = []
        self._report(r + 1, 0, len(ids))
        for slot, out in self.executor.train(r, jobs, message):
            if isinstance(out, ClientFailure):
                res = out
                for averager in (generic, rest, uploads):
                    averager.skip(slot)
                failures.append(res)
                self.log(f"[round {r + 1}] client {res.client_id} failed: {res.error}\n{res.traceback}")
                self._check_failures(r, len(ids), failures)
            else:
                res, new_states[ids[slot]] = out
                generic.add(slot, self._generic(res.shared), self.rule.aggregation_weight(res.num_samples))
                rest.add(slot, {k: v for k, v in res.shared.items() if k not in self.generic_keys}, res.num_samples)
                uploads.add(slot, res.upload, 1.0)
                results.append(res)
            self._report(r + 1, len(results) + len(failures), len(ids))
        self._check_failures(r, len(ids), failures)
        new_generic, self.server_state = self.rule.server_update(
            self._generic(self.global_shared), generic.result(), uploads.result(), generic.count,
            self.setup.num_clients, self.server_state)
        averaged = {**rest.result(), **new_generic}
        self.global_shared = {k: averaged[k] for k in self.shared_keys}
        # Committed with the round, all at once: a round that raises leaves every client as it was.
        self.clients.update(new_states)
        self.next_round = r + 1
        train_seconds = time.perf_counter() - t0

        weights = np.array([res.num_samples for res in results], dtype=np.float64)
        record = {
            # 1-based, as everywhere users see a round: "round 3" is the third, after which 3 are done.
            "round": r + 1, "name": cfg.name, "lr": round_lr(cfg.train, r),
            "clients": len(ids), "clients_done": len(results), "clients_failed": len(failures),
            "failed_ids": [f.client_id for f in failures],
            "train_loss": float(np.average([res.loss for res in results], weights=weights)),
            "personal_loss": (float(np.average([res.personal_loss for res in results], weights=weights))
                              if results[0].personal_loss is not None else None),
            "train_seconds": round(train_seconds, 4),
        }
        if (r + 1) % cfg.eval.eval_every == 0 or r + 1 == cfg.train.rounds:
            record.update(self.evaluate(final=r + 1 == cfg.train.rounds))
        record["seconds"] = round(time.perf_counter() - t0, 4)
        return record

    def _report(self, round_number: int, finished: int, sampled: int) -> None:
        self.round_progress = (round_number, finished, sampled)
        if self.progress is not None:
            self.progress(round_number, finished, sampled)

    def final_model(self, metrics: dict) -> tuple[ModelMeta, StateDict, dict[int, torch.Tensor] | None]:
        """What ``export.save_final`` writes: the metadata, the global weights and (linear) every
        client's phi_m (zeros for a client that never trained: its PM is the GM)."""
        heads = None
        if self.cfg.train.head == "linear":
            shape = self.model.personal_head.weight.shape
            heads = {cid: st.personal["personal_head.weight"] if st.personal else torch.zeros(shape)
                     for cid, st in sorted(self.clients.items())}
        meta = self.setup.model_meta(self.next_round, {k: v for k, v in metrics.items() if k in METRIC_KEYS})
        parts = set(self.model.part_keys())  # a local objective's parts only train: the served model has none
        return meta, {k: v for k, v in self.global_shared.items() if k not in parts}, heads

    def _check_failures(self, r: int, sampled: int, failures: list[ClientFailure]) -> None:
        rt = self.cfg.runtime
        if len(failures) > rt.max_failed_fraction * sampled or sampled - len(failures) < min(
                rt.min_clients_per_round, sampled):
            ids = ", ".join(str(f.client_id) for f in failures)
            raise RoundFailedError(
                f"round {r + 1}: {len(failures)} of {sampled} clients failed (clients {ids}); the limits are "
                f"runtime.max_failed_fraction={rt.max_failed_fraction} and "
                f"runtime.min_clients_per_round={rt.min_clients_per_round}. First error: {failures[0].error}")

    def evaluate(self, final: bool = False) -> dict:
        """G-FL (GM), and P-FL of the GM and of both readings of the PMs, for training clients and held-out
        new clients; ``final`` adds the fine-tuned P-FL of ``eval.finetune_epochs`` (the last round's)."""
        test, dists = self.setup.test, self.setup.class_dists
        pm, stale, fresh_clients = self._pm_jobs()
        ft_jobs = self._finetune_jobs() if final else []
        message = RoundInput(self.global_shared)
        # The executor (on Ray, the client actors) evaluates the PMs that changed, and fine-tunes, while
        # this thread scores the GM and every client's global-reading PM from one pass of the GM.
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(self._executor_evaluation, stale, ft_jobs, message) if stale or ft_jobs else None
            self.model.load_partial(self.global_shared)
            z, logits = features_and_logits(self.model, test, self.cfg.eval.batch_size)
            correct, total = class_correct(logits.argmax(1), test.y, test.num_classes)
            ids = self.setup.all_client_ids
            pm_global = self._global_reading_pms(ids, z, logits, correct, total)
            # A client that never trained has no model of its own: its PM is the global reading.
            pm.correct.update({cid: pm_global.correct[cid] for cid in fresh_clients})
            pm.total.update(dict.fromkeys(fresh_clients, total))
            evaluated, tuned = pending.result() if pending is not None else (EvalCounts(), EvalCounts())
        pm.merge(evaluated)
        for cid, state in stale:
            if cid in evaluated.correct:
                self._pm_counts[cid] = (state.rounds_trained, evaluated.correct[cid], evaluated.total[cid])
        pm.failed.update({cid: e for cid, e in pm_global.failed.items() if cid not in pm.failed})
        for cid, error in sorted(pm.failed.items()):
            self.log(f"client {cid}: personalized model not evaluated: {error}")
        for cid, error in sorted(tuned.failed.items()):
            self.log(f"client {cid}: not fine-tuned: {error}")
        m = self.setup.num_clients
        pfl_gm = pfl_accuracy(correct, total, dists)
        pfl_pm = _pfl(pm, dists)
        pfl_global = _pfl(pm_global, dists)
        out = {
            "gfl_gm": accuracy(correct, total),
            "pfl_gm": float(pfl_gm[:m].mean()),
            # Over the clients whose PM could be evaluated (pm_eval_failed counts the others).
            "pfl_pm": _mean([v for c, v in pfl_pm.items() if c < m]),
            "pfl_pm_global": _mean([v for c, v in pfl_global.items() if c < m]),
            "pm_eval_failed": len(pm.failed),
        }
        if len(ids) > m:
            out["pfl_gm_new"] = float(pfl_gm[m:].mean())
            # New clients never train, so both readings of their PM are the global model (hyper: with H(a; nu)).
            out["pfl_new_before"] = _mean([v for c, v in pfl_global.items() if c >= m])
        if ft_jobs:
            pfl_ft = _pfl(tuned, dists)
            if self.cfg.eval.finetune_train:
                out["pfl_ft"] = _mean([v for c, v in pfl_ft.items() if c < m])
            if len(ids) > m:
                out["pfl_new_after"] = _mean([v for c, v in pfl_ft.items() if c >= m])
            out["finetune_failed"] = len(tuned.failed)
        return out

    def _executor_evaluation(self, stale: list[Job], ft_jobs: list[Job],
                             message: RoundInput) -> tuple[EvalCounts, EvalCounts]:
        evaluated = self.executor.evaluate(stale) if stale else EvalCounts()
        tuned = (self.executor.finetune(ft_jobs, message, self.cfg.eval.finetune_epochs, self.next_round - 1)
                 if ft_jobs else EvalCounts())
        return evaluated, tuned

    def _finetune_jobs(self) -> list[Job]:
        """Held-out new clients, and every training client with ``eval.finetune_train``, when fine-tuning is on."""
        ev = self.cfg.eval
        if ev.finetune_epochs == 0:
            return []
        ids = self.setup.all_client_ids if ev.finetune_train else self.setup.all_client_ids[self.setup.num_clients:]
        return [(cid, self.clients[cid].for_training()) for cid in ids]

    def _pm_jobs(self) -> tuple[EvalCounts, list[Job], list[int]]:
        """The cached PM counts still valid, the clients whose PM must be evaluated afresh (trained since
        their last evaluation), and those that never trained. A PM changes only when its client trains."""
        cached, stale, fresh = EvalCounts(), [], []
        for cid, state in self.clients.items():
            if state.local_model is None and state.personal is None:
                fresh.append(cid)
            elif cid in self._pm_counts and self._pm_counts[cid][0] == state.rounds_trained:
                _, cached.correct[cid], cached.total[cid] = self._pm_counts[cid]
            else:
                stale.append((cid, state))
        return cached, stale, fresh

    @torch.inference_mode()
    def _global_reading_pms(self, ids: list[int], z: torch.Tensor, logits: torch.Tensor, correct: torch.Tensor,
                            total: torch.Tensor) -> EvalCounts:
        """Per-class correct test counts of each client's PM in the appendix's reading: the global theta and
        psi with the client's own head (phi_m, or H(a_m; nu) for hyper). The GM's features z and logits
        serve every client; a head's logits are added a batch of PM_BATCH clients at a time. With no P-head,
        or a linear head still at its initial zeros, that PM is the GM."""
        heads = self.model.variant
        out = EvalCounts(total=dict.fromkeys(ids, total))
        if heads is None:
            out.correct = dict.fromkeys(ids, correct)
            return out
        if heads == "linear":
            shape = self.model.personal_head.weight.shape
            out.correct = {cid: correct for cid in ids if self.clients[cid].personal is None}
            for cid in ids:
                head = (self.clients[cid].personal or {}).get("personal_head.weight")
                if cid not in out.correct and (head is None or head.shape != shape):
                    out.failed[cid] = f"ValueError: its personal head is not a {tuple(shape)} personal_head.weight"
            ids = [cid for cid in ids if cid not in out.correct and cid not in out.failed]
        y, num_classes = self.setup.test.y, self.setup.test.num_classes
        onehot = torch.nn.functional.one_hot(y, num_classes).to(torch.float64)
        for start in range(0, len(ids), PM_BATCH):
            batch = ids[start:start + PM_BATCH]
            if heads == "hyper":
                counts = torch.as_tensor(self.setup.partition.counts[batch], dtype=torch.long)
                phi = self.model.personal_weight(class_distribution(counts))
            else:
                phi = torch.stack([self.clients[cid].personal["personal_head.weight"] for cid in batch])
            preds = (logits + torch.einsum("nd,mcd->mnc", z, phi)).argmax(-1)
            hits = (preds == y).to(torch.float64) @ onehot
            out.correct.update(zip(batch, hits))
        return out


def _pfl(counts: EvalCounts, dists: torch.Tensor) -> dict[int, float]:
    """P-FL of each client with per-client counts, keyed by client id."""
    ids = sorted(counts.correct)
    if not ids:
        return {}
    values = pfl_accuracy(torch.stack([counts.correct[c] for c in ids]), torch.stack([counts.total[c] for c in ids]),
                          dists[ids])
    return dict(zip(ids, values.tolist()))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
