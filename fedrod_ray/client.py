"""ClientHost: trains and evaluates clients whose state is handed to it with each call.

A host holds the training arrays (all of them, or views of the object store's copy on a Ray node), the
clients' sample indices and a model, but no client's state: the committed state of every client is the
federation's (``Federation.clients``), sent with each call, and the new state comes back with the
result. So any host can train any client, and a host that dies loses nothing but the call in hand.
The in-process runtime uses one host for every client; the Ray runtime wraps the same class in an actor
(``fedrod_ray.actors``), so both run exactly the same training and evaluation code.
"""

from __future__ import annotations

import dataclasses
import traceback
from dataclasses import dataclass, field

import numpy as np
import torch

from .aggregate import StateDict
from .algorithms import build_rule
from .config import ExperimentConfig
from .local import ClientData, LocalResult, RoundInput, class_distribution, derived_seed, local_update
from .metrics import TestSet, personal_class_correct
from .models import FedModel, build_model

FINETUNE_TAG = 2  # seeds fine-tuning's data order apart from every training round's


@dataclass
class ClientState:
    """What a client keeps between rounds (never sent to the server's average)."""

    personal: StateDict | None = None  # linear head: phi_m
    local_model: StateDict | None = None  # shared weights after its last local update, for P-FL (PM)
    rule_state: StateDict = field(default_factory=dict)  # owned by the generic rule (empty: its initial state)
    rounds_trained: int = 0
    meta_bsm: StateDict = field(default_factory=dict)  # Meta-BSM: gamma_m (empty: its initial value)

    _PARTS = ("personal", "local_model", "rule_state", "meta_bsm")

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor, keyed ``<part>/<name>``."""
        return {f"{part}/{k}": v for part in self._PARTS for k, v in (getattr(self, part) or {}).items()}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], rounds_trained: int) -> ClientState:
        parts: dict[str, StateDict] = {}
        for key, v in tensors.items():
            part, name = key.split("/", 1)
            if part not in cls._PARTS:
                raise KeyError(f"unknown client state part {part!r} in {key!r}")
            parts.setdefault(part, {})[name] = v
        return cls(rounds_trained=rounds_trained, **parts)

    def for_training(self, keep_local_model: bool = False) -> ClientState:
        """What a local update reads: the last local model only matters to evaluation (and to rules whose
        clients start from it), so it stays home otherwise."""
        return self if keep_local_model else dataclasses.replace(self, local_model=None)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


@dataclass
class ClientFailure:
    client_id: int
    error: str  # "<ExceptionType>: message"
    traceback: str


@dataclass
class EvalCounts:
    correct: dict[int, torch.Tensor] = field(default_factory=dict)
    total: dict[int, torch.Tensor] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)  # client id -> error, for broken client state

    def merge(self, other: EvalCounts) -> None:
        self.correct.update(other.correct)
        self.total.update(other.total)
        self.failed.update(other.failed)


class ClientHost:
    """Trains and evaluates clients one at a time; their state comes with each call."""

    def __init__(self, cfg: ExperimentConfig, train_x: torch.Tensor, train_y: torch.Tensor,
                 indices: dict[int, np.ndarray] | list[np.ndarray], counts: np.ndarray, test: TestSet,
                 mean: tuple[float, ...], std: tuple[float, ...], augment: bool, num_classes: int,
                 device: str = "cpu", meta_indices: np.ndarray | None = None):
        """``indices[c]`` are client c's rows of ``train_x`` and ``counts[c]`` its class counts; a host
        given a dict of indices serves only those clients. ``meta_indices`` are the rows of Meta-BSM's
        meta set (``Partition.meta_indices``), which every client's update reads."""
        self.cfg = cfg
        self.device = torch.device(device)
        self.mean, self.std, self.augment = mean, std, augment
        self.test = test
        # The full arrays stay shared (on Ray, read-only views of the node's object store); a client's
        # examples are gathered per call, which costs far less than one local epoch.
        self.train_x, self.train_y = train_x, train_y
        self.indices, self.counts = indices, counts
        self.meta_set: ClientData | None = None
        if meta_indices is not None and len(meta_indices):
            idx = torch.as_tensor(meta_indices, dtype=torch.long)
            self.meta_set = ClientData(x=train_x[idx], y=train_y[idx],
                                       counts=torch.bincount(train_y[idx], minlength=num_classes))
        self.rule = build_rule(cfg.train.generic_rule, cfg.train.rule_params)
        self.model: FedModel = build_model(cfg.model.arch, num_classes, tuple(train_x.shape[1:]),
                                           cfg.train.variant, cfg.hyper_hidden, cfg.seed,
                                           cfg.train.mwn_hidden, cfg.model.init).to(self.device)
        self._finetune_model: FedModel | None = None

    def data(self, client_id: int) -> ClientData:
        if isinstance(self.indices, dict) and client_id not in self.indices:
            raise KeyError(f"client {client_id} is not hosted here")
        idx = torch.as_tensor(self.indices[client_id], dtype=torch.long)
        return ClientData(x=self.train_x[idx], y=self.train_y[idx],
                          counts=torch.as_tensor(self.counts[client_id], dtype=torch.long))

    def train(self, client_id: int, state: ClientState, message: RoundInput,
              round_idx: int) -> tuple[LocalResult, ClientState] | ClientFailure:
        """One local update and the client's new state; an error comes back as a ClientFailure (with its
        traceback) instead of raising, and then the caller's state stays as it was."""
        try:
            result, personal, rule_state = local_update(
                self.model, message, self.data(client_id), self.cfg.train, self.rule,
                round_idx=round_idx, seed=self.cfg.seed, client_id=client_id, mean=self.mean, std=self.std,
                augment=self.augment, personal=state.personal, rule_state=state.rule_state,
                initial=state.local_model if self.rule.starts_from_local_model else None,
                meta_set=self.meta_set, meta_state=state.meta_bsm or None, device=self.device,
            )
        except Exception as e:  # noqa: BLE001 - any client error is reported, never fatal to the round
            return ClientFailure(client_id, f"{type(e).__name__}: {e}", traceback.format_exc())
        # The new local model *is* the upload: the same tensors, pickled once on the way back.
        return result, ClientState(personal, result.shared, rule_state, state.rounds_trained + 1, result.meta_bsm)

    def evaluate(self, jobs: list[tuple[int, ClientState]]) -> EvalCounts:
        """Per-class test counts of trained clients' personalized models (FEDROD.md's PM).

        Fed-RoD: {theta*_m, psi*_m, phi*_m} (or nu*_m) with personalized logits; FedAvg: the local model
        w_m. (A client that never trained has no model of its own: ``Federation.evaluate`` scores it
        with the global one, in one pass for all such clients.)
        """
        out = EvalCounts()
        personal = self.model.variant is not None
        for cid, state in jobs:
            try:
                if state.local_model is None:
                    raise ValueError("the client's state has no local model to evaluate")
                self.model.load_partial(state.local_model)
                if self.model.variant == "linear":
                    if state.personal is None:
                        torch.nn.init.zeros_(self.model.personal_head.weight)
                    else:
                        self.model.load_partial(state.personal)
                dist = class_distribution(torch.as_tensor(self.counts[cid], dtype=torch.long))
                out.correct[cid], out.total[cid] = personal_class_correct(
                    self.model, self.test, dist, self.cfg.eval.batch_size, personal)
            except Exception as e:  # noqa: BLE001 - one broken client must not stop the evaluation
                out.failed[cid] = f"{type(e).__name__}: {e}"
        return out

    def finetune(self, jobs: list[tuple[int, ClientState]], message: RoundInput, epochs: int,
                 round_idx: int) -> EvalCounts:
        """Per-class test counts of each client's model after ``epochs`` epochs of fine-tuning on its own data,
        starting from the global model ``message.weights`` (FEDROD.md, the FT baseline and new clients).

        One head (FedAvg and its kin): the whole model, with ERM (cross-entropy). Fed-RoD: its own local
        objective, from the global theta and psi and the client's head: its phi_m (zeros for a client that
        never trained) or, for hyper, the zero-shot head H(a_m; nu_bar), which is then tuned as a linear head.
        Plain SGD (no generic rule's term) at round ``round_idx``'s learning rate; nothing is kept.
        """
        out = EvalCounts()
        model = self._finetuner()
        t = self.cfg.train
        cfg = dataclasses.replace(
            t, head="none" if t.head == "none" else "linear", local_epochs=epochs, generic_rule="fedavg",
            rule_params={}, balanced_loss="ce" if t.head == "none" else ("bsm" if t.balanced_loss == "meta_bsm"
                                                                          else t.balanced_loss))
        plain = build_rule("fedavg")
        own = model.state_dict()  # a tuned hyper model has no hypernetwork to load
        start = {k: v for k, v in message.weights.items() if k in own}
        if t.head == "hyper":
            self.model.load_partial(message.weights)
        for cid, state in jobs:
            try:
                data = self.data(cid)
                personal = state.personal
                if t.head == "hyper":
                    with torch.no_grad():
                        personal = {"personal_head.weight": self.model.personal_weight(data.class_dist.to(self.device))}
                local_update(model, RoundInput(start), data, cfg, plain, round_idx=round_idx,
                             seed=derived_seed(self.cfg.seed, FINETUNE_TAG), client_id=cid, mean=self.mean,
                             std=self.std, augment=self.augment, personal=personal, device=self.device)
                out.correct[cid], out.total[cid] = personal_class_correct(
                    model, self.test, data.class_dist, self.cfg.eval.batch_size, model.variant is not None)
            except Exception as e:  # noqa: BLE001 - one client's failure must not stop the others'
                out.failed[cid] = f"{type(e).__name__}: {e}"
        return out

    def _finetuner(self) -> FedModel:
        """The model fine-tuning trains: this host's, except that a generated (hyper) head is tuned as a
        linear one."""
        if self.model.variant != "hyper":
            return self.model
        if self._finetune_model is None:
            m = self.model
            self._finetune_model = build_model(m.arch, m.num_classes, tuple(self.train_x.shape[1:]), "linear",
                                               seed=self.cfg.seed).to(self.device)
        return self._finetune_model
