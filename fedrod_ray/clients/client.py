"""ClientHost: trains and evaluates clients whose state is handed to it with each call.

A host holds the training arrays (all of them, or views of the object store's copy on a Ray node), the
clients' sample indices and a model, but no client's state: the committed state of every client is the
federation's (``Federation.clients``), sent with each call, and the new state comes back with the
result. So any host can train any client, and a host that dies loses nothing but the call in hand.
The in-process runtime uses one host for every client; the Ray runtime wraps the same class in an actor
(``fedrod_ray.clients.actors``), so both run exactly the same training and evaluation code.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import traceback
from dataclasses import dataclass, field

import numpy as np
import torch

from ..algorithms import build_rule
from ..client_update.local import (
    ClientData,
    LocalResult,
    LocalTrainingError,
    Outcome,
    RoundInput,
    class_distribution,
    derived_seed,
)
from ..config import ExperimentConfig
from ..models import FedModel
from ..models.metrics import TestSet, personal_class_correct, stratified_sample
from ..objectives import OBJECTIVES
from ..personalization import UpdateContext, build_method, method_model
from ..server_math.aggregate import StateDict
from ..server_math.privacy import NonFiniteUpdateError, clip_update

ESTIMATE_TAG = 3  # seeds the estimate's test sample


def estimate_test_set(cfg: ExperimentConfig, test: TestSet) -> TestSet:
    """The test images the P-FL estimate reads (``eval.estimate_size``): a class-stratified sample fixed by
    the run's seed, the same for the server and every host."""
    idx = stratified_sample(test.y, test.num_classes, cfg.eval.estimate_size, derived_seed(cfg.seed, ESTIMATE_TAG))
    return TestSet(test.x[idx], test.y[idx], test.num_classes)


@dataclass
class ClientState:
    """What a client keeps between rounds (never sent to the server's average)."""

    personal: StateDict | None = None  # the personalization method's (linear head: phi_m; Ditto: v_m; ...)
    local_model: StateDict | None = None  # shared weights after its last local update, for P-FL (PM)
    rule_state: StateDict = field(default_factory=dict)  # owned by the generic rule (empty: its initial state)
    rounds_trained: int = 0
    # Owned by the local objective (``fedrod_ray.objectives``), under its name (absent: its initial state).
    objectives: dict[str, StateDict] = field(default_factory=dict)
    # Its optimiser's momentum buffers, by parameter name, with ``train.momentum_buffers: keep`` (else empty):
    # its own history, which its next local update continues, whatever the server sends.
    momentum: StateDict = field(default_factory=dict)

    _PARTS = ("personal", "local_model", "rule_state", "momentum")

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor, keyed ``<part>/<name>``; an objective's part is its name."""
        parts = {part: getattr(self, part) or {} for part in self._PARTS} | self.objectives
        return {f"{part}/{k}": v for part, state in parts.items() for k, v in state.items()}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], rounds_trained: int) -> ClientState:
        parts: dict[str, StateDict] = {}
        objectives: dict[str, StateDict] = {}
        for key, v in tensors.items():
            part, name = key.split("/", 1)
            if part in cls._PARTS:
                parts.setdefault(part, {})[name] = v
            elif part in OBJECTIVES:
                objectives.setdefault(part, {})[name] = v
            else:
                raise KeyError(f"unknown client state part {part!r} in {key!r}")
        return cls(rounds_trained=rounds_trained, objectives=objectives, **parts)

    def trained(self, outcome: Outcome) -> tuple[LocalResult, ClientState]:
        """The result of a local update that started from this state, and the client's state after it."""
        result, personal, rule_state = outcome
        # The new local model *is* the upload: the same tensors, pickled once on the way back.
        return result, ClientState(personal, result.shared, rule_state, self.rounds_trained + 1, result.objectives,
                                   result.momentum)

    def for_training(self, keep_local_model: bool = False) -> ClientState:
        """What a local update reads: the last local model only matters to evaluation (and to rules whose
        clients start from it), so it stays home otherwise."""
        return self if keep_local_model else dataclasses.replace(self, local_model=None)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def clipped(outcome: Outcome, message: RoundInput) -> Outcome:
    """A local update's outcome as it leaves the client: with client-level DP (``message.clip_norm``) its
    shared weights become w_bar + clip(w_m - w_bar), before anything is sent, so that on Ray the unclipped
    update never leaves the client's actor; the client keeps that clipped model as its local model too
    (``ClientState.trained``). Its personal state is not clipped: it never leaves the client. An update that
    is not finite raises LocalTrainingError (diverged), with or without DP: the client failed, and nothing of
    it is summed."""
    result, personal, rule_state = outcome
    if message.clip_norm is None:
        if not all(torch.isfinite(v).all() for v in result.shared.values() if v.is_floating_point()):
            raise LocalTrainingError("the update of the shared weights is not finite", diverged=True)
        return outcome
    try:
        shared, was_clipped = clip_update(result.shared, message.weights, message.clip_norm)
    except NonFiniteUpdateError as e:
        raise LocalTrainingError(str(e), diverged=True) from None
    return dataclasses.replace(result, shared=shared, clipped=was_clipped), personal, rule_state


@dataclass
class ClientFailure:
    client_id: int
    error: str  # "<ExceptionType>: message"
    traceback: str
    diverged: bool = False  # its loss or update was not finite (LocalTrainingError.diverged)

    @classmethod
    def from_exception(cls, client_id: int, e: BaseException, kind: str = "",
                       details: str | None = None) -> ClientFailure:
        """The failure that ``e`` ended the client's call with: its type (with ``kind``, e.g. " (actor died)")
        and the first line of its message, and ``details`` (default: its traceback)."""
        lines = str(e).splitlines()
        return cls(client_id, f"{type(e).__name__}{kind}: {lines[0] if lines else ''}",
                   "".join(traceback.format_exception(e)) if details is None else details,
                   isinstance(e, LocalTrainingError) and e.diverged)


@dataclass(frozen=True)
class ClientUnavailable:
    """A sampled client that could not be reached this round (at sites: its site has no live node); not a
    failure: the round goes on without it, and its state stays as it was."""

    client_id: int
    reason: str


class Cancelled(Exception):
    """A host's evaluation calls were cancelled (``ClientHost.cancel``): the run is stopping."""


@dataclass
class EvalCounts:
    correct: dict[int, torch.Tensor] = field(default_factory=dict)
    total: dict[int, torch.Tensor] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)  # client id -> error, for broken client state

    def merge(self, other: EvalCounts) -> None:
        self.correct.update(other.correct)
        self.total.update(other.total)
        self.failed.update(other.failed)


@dataclass
class ClientContext:
    """What a host serves its clients from, besides the config."""

    # The full arrays (on Ray, read-only views of the node's object store copy): a client's examples are
    # gathered per call, which costs far less than one local epoch.
    train_x: torch.Tensor  # uint8, N x C x H x W
    train_y: torch.Tensor
    indices: dict[int, np.ndarray] | list[np.ndarray]  # client c's rows; a dict: only the clients hosted here
    counts: np.ndarray  # clients x classes: each client's class counts
    test: TestSet
    mean: tuple[float, ...]
    std: tuple[float, ...]
    augment: bool
    # Rows of the server's meta set (``Partition.meta_indices``), which every update of a local objective
    # with one reads.
    meta_indices: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    device: str = "cpu"

    @property
    def num_classes(self) -> int:
        return self.test.num_classes


class ClientHost:
    """Trains and evaluates clients one at a time; their state comes with each call."""

    def __init__(self, cfg: ExperimentConfig, context: ClientContext):
        self.cfg = cfg
        self.context = context
        self.device = torch.device(context.device)
        # How every update of this host's clients sees its images.
        self.mean, self.std, self.augment = context.mean, context.std, context.augment
        self.meta_set: ClientData | None = None
        if len(context.meta_indices):
            idx = torch.as_tensor(context.meta_indices, dtype=torch.long)
            y = context.train_y[idx]
            self.meta_set = ClientData(x=context.train_x[idx], y=y,
                                       counts=torch.bincount(y, minlength=context.num_classes))
        self.rule = build_rule(cfg.train.generic_rule, cfg.train.rule_params)
        self.method = build_method(cfg.train.head, cfg.train.head_params)
        self.model: FedModel = method_model(cfg, self.method, context.num_classes,
                                            tuple(context.train_x.shape[1:])).to(self.device)
        # A client that never trained starts from these (the methods whose clients keep whole models).
        self.initial = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        self._estimate_test: TestSet | None = None
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Stop the evaluation calls in flight from another thread (Ctrl-C in the thread that waits on them):
        each raises Cancelled before its next client, and so does every later one."""
        self._cancelled.set()

    def _clients(self, jobs: list[tuple[int, ClientState]]):
        """``jobs`` one at a time, until ``cancel``."""
        for job in jobs:
            if self._cancelled.is_set():
                raise Cancelled("the evaluation was cancelled")
            yield job

    def data(self, client_id: int) -> ClientData:
        ctx = self.context
        if isinstance(ctx.indices, dict) and client_id not in ctx.indices:
            raise KeyError(f"client {client_id} is not hosted here")
        idx = torch.as_tensor(ctx.indices[client_id], dtype=torch.long)
        return ClientData(x=ctx.train_x[idx], y=ctx.train_y[idx],
                          counts=torch.as_tensor(ctx.counts[client_id], dtype=torch.long))

    def train(self, client_id: int, state: ClientState, message: RoundInput,
              round_idx: int) -> tuple[LocalResult, ClientState] | ClientFailure:
        """One local update and the client's new state; an error comes back as a ClientFailure (with its
        traceback) instead of raising, and then the caller's state stays as it was."""
        try:
            outcome = clipped(self.method.train(self.model, message, self.data(client_id), state.personal,
                                                state.local_model, state.rule_state, state.objectives,
                                                state.momentum, self.context_of(client_id, round_idx)), message)
        except Exception as e:  # noqa: BLE001 - any client error is reported, never fatal to the round
            return ClientFailure.from_exception(client_id, e)
        return state.trained(outcome)

    def answer(self, client_id: int, phase: str, common: StateDict, question: StateDict,
               round_idx: int) -> StateDict | ClientFailure:
        """The client's answer to the server's question within round ``round_idx`` (``Personalization.answer``);
        an error comes back as a ClientFailure. It reads no client state and keeps nothing."""
        try:
            return self.method.answer(phase, self.model, common, question, self.data(client_id),
                                      self.context_of(client_id, round_idx))
        except Exception as e:  # noqa: BLE001 - as train: reported, never fatal to the round
            return ClientFailure.from_exception(client_id, e)

    def context_of(self, client_id: int, round_idx: int) -> UpdateContext:
        """What an update (or a PM's making) of ``client_id`` in round ``round_idx`` reads besides its state."""
        return UpdateContext(self.cfg.train, self.rule, round_idx, self.cfg.seed, client_id, self.mean, self.std,
                             self.augment, self.device, self.initial, self.meta_set)

    def evaluate(self, jobs: list[tuple[int, ClientState]], estimate: bool = False) -> EvalCounts:
        """Per-class test counts of trained clients' personalized models (docs/method.md, "Evaluation": the PM), on the test set or,
        where clients have test sets of their own, on the client's; ``estimate``: on the estimate's sample of
        the test set (``estimate_test_set``) instead of the whole of it.

        Fed-RoD: {theta*_m, psi*_m, phi*_m} (or nu*_m) with personalized logits; FedAvg: the local model
        w_m. (A client that never trained has no model of its own: ``Federation.evaluate`` scores it
        with the global one, in one pass for all such clients.)
        """
        out = EvalCounts()
        personal = self.model.has_personal
        test = self.context.test
        if estimate:
            if self._estimate_test is None:
                self._estimate_test = estimate_test_set(self.cfg, test)
            test = self._estimate_test
        for cid, state in self._clients(jobs):
            try:
                if state.local_model is None:
                    raise ValueError("the client's state has no local model to evaluate")
                self.method.load_pm(self.model, state, functools.partial(self.data, cid),
                                    self.context_of(cid, state.rounds_trained - 1))
                dist = class_distribution(torch.as_tensor(self.context.counts[cid], dtype=torch.long))
                out.correct[cid], out.total[cid] = personal_class_correct(
                    self.model, test, dist, self.cfg.eval.batch_size, personal, cid)
            except Exception as e:  # noqa: BLE001 - one broken client must not stop the evaluation
                out.failed[cid] = f"{type(e).__name__}: {e}"
        return out

    def finetune(self, jobs: list[tuple[int, ClientState]], message: RoundInput, epochs: int,
                 round_idx: int) -> EvalCounts:
        """Per-class test counts of each client's model after ``epochs`` epochs of its method's adaptation on
        its own data (``Personalization.adapt``: by default fine-tuning, docs/method.md, "Baselines": FT, and
        "Evaluation": new clients) from what it received, ``message`` (a new client: with its
        ``new_client_message`` entry), at round ``round_idx``; nothing is kept."""
        return self._score(jobs, lambda cid, state, data: self.method.adapt(
            self.model, message, data, state.personal, epochs, self.context_of(cid, round_idx)))

    def zero_shot(self, jobs: list[tuple[int, ClientState]], message: RoundInput, round_idx: int) -> EvalCounts:
        """Per-class test counts of the zero-shot models of clients that never trained
        (``Personalization.new_client_model``, from ``message`` and their data) after round ``round_idx``."""
        return self._score(jobs, lambda cid, state, data: self.method.new_client_model(
            self.model, message, data, self.context_of(cid, round_idx)))

    def _score(self, jobs: list[tuple[int, ClientState]], make_model) -> EvalCounts:
        """Per-class test counts of the model ``make_model(client id, state, data)`` gives each client of
        ``jobs``, weighted by its class distribution; a client whose model fails is counted as failed."""
        out = EvalCounts()
        for cid, state in self._clients(jobs):
            try:
                data = self.data(cid)
                model = make_model(cid, state, data)
                out.correct[cid], out.total[cid] = personal_class_correct(
                    model, self.context.test, data.class_dist, self.cfg.eval.batch_size, model.has_personal,
                    cid)
            except Exception as e:  # noqa: BLE001 - one client's failure must not stop the others'
                out.failed[cid] = f"{type(e).__name__}: {e}"
        return out
