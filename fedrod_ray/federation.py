"""The round loop, shared by every runtime: configure -> local train -> aggregate -> evaluate.

``Federation`` holds the server's state (global weights, the generic rule's state) and drives an
*executor* that owns the clients (``fedrod_ray.executors``: in this process, batched, or on Ray
actors), through the protocol of ``executors.base`` only. The math lives in pure modules (``local``,
``aggregate``, ``algorithms``, ``metrics``) and the metrics in ``evaluation``; this file only sequences it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np

from .aggregate import OrderedAverager, StateDict
from .algorithms import build_rule
from .client import ClientFailure, ClientState
from .dp_rounds import ClientLevelDP, check_shared
from .evaluation import Evaluation, anchored, estimate_offset
from .executors.base import Executor
from .local import LocalResult, RoundInput, round_lr
from .personalization import build_method
from .server import sample_clients
from .setup import Setup
from .state import Snapshot


class RoundFailedError(RuntimeError):
    """Too many clients of a round failed for its average to be trusted."""


class Federation:
    """The server's side of a federation as a pure round step: no files, no clocks beyond the record.

    ``step(r)`` runs round r (configure -> train -> aggregate -> evaluate) and returns its record;
    ``snapshot()`` / ``restore()`` give and take the whole state. Writing metrics, checkpoints and
    ``final/`` is the caller's (``fedrod_ray.run.Run``).
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
        self.method = build_method(self.cfg.train.head, self.cfg.train.head_params)
        self.model = setup.build_model()
        state = self.model.state_dict()
        # The initial weights: what a client that never trained has (the methods whose clients keep models).
        self.initial: dict = {k: v.detach().clone() for k, v in state.items()}
        self.shared_keys = self.model.shared_keys()
        self.generic_keys = set(self.model.generic_keys())
        self.global_shared: StateDict = {k: state[k].detach().clone() for k in self.shared_keys}
        self.server_state: StateDict = self.rule.init_server_state(self._generic(self.global_shared))
        self.method_state: StateDict = self.method.init_server_state(setup.num_clients)
        # Every client's committed state. It is only ever replaced, never written into, so a snapshot
        # is a shallow copy and stays valid while training goes on.
        self.clients: dict[int, ClientState] = {cid: ClientState() for cid in setup.all_client_ids}
        self.evaluation = Evaluation(setup, self.model, self.method, self.initial, log)
        self.estimate_offset: dict[str, float] = {}
        self.next_round = 0
        # Client-level DP (``privacy``): its sampling, clipping and noised aggregate replace the plain ones.
        self.dp: ClientLevelDP | None = None
        self.privacy_state: StateDict = {}
        self.rounds = self.cfg.train.rounds  # the rounds this run trains: fewer where a DP budget runs out
        if self.cfg.privacy.enabled:
            check_shared(self.global_shared)
            self.dp = ClientLevelDP(self.cfg, setup.num_clients)
            self.privacy_state = self.dp.init_state()
            self.rounds = self.dp.rounds
            if self.rounds < self.cfg.train.rounds:
                log(f"privacy: the budget of epsilon {self.cfg.privacy.target_epsilon:g} lasts {self.rounds} of "
                    f"the {self.cfg.train.rounds} rounds at noise multiplier {self.dp.noise_multiplier:g}: the run "
                    f"stops after round {self.rounds}")

    def _generic(self, state: StateDict) -> StateDict:
        return {k: v for k, v in state.items() if k in self.generic_keys}

    def snapshot(self) -> Snapshot:
        return Snapshot(self.next_round, self.cfg, dict(self.global_shared), dict(self.server_state),
                        dict(self.clients), dict(self.estimate_offset), dict(self.method_state),
                        dict(self.privacy_state))

    def restore(self, snap: Snapshot) -> None:
        if set(snap.global_shared) != set(self.shared_keys):
            raise ValueError("the snapshot's global weights do not fit this model: "
                             f"{sorted(set(snap.global_shared) ^ set(self.shared_keys))}")
        self.global_shared = dict(snap.global_shared)
        self.server_state = dict(snap.server_state)
        self.method_state = dict(snap.method_state) or self.method.init_server_state(self.setup.num_clients)
        if self.dp is not None:
            self.privacy_state = dict(snap.privacy_state) or self.dp.init_state()
        unknown = sorted(set(snap.clients) - set(self.clients))
        if unknown:
            raise ValueError(f"the snapshot holds clients this federation does not have: {unknown[:10]}")
        self.next_round = snap.rounds_done
        self.clients.update(snap.clients)
        self.estimate_offset = dict(snap.estimate_offset)
        self.evaluation.clear()

    def step(self, r: int) -> dict:
        """Run round ``r`` (which must be the next one) and return its record."""
        if r != self.next_round:
            raise ValueError(f"round {r} requested, but the next round is {self.next_round}")
        if r >= self.rounds:
            raise ValueError(f"round {r + 1} requested, but this run trains {self.rounds} (privacy.target_epsilon)")
        cfg = self.cfg
        t0 = time.perf_counter()
        dp = self.dp
        ids = dp.sample(r) if dp else sample_clients(cfg.seed, r, self.setup.num_clients, cfg.train.client_fraction)
        from_local = self.rule.starts_from_local_model or self.method.starts_from_local_model
        jobs = [(cid, self.clients[cid].for_training(from_local)) for cid in ids]
        clip_norm = dp.clip_norm(self.privacy_state) if dp else None
        message = RoundInput(self.global_shared, self.rule.broadcast(self.server_state),
                             self.method.messages(self.method_state, ids, self._uploads(), r, cfg.seed), clip_norm)
        # theta, psi under the rule's weights; nu (hyper) by sample count whatever the rule; the rule's
        # uploads unweighted. Each folds in the order of ``ids``, so the runtimes agree bitwise. With DP, every
        # shared weight is summed unweighted instead (``clipped``): a sample count would break the sensitivity.
        generic, rest, uploads, clipped = (OrderedAverager(len(ids)) for _ in range(4))
        unclipped = 0
        results: dict[int, LocalResult] = {}
        new_states: dict[int, ClientState] = {}
        failures: list[ClientFailure] = []
        self._report(r + 1, 0, len(ids))
        for slot, out in self.executor.train(r, jobs, message):
            if isinstance(out, ClientFailure):
                res = out
                for averager in (generic, rest, uploads, clipped):
                    averager.skip(slot)
                failures.append(res)
                self.log(f"[round {r + 1}] client {res.client_id} failed: {res.error}\n{res.traceback}")
                self._check_failures(r, len(ids), failures)
            else:
                res, new_states[ids[slot]] = out
                if dp:
                    clipped.add(slot, res.shared, 1.0)
                    unclipped += not res.clipped
                else:
                    generic.add(slot, self._generic(res.shared), self.rule.aggregation_weight(res.num_samples))
                    rest.add(slot, {k: v for k, v in res.shared.items() if k not in self.generic_keys},
                             res.num_samples)
                    uploads.add(slot, res.upload, 1.0)
                results[ids[slot]] = res
            self._report(r + 1, len(results) + len(failures), len(ids))
        self._check_failures(r, len(ids), failures)
        if dp:
            # The rule's server step sees only the noised mean, and the expected number of participants.
            averaged, privacy_state = dp.aggregate(clipped.total(), clipped.count, unclipped, self.global_shared,
                                                   self.privacy_state, r)
            new_generic, self.server_state = self.rule.server_update(
                self._generic(self.global_shared), self._generic(averaged), {}, dp.expected, self.setup.num_clients,
                self.server_state)
            self.privacy_state = privacy_state
        else:
            new_generic, self.server_state = self.rule.server_update(
                self._generic(self.global_shared), generic.result(), uploads.result(), generic.count,
                self.setup.num_clients, self.server_state)
            averaged = rest.result()
        averaged = {**averaged, **new_generic}
        # Committed with the round, all at once: a round that raises leaves every client as it was.
        self.clients.update(new_states)
        averaged, self.method_state = self.method.server_update(
            {k: averaged[k] for k in self.shared_keys}, results, self._uploads(), self.method_state, self.initial,
            self.setup.num_clients)
        self.global_shared = {k: averaged[k] for k in self.shared_keys}
        self.next_round = r + 1
        train_seconds = time.perf_counter() - t0

        done = list(results.values())
        weights = np.array([res.num_samples for res in done], dtype=np.float64)
        record = {
            # 1-based, as everywhere users see a round: "round 3" is the third, after which 3 are done.
            "round": r + 1, "name": cfg.name, "lr": round_lr(cfg.train, r),
            "clients": len(ids), "clients_done": len(results), "clients_failed": len(failures),
            "failed_ids": [f.client_id for f in failures],
            # A DP round under Poisson sampling may have no client: no loss then.
            "train_loss": float(np.average([res.loss for res in done], weights=weights)) if done else math.nan,
            "personal_loss": (float(np.average([res.personal_loss for res in done], weights=weights))
                              if done and done[0].personal_loss is not None else None),
            "train_seconds": round(train_seconds, 4),
        }
        if dp:
            record.update(dp_epsilon=dp.epsilon(r + 1), dp_clip_norm=clip_norm)
        sample = (self.evaluation.estimate(self.executor, self.global_shared, self.clients, r + 1)
                  if cfg.eval.estimate_size else None)
        last = r + 1 == self.rounds
        # Exact: every eval_every rounds and after the last; with the estimate, after round 1 too, which
        # anchors it from the start (cheap: only the first round's clients have PMs of their own).
        if (r + 1) % cfg.eval.eval_every == 0 or (last and cfg.eval.at_end) or (r == 0 and sample is not None):
            record.update(self.evaluate(final=last))
            if sample is not None:
                self.estimate_offset = estimate_offset(record, sample)
        if sample is not None:
            record.update(anchored(sample, self.estimate_offset))
        record["seconds"] = round(time.perf_counter() - t0, 4)
        return record

    def _uploads(self) -> dict[int, StateDict | None]:
        """Every training client's last upload (None: it never trained)."""
        return {cid: self.clients[cid].local_model for cid in range(self.setup.num_clients)}

    def _report(self, round_number: int, finished: int, sampled: int) -> None:
        self.round_progress = (round_number, finished, sampled)
        if self.progress is not None:
            self.progress(round_number, finished, sampled)

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
        """The metrics of the current state (``evaluation``); ``final`` adds the fine-tuned P-FL."""
        return self.evaluation.evaluate(self.executor, self.global_shared, self.clients, self.next_round - 1, final)
