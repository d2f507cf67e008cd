"""The round loop, shared by every runtime: configure -> local train -> aggregate -> evaluate.

``Federation`` holds the server's state (global weights, the generic rule's state) and drives an
*executor* that owns the clients (in this process, batched, on Ray actors, at sites, on Flower's SuperNodes),
through the protocol of ``executors.base`` only: it never asks which runtime it has. The math lives in pure modules (``local``,
``aggregate``, ``algorithms``, ``metrics``) and the metrics in ``evaluation``; this file only sequences it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..algorithms import build_rule
from ..client_update.local import LocalResult, RoundInput, round_lr
from ..clients.client import ClientFailure, ClientState, ClientUnavailable
from ..config import ConfigError
from ..executors.base import Executor, RoundFailedError, RoundSkipped, SumRequest
from ..federation_state.buffered_rounds import BufferedRounds
from ..federation_state.client_store import ClientStore, LocalModels
from ..federation_state.dp_rounds import ClientLevelDP, check_shared, shared_dim
from ..federation_state.setup import Setup
from ..federation_state.state import Arrival, Snapshot
from ..outputs.sampling_secrecy import disclosure_line, private_log, private_text, redact_record
from ..personalization import Ask, ServerContext, build_method
from ..server_math.aggregate import OrderedAverager, StateDict
from ..server_math.buffered import buffered_update, staleness_weight
from ..server_math.server import clients_per_round, sample_clients, sample_count
from ..server_math.sums import Losses, RoundSums, mean_losses
from ..server_math.uploads import non_finite, upload_problem
from ..timing.clock import (
    client_speeds,
    communication_seconds,
    deadline_round,
    durations,
    over_selected,
    read_trace,
)
from .evaluation import Evaluation, anchored, estimate_offset
from .remote_evaluation import RemoteEvaluation
from .round_sums import shared_update

__all__ = ["Collected", "Federation", "RoundFailedError"]


@dataclass
class Collected:
    """What a round's clients gave the server: the sums its server step reads, their losses, each one's result
    and new state (empty where a secure aggregation gives only the sums), their failures and, at sites, the
    clients that were unavailable."""

    sums: RoundSums
    losses: Losses
    results: dict[int, LocalResult] = field(default_factory=dict)
    new_states: dict[int, ClientState] = field(default_factory=dict)
    failures: list[ClientFailure] = field(default_factory=list)
    unavailable: list[ClientUnavailable] = field(default_factory=list)
    skipped: str | None = None  # why a secure aggregation declined the round (``RoundSkipped``)


class Federation:
    """The server's side of a federation as a pure round step: no files, no clocks beyond the record.

    ``step(r)`` runs round r (configure -> train -> aggregate -> evaluate) and returns its record;
    ``snapshot()`` / ``restore()`` give and take the whole state. Writing metrics, checkpoints and
    ``final/`` is the caller's (``fedrod_ray.lifecycle.run.Run``).
    """

    def __init__(self, setup: Setup, executor: Executor, log: Callable[[str], None] = print,
                 progress: Callable[[int, int, int], None] | None = None):
        """``progress(round, clients finished, clients sampled)`` is called as each client finishes."""
        self.setup = setup
        self.progress = progress
        self.round_progress = (0, 0, 0)  # (round, finished, sampled) of the round in hand
        self.cfg = setup.cfg
        self.executor = executor
        self.log = private_log(log, self.cfg.privacy)  # no client's id under DP (sampling_secrecy)
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
        self.method_state: StateDict = self.method.init_server_state(self._server_context())
        # Every client's committed state, the runtime.client_cache most recently used in memory, the rest on
        # disk. A state is only ever replaced, never written into, so a snapshot stays valid while training
        # goes on.
        self.clients = ClientStore(len(setup.all_client_ids), self.cfg.runtime.client_cache)
        # P-FL per client here, or summed where the clients are (at sites).
        self.evaluation = (RemoteEvaluation if executor.evaluates_at_clients else Evaluation)(
            setup, self.model, self.method, self.initial, log)
        self.estimate_offset: dict[str, float] = {}
        self.next_round = 0
        # Client-level DP (``privacy``): its sampling, clipping and noised aggregate replace the plain ones.
        self.dp: ClientLevelDP | None = None
        self.privacy_state: StateDict = {}
        self.rounds = self.cfg.train.rounds  # the rounds this run trains: fewer where a DP budget runs out
        if self.cfg.privacy.enabled:
            self._start_privacy()
        self.durations = self._durations()  # each client's local update, in virtual seconds
        self.virtual_time = 0.0
        rc = self.cfg.rounds
        self.buffered: BufferedRounds | None = None
        if rc.mode == "fedbuff":
            concurrency = rc.concurrency or clients_per_round(setup.num_clients, self.cfg.train.client_fraction)
            self.buffered = BufferedRounds(self.cfg.seed, self.durations, concurrency, rc.buffer_size,
                                           self._train_buffered, self._arrive)

    def _start_privacy(self) -> None:
        """Client-level DP's accountant, state and the number of rounds its budget lasts, with what the run
        must say of them."""
        check_shared(self.global_shared)
        if self.cfg.privacy.mechanism != "central" and not self.executor.sums_only:
            # Each participant noises its share of a secure sum (executors.base: sums_only).
            raise ConfigError(f"privacy.mechanism: {self.cfg.privacy.mechanism} needs a secure sum that each "
                              "participant noises its share of: Flower's SecAgg+ (docs/flower.md, run config "
                              "secure-aggregation=true); in process and on Ray, use central")
        self.dp = ClientLevelDP(self.cfg, self.setup.num_clients, shared_dim(self.global_shared))
        self.privacy_state = self.dp.init_state()
        self.rounds = self.dp.rounds
        if self.rounds < self.cfg.train.rounds:
            self.log(f"privacy: the budget of epsilon {self.cfg.privacy.target_epsilon:g} lasts {self.rounds} of "
                     f"the {self.cfg.train.rounds} rounds at noise multiplier {self.dp.noise_multiplier:g}: the run "
                     f"stops after round {self.rounds}")
        if self.dp.seeded:
            self.log(f"privacy: the noise and the client sampling are seeded (privacy.noise_seed="
                     f"{self.cfg.privacy.noise_seed}, seed={self.cfg.seed}): reproducible, but not private against "
                     "anyone who knows the seed (config.yaml holds it)")
        if disclosure_line(self.cfg.privacy):
            self.log(disclosure_line(self.cfg.privacy))

    def _durations(self) -> np.ndarray:
        """The virtual seconds of each training client's local update (``fedrod_ray.timing.clock``)."""
        rc, n = self.cfg.rounds, self.setup.num_clients
        trace = None
        if rc.speeds == "trace":
            try:
                trace = read_trace(rc.trace)
            except (OSError, ValueError) as e:
                raise ConfigError(f"rounds.trace: {e}") from None
        speeds = client_speeds(rc.speeds, n, self.cfg.seed, rc.speed, rc.sigma, rc.shape, trace)
        examples = np.asarray(self.setup.sizes[:n])
        model_bytes = sum(v.numel() * v.element_size() for v in self.global_shared.values())
        return durations(speeds, examples, self.cfg.train.local_epochs,
                         communication_seconds(model_bytes, rc.bandwidth))

    def _server_context(self) -> ServerContext:
        ds = self.setup.dataset
        return ServerContext(self.setup.num_clients, self.initial, self.cfg.seed, tuple(ds.image_shape),
                             ds.num_classes)

    def _generic(self, state: StateDict) -> StateDict:
        return {k: v for k, v in state.items() if k in self.generic_keys}

    def snapshot(self) -> Snapshot:
        buffered = self.buffered
        return Snapshot(self.next_round, self.cfg, dict(self.global_shared), dict(self.server_state),
                        self.clients.snapshot(), dict(self.estimate_offset), dict(self.method_state),
                        dict(self.privacy_state), self.virtual_time, buffered.dispatches if buffered else 0,
                        list(buffered.in_flight) if buffered else [], self.executor.kept_states(self._rounds()))

    def _rounds(self) -> dict[int, int]:
        """Each client's committed rounds trained: the version of its state that a runtime keeps itself."""
        return {cid: self.clients.rounds_trained(cid) for cid in self.clients}

    def restore(self, snap: Snapshot) -> None:
        if set(snap.global_shared) != set(self.shared_keys):
            raise ValueError("the snapshot's global weights do not fit this model: "
                             f"{sorted(set(snap.global_shared) ^ set(self.shared_keys))}")
        self.global_shared = dict(snap.global_shared)
        self.server_state = dict(snap.server_state)
        self.method_state = dict(snap.method_state) or self.method.init_server_state(self._server_context())
        if self.dp is not None:
            self.privacy_state = dict(snap.privacy_state) or self.dp.init_state()
        self.clients.restore(snap.clients)
        # A runtime that keeps client states itself (at sites) checks it holds them as the snapshot names them.
        self.executor.restore(snap.sites, self._rounds())
        self.next_round = snap.rounds_done
        self.estimate_offset = dict(snap.estimate_offset)
        self.virtual_time = snap.virtual_time
        if self.buffered is not None:
            self.buffered.restore(snap.dispatches, snap.in_flight)
        self.evaluation.clear()

    def step(self, r: int) -> dict:
        """Run round ``r`` (which must be the next one) and return its record."""
        if r != self.next_round:
            raise ValueError(f"round {r} requested, but the next round is {self.next_round}")
        if r >= self.rounds:
            raise ValueError(f"round {r + 1} requested, but this run trains {self.rounds} (privacy.target_epsilon)")
        t0 = time.perf_counter()
        record = self._buffered_round(r, t0) if self.buffered is not None else self._round(r, t0)
        cfg = self.cfg
        sample = (self.evaluation.estimate(self.executor, self.global_shared, self.clients, r + 1, self.method_state)
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
        return redact_record(record, cfg.privacy)

    def _round(self, r: int, t0: float) -> dict:
        """Round ``r`` with every client sampled at its start (``rounds.mode``: sync or deadline): its record
        up to the evaluation."""
        cfg, dp, rc = self.cfg, self.dp, self.cfg.rounds
        n = self.setup.num_clients
        if rc.mode == "deadline":
            # Over-select; the clients that would miss the deadline never report, so they are not trained.
            sampled = sample_count(cfg.seed, r, n, over_selected(clients_per_round(n, cfg.train.client_fraction),
                                                                  rc.over_selection, n))
            kept, seconds = deadline_round(self.durations[sampled], rc.deadline, cfg.runtime.min_clients_per_round)
            ids = [sampled[i] for i in kept]
        else:
            ids = dp.sample(r) if dp else sample_clients(cfg.seed, r, n, cfg.train.client_fraction)
            seconds = float(self.durations[ids].max(initial=0.0))  # the slowest (a DP round may have none)
        clip_norm = dp.clip_norm(self.privacy_state) if dp else None
        jobs, message = self._send(r, ids, clip_norm)
        self._report(r + 1, 0, len(ids))
        out = (self._collect_sums if self.executor.sums_only else self._collect)(r, ids, jobs, message)
        if ids and len(out.unavailable) == len(ids):
            reasons = "; ".join(sorted({u.reason for u in out.unavailable}))
            raise RoundFailedError(f"round {r + 1}: all {len(ids)} sampled clients are unavailable ({reasons}); the "
                                   "run stops here (runtime.site_wait_s says how long a round waits for a site to "
                                   "come back)")
        self._check_failures(r, len(ids) - len(out.unavailable), out.failures)
        if out.skipped is None:  # a skipped round changes nothing but the clock
            self._apply(r, out)
        self.next_round = r + 1
        self.virtual_time += seconds

        record = self._record(r, out.losses, out.failures, t0, seconds)
        if self.executor.clients_may_be_away:
            record.update(clients=len(ids), clients_unavailable=len(out.unavailable),
                          unavailable_ids=sorted(u.client_id for u in out.unavailable))
        if rc.mode == "deadline":
            record.update(clients=len(sampled), clients_dropped=len(sampled) - len(ids))
        if dp:
            record.update(dp_epsilon=dp.epsilon(r + 1), dp_clip_norm=clip_norm)
        if out.skipped is not None:
            record["round_skipped"] = out.skipped
        return record

    def _apply(self, r: int, out: Collected) -> None:
        """Round ``r``'s server step from what its clients gave (``out``), committed all at once: a round that
        raises leaves the server and every client as they were."""
        update = shared_update(out.sums, self.global_shared, self.generic_keys, self.rule, self.server_state,
                               self.setup.num_clients, self.dp, self.privacy_state, r)
        self.server_state, self.privacy_state = update.server_state, update.privacy_state
        self.clients.update(out.new_states)
        averaged, self.method_state = self.method.server_update(
            {k: update.weights[k] for k in self.shared_keys}, out.results, self._uploads(), self.method_state,
            self.initial, self.setup.num_clients, self._asker(r))
        self.global_shared = {k: averaged[k] for k in self.shared_keys}

    def _collect(self, r: int, ids: list[int], jobs: list, message: RoundInput) -> Collected:
        """Round ``r``'s clients ``ids`` trained (``executor.train``), their results folded into the round's
        sums. theta, psi under the rule's weights; nu (hyper) by sample count whatever the rule; the rule's
        uploads unweighted. Each folds in the order of ``ids``, so the runtimes agree bitwise. With DP, every
        shared weight is summed unweighted instead (``clipped``): a sample count would break the sensitivity."""
        dp = self.dp
        generic, rest, uploads, clipped = (OrderedAverager(len(ids)) for _ in range(4))
        unclipped = 0
        results: dict[int, LocalResult] = {}
        new_states: dict[int, ClientState] = {}
        failures: list[ClientFailure] = []
        unavailable: list[ClientUnavailable] = []  # at sites: clients whose site is away (not failures)
        for slot, out in self.executor.train(r, jobs, message):
            out = self._checked(out, ids[slot], message)
            if isinstance(out, ClientUnavailable):
                for averager in (generic, rest, uploads, clipped):
                    averager.skip(slot)
                unavailable.append(out)
                self.log(f"[round {r + 1}] client {out.client_id} unavailable: {out.reason}")
            elif isinstance(out, ClientFailure):
                res = out
                for averager in (generic, rest, uploads, clipped):
                    averager.skip(slot)
                failures.append(res)
                self.log(f"[round {r + 1}] client {res.client_id} failed: {res.error}\n{res.traceback}")
                self._check_failures(r, len(ids) - len(unavailable), failures)
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
                for averager in (generic, rest, uploads) if dp else (clipped,):  # the sums this mode leaves empty
                    averager.skip(slot)
                results[ids[slot]] = res
            self._report(r + 1, len(results) + len(failures) + len(unavailable), len(ids))
        sums = RoundSums(generic.sum(), rest.sum(), uploads.sum(), clipped.sum(), unclipped)
        return Collected(sums, mean_losses(list(results.values())), results, new_states, failures, unavailable)

    @staticmethod
    def _checked(out, cid: int, message: RoundInput):
        """A client's training outcome as the server takes it: a result whose upload the server refuses
        (``uploads.upload_problem``) becomes the client's failure."""
        if isinstance(out, ClientFailure | ClientUnavailable):
            return out
        res = out[0]
        problem = upload_problem(res.shared, (res.upload, res.method_upload), message.weights, message.clip_norm)
        return out if problem is None else ClientFailure(cid, f"UploadRefused: the server refused {problem}", "")

    def _collect_sums(self, r: int, ids: list[int], jobs: list, message: RoundInput) -> Collected:
        """Round ``r``'s clients ``ids`` trained and summed by a secure aggregation (``executor.train_sums``):
        the server keeps of a client only that it trained and (a copy of) the weights it was sent, never what it
        sent back."""
        # A DP round under Poisson sampling with no client: nothing to sum (under the distributed mechanism, the
        # participants' noise, which the accountant charges for every round).
        if not ids and not (self.dp and self.dp.distributed):
            return Collected(RoundSums.empty(), Losses(0, float("nan"), None))
        request = SumRequest(frozenset(self.generic_keys), self._upload_shapes(), self.dp is not None,
                             tuple(int(n) for n in self.setup.sizes),
                             self.dp.distributed_round(r) if self.dp and self.dp.distributed else None)
        try:
            summed = self.executor.train_sums(r, jobs, message, request)
        except RoundSkipped as e:
            self.log(f"[round {r + 1}] not aggregated: {e}")
            return Collected(RoundSums.empty(), Losses(0, float("nan"), None), skipped=str(e))
        if (key := non_finite(summed.sums.total_state())) is not None:
            raise RoundFailedError(f"round {r + 1}: the secure sum is not finite ({key}): a participant sent a "
                                   "non-finite contribution, and the round is not applied")
        for f in summed.failures:
            self.log(f"[round {r + 1}] client {f.client_id} failed: {f.error}\n{f.traceback}")
        self._check_failures(r, len(ids), summed.failures)
        slots = {cid: slot for slot, (cid, _) in enumerate(jobs)}
        states = {cid: ClientState(local_model={k: v.clone() for k, v in message.weights.items()},
                                   rounds_trained=jobs[slots[cid]][1].rounds_trained + 1) for cid in summed.done}
        self._report(r + 1, len(ids), len(ids))
        return Collected(summed.sums, summed.losses, {}, states, summed.failures)

    def _upload_shapes(self) -> StateDict:
        """The rule's upload of an update that did not move: its keys, shapes and dtypes (SCAFFOLD's Delta c)."""
        generic = self._generic(self.global_shared)
        correction = self.rule.start_local(generic, {}, self.rule.broadcast(self.server_state))
        return correction.finish(generic, 1.0)[1] if correction is not None else {}

    def _record(self, r: int, losses: Losses, failures: list, t0: float, seconds: float) -> dict:
        """A round's (or server step's) record up to the evaluation: its clients' ``losses`` and their
        ``failures`` (``client_id``), the real time since ``t0`` and the virtual ``seconds`` it took, the
        clock already moved on."""
        return {
            # 1-based, as everywhere users see a round: "round 3" is the third, after which 3 are done.
            "round": r + 1, "name": self.cfg.name, "lr": round_lr(self.cfg.train, r),
            "clients": losses.done + len(failures), "clients_done": losses.done, "clients_failed": len(failures),
            "failed_ids": [f.client_id for f in failures],
            "train_loss": losses.train_loss, "personal_loss": losses.personal_loss,
            "train_seconds": round(time.perf_counter() - t0, 4),
            "virtual_time": self.virtual_time, "round_virtual_seconds": seconds,
        }

    def _buffered_round(self, r: int, t0: float) -> dict:
        """Server step ``r`` under FedBuff (``rounds.mode: fedbuff``): the next ``rounds.buffer_size`` arrivals,
        each weighted by its staleness (server steps since it was sent out), applied to the global weights."""
        rc = self.cfg.rounds
        buffer, failed, now = self.buffered.step(r, self.virtual_time)
        staleness = [r - a.version for a in buffer]
        self.global_shared = buffered_update(self.global_shared, [a.delta for a in buffer],
                                             [staleness_weight(s, rc.staleness) for s in staleness], rc.server_lr)
        self.next_round = r + 1
        seconds, self.virtual_time = now - self.virtual_time, now
        self.buffered.dispatch(r + 1, now)  # the last arrival's replacement gets the new model
        record = self._record(r, mean_losses(buffer), failed, t0, seconds)
        record["staleness"] = float(np.mean(staleness))
        return record

    def _train_buffered(self, version: int, pending: list[Arrival]) -> list[Arrival]:
        """FedBuff's untrained clients in flight, trained against the current model (version ``version``)."""
        jobs, message = self._send(version, [a.client_id for a in pending])
        trained = list(pending)
        for slot, out in self.executor.train(version, jobs, message):
            out = self._checked(out, pending[slot].client_id, message)
            if isinstance(out, ClientFailure):
                trained[slot] = dataclasses.replace(pending[slot], error=out.error)
                self.log(f"[step {version + 1}] client {out.client_id} failed: {out.error}\n{out.traceback}")
            else:
                res, state = out
                delta = {k: res.shared[k] - self.global_shared[k] for k in self.shared_keys}
                trained[slot] = dataclasses.replace(pending[slot], delta=delta, state=state,
                                                    num_samples=res.num_samples, loss=res.loss,
                                                    personal_loss=res.personal_loss)
        return trained

    def _arrive(self, version: int, arrival: Arrival, failed: list[Arrival]) -> None:
        """A FedBuff client arrives: its new state is committed; a failure counts against the server step."""
        if arrival.error is None:
            self.clients[arrival.client_id] = arrival.state
        else:
            # Checked as if the rest of the buffer will arrive intact: past the limit, the step fails already.
            self._check_failures(version, self.cfg.rounds.buffer_size + len(failed), failed)

    def _send(self, r: int, ids: list[int], clip_norm: float | None = None) -> tuple[list, RoundInput]:
        """What round (or server step) ``r`` sends clients ``ids``: each one's job (its id and the state it
        trains from) and the message they share (the current global weights, the rule's broadcast, the
        method's per-client messages, the DP clip norm)."""
        from_local = self.rule.starts_from_local_model or self.method.starts_from_local_model
        jobs = [(cid, self.clients[cid].for_training(from_local)) for cid in ids]
        message = RoundInput(self.global_shared, self.rule.broadcast(self.server_state),
                             self.method.messages(self.method_state, ids, self._uploads(), r, self.cfg.seed,
                                                  self._asker(r)), clip_norm)
        return jobs, message

    def _asker(self, r: int) -> Ask:
        """The method's ``Ask`` within round ``r``: its clients' answers, by the executor; a client that fails
        to answer is logged and left out (the method goes on without it)."""

        def ask(phase: str, common: StateDict, questions: dict[int, StateDict]) -> dict[int, StateDict]:
            answers = {}
            for cid, out in self.executor.ask(r, phase, common, questions).items():
                if isinstance(out, ClientFailure):
                    self.log(f"[round {r + 1}] client {cid} did not answer {phase}: {out.error}\n{out.traceback}")
                else:
                    answers[cid] = out
            return answers

        return ask

    def _uploads(self) -> LocalModels:
        """Every training client's last upload (None: it never trained), read when asked for."""
        return self.clients.local_models(self.setup.num_clients)

    def _report(self, round_number: int, finished: int, sampled: int) -> None:
        self.round_progress = (round_number, finished, sampled)
        if self.progress is not None:
            self.progress(round_number, finished, sampled)

    def _check_failures(self, r: int, sampled: int, failures: list[ClientFailure]) -> None:
        """Raise RoundFailedError past the runtime's failure limits. Under client-level DP a client that
        diverged (a non-finite loss or update) is left out of the count, as if it had not been sampled: it is
        dropped from the round's sum, the mean still divides by the expected number, and the limits are for
        what the runtime breaks, not for what the noise does to a client's training."""
        rt = self.cfg.runtime
        if self.dp is not None:
            sampled -= sum(f.diverged for f in failures)
            failures = [f for f in failures if not f.diverged]
        if not failures:
            return
        if len(failures) > rt.max_failed_fraction * sampled or sampled - len(failures) < min(
                rt.min_clients_per_round, sampled):
            ids = ", ".join(str(f.client_id) for f in failures)
            raise RoundFailedError(private_text(
                f"round {r + 1}: {len(failures)} of {sampled} clients failed (clients {ids}); the limits are "
                f"runtime.max_failed_fraction={rt.max_failed_fraction} and "
                f"runtime.min_clients_per_round={rt.min_clients_per_round}. First error: {failures[0].error}",
                self.cfg.privacy))

    def evaluate(self, final: bool = False) -> dict:
        """The metrics of the current state (``evaluation``); ``final`` adds the fine-tuned P-FL."""
        return self.evaluation.evaluate(self.executor, self.global_shared, self.clients, self.method_state,
                                        self.next_round - 1, final)
