"""A federation's evaluation: G-FL of the generic model (GM), and P-FL of the GM and of both readings of
the personalized models (PMs), for training clients and held-out new clients, and after fine-tuning.

The GM and every client's global-reading PM are scored here from one pass of the GM over the test set
(where natural clients have test sets of their own, the test set is their union and each client's P-FL is
read from its own examples: ``TestSet.pfl_weights``);
the PMs of clients that trained, and fine-tuning, are the executor's calls (on Ray, the client actors),
run meanwhile. A PM changes only when its client trains, so its counts are cached between evaluations.

With ``eval.estimate_size``, ``estimate`` does the same for G-FL and P-FL of the GM and PMs on a fixed
class-stratified sample of the test set, every round: an estimate (its own ``*_est`` keys) for the rounds
between exact evaluations, at about estimate_size / test size of an evaluation's cost, corrected by how far
the sample was from the exact figures at the last exact evaluation (``anchored``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ..client_update.local import RoundInput, class_distribution
from ..clients.client import ClientState, EvalCounts, estimate_test_set
from ..executors.base import Executor, Job
from ..federation_state.client_store import ClientStore
from ..federation_state.setup import Setup
from ..models import FedModel
from ..models.metrics import (
    TestSet,
    accuracy,
    class_correct,
    clients_class_correct,
    features_and_logits,
    pfl_accuracy,
)
from ..personalization import Personalization, generic_weights
from ..server_math.aggregate import StateDict

EVAL_SAMPLE_TAG = 5  # seeds eval.clients' sample of the training clients
PM_BATCH = 64  # clients whose global-reading PM is scored at once: (64, test size, classes) logits
PM_JOBS = 256  # clients whose PM one executor call evaluates (their states in memory at once)


@contextlib.contextmanager
def _cancelled_on_error(executor: Executor) -> Iterator[ThreadPoolExecutor]:
    """A thread for the executor's calls while this one scores the GM; should this one stop (Ctrl-C), the
    executor's calls are cancelled, so that the stop waits for one client's call, not for all of them."""
    with ThreadPoolExecutor(1) as pool:
        try:
            yield pool
        except BaseException:
            executor.cancel()
            raise


class Evaluation:
    """Evaluates a federation's state; holds the PM counts of the last evaluation (``clear`` forgets them,
    as after a restore)."""

    def __init__(self, setup: Setup, model: FedModel, method: Personalization, initial: StateDict,
                 log: Callable[[str], None]):
        """``model`` is the federation's: its weights are overwritten with the GM's for each evaluation;
        ``initial`` its initial weights (the personal part of a client that never trained)."""
        self.setup = setup
        self.cfg = setup.cfg
        self.model = model
        self.method = method
        self.initial = initial
        self.log = log
        # (rounds_trained, correct, total) of each PM's last evaluation, and of its last estimate.
        self._pm_counts: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}
        self._pm_estimates: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}
        self.estimate_test: TestSet | None = (estimate_test_set(self.cfg, setup.test)
                                              if self.cfg.eval.estimate_size else None)

    @property
    def client_ids(self) -> list[int]:
        """The clients an evaluation scores: every one, or (``eval.clients``) a sample of the training clients,
        fixed by the run's seed, with every held-out new client."""
        k, m = self.cfg.eval.clients, self.setup.num_clients
        ids = self.setup.all_client_ids
        if not k or k >= m:
            return ids
        sample = np.random.default_rng([self.cfg.seed, EVAL_SAMPLE_TAG]).choice(m, size=k, replace=False)
        return sorted(int(c) for c in sample) + ids[m:]

    def clear(self) -> None:
        self._pm_counts.clear()
        self._pm_estimates.clear()

    # size: the evaluation's one sequence (GM pass, PM cache, per-client calls, means), which its record's keys
    # follow
    def evaluate(self, executor: Executor, global_shared: StateDict, clients: ClientStore, method_state: StateDict,
                 round_idx: int, final: bool = False) -> dict:
        """The metrics of the GM ``global_shared`` and the PMs of ``clients`` after round ``round_idx``
        (0-based), the method's server state being ``method_state``; ``final`` adds the adapted (fine-tuned)
        P-FL of ``eval.finetune_epochs``."""
        test, weights = self.setup.test, self.setup.pfl_weights
        ids = self.client_ids
        m = self.setup.num_clients
        pm, stale, fresh_clients = self._pm_jobs(clients, ids, global_shared, round_idx + 1, self._pm_counts,
                                                 method_state)
        ft_jobs = self._finetune_jobs(clients) if final else []
        # New clients receive the method's new-client message; their zero-shot models are the executor's
        # unless they are the global reading (``Personalization.zero_shot_is_reading``).
        new = [cid for cid in ids if cid >= m]
        message = RoundInput(global_shared,
                             per_client=dict.fromkeys(new, self.method.new_client_message(method_state, global_shared)))
        zs_jobs = [] if self.method.zero_shot_is_reading else [(cid, clients[cid]) for cid in new]
        # The executor (on Ray, the client actors) evaluates the PMs that changed, the zero-shot models and
        # fine-tunes, while this thread scores the GM and every client's global-reading PM from one pass of the GM.
        with _cancelled_on_error(executor) as pool:
            pending = (pool.submit(self._executor_evaluation, executor, clients, stale, global_shared,
                                   round_idx + 1, ft_jobs, zs_jobs, message, round_idx, method_state)
                       if stale or ft_jobs or zs_jobs else None)
            generic = self.generic_model(global_shared, clients)
            self.model.load_partial(generic)
            z, logits = features_and_logits(self.model, test, self.cfg.eval.batch_size)
            preds = logits.argmax(1)
            correct, total = class_correct(preds, test.y, test.num_classes)
            gm = _gm_counts(preds, test, ids, correct, total)
            pm_global = self._global_reading_pms(clients, ids, global_shared, generic, z, logits, gm, test)
            # A client that never trained has no model of its own: its PM is its zero-shot model, the global
            # reading unless the executor made it.
            made = {cid for cid, _ in zs_jobs}
            reading = [cid for cid in fresh_clients if cid not in made]
            pm.correct.update({cid: pm_global.correct[cid] for cid in reading})
            pm.total.update({cid: pm_global.total[cid] for cid in reading})
            evaluated, rounds, tuned, zero_shot = (pending.result() if pending is not None
                                                   else (EvalCounts(), {}, EvalCounts(), EvalCounts()))
        pm.merge(evaluated)
        pm.merge(zero_shot)
        self._remember(self._pm_counts, evaluated, rounds)
        pm.failed.update({cid: e for cid, e in pm_global.failed.items() if cid not in pm.failed and cid not in made})
        for cid, error in sorted(pm.failed.items()):
            self.log(f"client {cid}: personalized model not evaluated: {error}")
        for cid, error in sorted(tuned.failed.items()):
            self.log(f"client {cid}: not fine-tuned: {error}")
        has_reading = self.method.global_reading is not None
        pfl_gm = _pfl(gm, weights)
        pfl_pm = _pfl(pm, weights)
        pfl_global = _pfl(pm_global, weights) if has_reading else {}
        train = {"pfl_gm": [v for c, v in pfl_gm.items() if c < m],
                 # Over the clients whose PM could be evaluated (pm_eval_failed counts the others).
                 "pfl_pm": [v for c, v in pfl_pm.items() if c < m],
                 "pfl_pm_global": [v for c, v in pfl_global.items() if c < m]}
        out = {"gfl_gm": accuracy(correct, total), **{key: _mean(values) for key, values in train.items()},
               "pm_eval_failed": len(pm.failed)}
        if self.cfg.eval.clients:
            # A sample of the training clients: the 95% interval of each mean over all of them.
            out.update({f"{key}_ci": confidence_halfwidth(values, m) for key, values in train.items()})
        if len(ids) > len(train["pfl_gm"]):
            out["pfl_gm_new"] = _mean([v for c, v in pfl_gm.items() if c >= m])
            # New clients never train: their PM is their zero-shot model (the global reading: the global model,
            # hyper with H(a; nu); the GM where a method has no such reading).
            out["pfl_new_before"] = _mean([v for c, v in pfl_pm.items() if c >= m])
        if ft_jobs:
            pfl_ft = _pfl(tuned, weights)
            if self.cfg.eval.finetune_train:
                out["pfl_ft"] = _mean([v for c, v in pfl_ft.items() if c < m])
            if len(ids) > len(train["pfl_gm"]):
                out["pfl_new_after"] = _mean([v for c, v in pfl_ft.items() if c >= m])
            out["finetune_failed"] = len(tuned.failed)
        return out

    def estimate(self, executor: Executor, global_shared: StateDict, clients: ClientStore,
                 rounds_done: int, method_state: StateDict) -> dict:
        """The estimate of G-FL and of the training clients' P-FL of the GM and of their PMs (as
        ``evaluate``'s gfl_gm, pfl_gm and pfl_pm) on the sample ``estimate_test``: the same counts, from
        its images only; ``method_state`` is the method's server state."""
        test = self.estimate_test
        dists = test.pfl_weights(self.setup.class_dists)
        m = self.setup.num_clients
        pm, stale, fresh_clients = self._pm_jobs(clients, range(m), global_shared, rounds_done, self._pm_estimates,
                                                 method_state)
        with _cancelled_on_error(executor) as pool:
            pending = (pool.submit(self._evaluate_pms, executor, clients, stale, global_shared, rounds_done,
                                   method_state, True)
                       if stale else None)
            generic = self.generic_model(global_shared, clients)
            self.model.load_partial(generic)
            z, logits = features_and_logits(self.model, test, self.cfg.eval.batch_size)
            preds = logits.argmax(1)
            correct, total = class_correct(preds, test.y, test.num_classes)
            pm_global = self._global_reading_pms(clients, fresh_clients, global_shared, generic, z, logits,
                                                 _gm_counts(preds, test, fresh_clients, correct, total), test)
            evaluated, rounds = pending.result() if pending is not None else (EvalCounts(), {})
        pm.merge(pm_global)
        pm.merge(evaluated)
        self._remember(self._pm_estimates, evaluated, rounds)
        return {
            "gfl_gm_est": accuracy(correct, total),
            "pfl_gm_est": float(pfl_accuracy(correct, total, dists)[:m].mean()),
            "pfl_pm_est": _mean(list(_pfl(pm, dists).values())),
        }

    def generic_model(self, global_shared: StateDict, clients: ClientStore) -> StateDict:
        """The GM's weights (``personalization.generic_weights``)."""
        return generic_weights(self.method, self.model.personal_keys(), global_shared, clients, self.initial,
                               self.setup.num_clients)

    def _pm_state(self, clients: ClientStore, cid: int, global_shared: StateDict, rounds_done: int,
                  method_state: StateDict) -> ClientState:
        """What client ``cid``'s PM is evaluated from (``Personalization.pm_job``, for a training client)."""
        state = clients[cid]
        if self.method.pm_from_global and cid < self.setup.num_clients:
            return self.method.pm_job(state, global_shared, rounds_done, method_state, cid)
        return state

    def _evaluate_pms(self, executor: Executor, clients: ClientStore, stale: list[int], global_shared: StateDict,
                      rounds_done: int, method_state: StateDict,
                      estimate: bool = False) -> tuple[EvalCounts, dict[int, int]]:
        """The executor's PM counts of the ``stale`` clients, and the rounds each PM had trained. Their states
        are read PM_JOBS at a time, so that an evaluation holds no more of them than that."""
        out, rounds = EvalCounts(), {}
        for start in range(0, len(stale), PM_JOBS):
            jobs = [(cid, self._pm_state(clients, cid, global_shared, rounds_done, method_state))
                    for cid in stale[start:start + PM_JOBS]]
            out.merge(executor.evaluate(jobs, estimate))
            rounds.update({cid: state.rounds_trained for cid, state in jobs})
        return out, rounds

    # size: the three per-client calls of one evaluation, with what each reads
    def _executor_evaluation(self, executor: Executor, clients: ClientStore, stale: list[int],
                             global_shared: StateDict, rounds_done: int, ft_jobs: list[Job], zs_jobs: list[Job],
                             message: RoundInput, round_idx: int, method_state: StateDict
                             ) -> tuple[EvalCounts, dict[int, int], EvalCounts, EvalCounts]:
        evaluated, rounds = self._evaluate_pms(executor, clients, stale, global_shared, rounds_done, method_state)
        zero_shot = executor.zero_shot(zs_jobs, message, round_idx) if zs_jobs else EvalCounts()
        tuned = (executor.finetune(ft_jobs, message, self.cfg.eval.finetune_epochs, round_idx)
                 if ft_jobs else EvalCounts())
        return evaluated, rounds, tuned, zero_shot

    @staticmethod
    def _remember(cache: dict[int, tuple[int, torch.Tensor, torch.Tensor]], evaluated: EvalCounts,
                  rounds: dict[int, int]) -> None:
        for cid, correct in evaluated.correct.items():
            cache[cid] = (rounds[cid], correct, evaluated.total[cid])

    def _finetune_jobs(self, clients: ClientStore) -> list[Job]:
        """Held-out new clients, and every (sampled: ``eval.clients``) training client with ``eval.finetune_train``,
        when fine-tuning is on."""
        ev = self.cfg.eval
        if ev.finetune_epochs == 0:
            return []
        ids = [cid for cid in self.client_ids if ev.finetune_train or cid >= self.setup.num_clients]
        return [(cid, clients[cid].for_training()) for cid in ids]

    def _pm_jobs(self, clients: ClientStore, ids: Iterable[int], global_shared: StateDict, rounds_done: int,
                 cache: dict[int, tuple[int, torch.Tensor, torch.Tensor]],
                 method_state: StateDict) -> tuple[EvalCounts, list[int], list[int]]:
        """Of clients ``ids``: the PM counts in ``cache`` still valid, the clients whose PM must be evaluated
        afresh (trained since their last evaluation), and those without a model of their own (never
        trained). A PM changes only when its client trains (with ``pm_from_global``: every round), so only
        those states are read."""
        cached, stale, fresh = EvalCounts(), [], []
        m = self.setup.num_clients
        for cid in ids:
            if self.method.pm_from_global and cid < m:
                state = self._pm_state(clients, cid, global_shared, rounds_done, method_state)
                has_model = state.local_model is not None or state.personal is not None
                rounds = state.rounds_trained
            else:
                has_model, rounds = clients.has_model(cid), clients.rounds_trained(cid)
            if not has_model:
                fresh.append(cid)
            elif cid in cache and cache[cid][0] == rounds:
                _, cached.correct[cid], cached.total[cid] = cache[cid]
            else:
                stale.append(cid)
        return cached, stale, fresh

    @torch.inference_mode()
    def _global_reading_pms(self, clients: ClientStore, ids: list[int], global_shared: StateDict,
                            generic: StateDict, z: torch.Tensor, logits: torch.Tensor, gm: EvalCounts,
                            test: TestSet) -> EvalCounts:
        """Per-class correct counts on ``test`` (each client's own examples where it has some) of each client's
        PM in the appendix's reading: the global weights with the client's own head (phi_m, or H(a_m; nu)
        for hyper, or FedPer's h_m in place of the generic head: ``Personalization.reading_heads``). The
        global model's features z and logits of ``test`` (those of the GM ``generic``, unless the method has
        no global model) serve every client; a head's logits are added a batch of PM_BATCH clients at a time.
        With no such head, a linear head still at its initial zeros, or no global reading at all, that PM is
        the GM, whose counts are ``gm``."""
        out = EvalCounts(total={cid: gm.total[cid] for cid in ids})
        personal = {cid: clients[cid].personal for cid in ids}  # read once: each may be on disk
        if self.model.variant == "linear":
            shape = self.model.personal_head.weight.shape
            out.correct = {cid: gm.correct[cid] for cid in ids if personal[cid] is None}
            for cid in ids:
                head = (personal[cid] or {}).get("personal_head.weight")
                if cid not in out.correct and (head is None or head.shape != shape):
                    out.failed[cid] = f"ValueError: its personal head is not a {tuple(shape)} personal_head.weight"
            ids = [cid for cid in ids if cid not in out.correct and cid not in out.failed]
        method = self.method
        heads = (method.reading_heads(self.model, [personal[cid] for cid in ids[:1]],
                                      self._dists(ids[:1]), self.initial) if ids else None)
        if method.global_reading is None or heads is None:
            out.correct.update({cid: gm.correct[cid] for cid in ids})
            return out
        if generic is not global_shared:
            self.model.load_partial(global_shared)
            z, logits = features_and_logits(self.model, test, self.cfg.eval.batch_size)
        if method.reading_replaces_head:
            logits = torch.zeros_like(logits)
        y, num_classes = test.y, test.num_classes
        onehot = torch.nn.functional.one_hot(y, num_classes).to(torch.float64)
        for start in range(0, len(ids), PM_BATCH):
            batch = ids[start:start + PM_BATCH]
            phi = method.reading_heads(self.model, [personal[cid] for cid in batch], self._dists(batch),
                                       self.initial)
            if test.clients is None:
                preds = (logits + torch.einsum("nd,mcd->mnc", z, phi)).argmax(-1)
                hits = (preds == y).to(torch.float64) @ onehot
                out.correct.update(zip(batch, hits))
                continue
            # Each client's own examples only: together, one pass over the test set.
            for cid, head in zip(batch, phi):
                rows = test.rows(cid)
                out.correct[cid] = class_correct((logits[rows] + z[rows] @ head.T).argmax(-1), y[rows], num_classes)[0]
        return out

    def _dists(self, ids: list[int]) -> torch.Tensor:
        return class_distribution(torch.as_tensor(self.setup.partition.counts[ids], dtype=torch.long))


def _gm_counts(preds: torch.Tensor, test: TestSet, ids: list[int], correct: torch.Tensor,
               total: torch.Tensor) -> EvalCounts:
    """Each client's per-class counts of the GM, whose predictions on ``test`` are ``preds``: those of the
    whole test set (``correct``, ``total``) or, where clients have their own test examples, of theirs."""
    if test.clients is None:
        return EvalCounts(dict.fromkeys(ids, correct), dict.fromkeys(ids, total))
    return EvalCounts(*clients_class_correct(preds, test, ids))


def estimate_offset(exact: dict, sample: dict[str, float]) -> dict[str, float]:
    """How far each estimate on the sample (``sample``: ``estimate``'s ``*_est`` keys) is from the exact
    figure ``exact`` of the same round. Most of an estimate's error is which images the fixed sample holds,
    and that changes slowly with the model: carried to the next rounds, the offset removes it (``anchored``)."""
    offset = {}
    for key, value in sample.items():
        diff = exact.get(key.removesuffix("_est"), math.nan) - value
        if math.isfinite(diff):
            offset[key] = diff
    return offset


def anchored(sample: dict[str, float], offset: dict[str, float]) -> dict[str, float]:
    """The estimates of a round: its sample estimates corrected by the offset of the last exact evaluation
    (none before the first)."""
    return {key: value + offset.get(key, 0.0) for key, value in sample.items()}


def confidence_halfwidth(values: list[float], population: int) -> float:
    """Half the width of the normal 95% interval of the mean of ``population`` values from a simple random
    sample of them, ``values`` (drawn without replacement: the finite population correction, 0 when the
    sample is the whole population)."""
    k = len(values)
    if k < 2:
        return math.nan
    mean = sum(values) / k
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (k - 1))
    return 1.96 * sd / math.sqrt(k) * math.sqrt(max(population - k, 0) / max(population - 1, 1))


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
