"""ClientHost: the data shards and persistent personalized state of one or more clients.

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
from .local import ClientData, LocalResult, RoundInput, local_update
from .metrics import TestSet, personal_class_correct
from .models import FedModel, build_model


@dataclass
class ClientState:
    """What a client keeps between rounds (never sent to the server's average)."""

    personal: StateDict | None = None  # linear head: phi_m
    local_model: StateDict | None = None  # shared weights after its last local update, for P-FL (PM)
    rule_state: StateDict = field(default_factory=dict)  # owned by the generic rule (empty: its initial state)
    rounds_trained: int = 0

    _PARTS = ("personal", "local_model", "rule_state")

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


class ClientHost:
    """Holds clients' shards and states; trains and evaluates them one at a time."""

    def __init__(self, cfg: ExperimentConfig, client_ids: list[int], train_x: torch.Tensor, train_y: torch.Tensor,
                 indices: dict[int, np.ndarray], counts: dict[int, np.ndarray], test: TestSet,
                 mean: tuple[float, ...], std: tuple[float, ...], augment: bool, num_classes: int,
                 device: str = "cpu"):
        self.cfg = cfg
        self.device = torch.device(device)
        self.mean, self.std, self.augment = mean, std, augment
        self.test = test
        # Each host copies only its own clients' examples out of the (possibly shared) full arrays.
        self.data = {
            cid: ClientData(
                x=train_x[torch.as_tensor(indices[cid], dtype=torch.long)].contiguous(),
                y=train_y[torch.as_tensor(indices[cid], dtype=torch.long)].contiguous(),
                counts=torch.as_tensor(counts[cid], dtype=torch.long),
            )
            for cid in client_ids
        }
        self.states = {cid: ClientState() for cid in client_ids}
        # A trained client's PM only changes when it trains again: its test counts are kept, keyed by
        # rounds_trained, so an evaluation only runs the clients that trained since the last one.
        self._pm_cache: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}
        self.rule = build_rule(cfg.train.generic_rule, cfg.train.rule_params)
        self.model: FedModel = build_model(cfg.model.arch, num_classes, tuple(train_x.shape[1:]),
                                           cfg.train.variant, cfg.hyper_hidden, cfg.seed).to(self.device)

    @property
    def client_ids(self) -> list[int]:
        return list(self.data)

    def train(self, client_id: int, message: RoundInput, round_idx: int) -> LocalResult | ClientFailure:
        """One local update; errors come back as a ClientFailure (with traceback) instead of raising."""
        try:
            state = self.states[client_id]
            result, personal, rule_state = local_update(
                self.model, message, self.data[client_id], self.cfg.train, self.rule,
                round_idx=round_idx, seed=self.cfg.seed, client_id=client_id, mean=self.mean, std=self.std,
                augment=self.augment, personal=state.personal, rule_state=state.rule_state, device=self.device,
            )
        except Exception as e:  # noqa: BLE001 - any client error is reported, never fatal to the round
            return ClientFailure(client_id, f"{type(e).__name__}: {e}", traceback.format_exc())
        # The state changes only once the whole update succeeded: a failed update leaves it untouched.
        state.personal = personal
        state.rule_state = rule_state
        state.local_model = result.shared
        state.rounds_trained += 1
        return result

    def evaluate(self, client_ids: list[int], global_shared: StateDict) -> EvalCounts:
        """Per-class test counts of each client's personalized model (FEDROD.md's PM).

        Fed-RoD: {theta*_m, psi*_m, phi*_m} (or nu*_m) with personalized logits; FedAvg: the local model
        w_m. A client that has not trained yet uses the current global model with its current head.
        """
        out = EvalCounts()
        personal = self.model.variant is not None
        for cid in client_ids:
            state = self.states[cid]
            cached = self._pm_cache.get(cid)
            if cached is not None and cached[0] == state.rounds_trained:
                out.correct[cid], out.total[cid] = cached[1], cached[2]
                continue
            try:
                correct, total = self._evaluate_one(cid, global_shared, personal)
            except Exception as e:  # noqa: BLE001 - one broken client must not stop the evaluation
                out.failed[cid] = f"{type(e).__name__}: {e}"
                continue
            out.correct[cid], out.total[cid] = correct, total
            if state.local_model is not None:
                self._pm_cache[cid] = (state.rounds_trained, correct, total)
        return out

    def _evaluate_one(self, cid: int, global_shared: StateDict, personal: bool):
        state = self.states[cid]
        self.model.load_partial(state.local_model or global_shared)
        if self.model.variant == "linear":
            if state.personal is None:
                torch.nn.init.zeros_(self.model.personal_head.weight)
            else:
                self.model.load_partial(state.personal)
        return personal_class_correct(self.model, self.test, self.data[cid].class_dist,
                                      self.cfg.eval.batch_size, personal)

    def get_states(self) -> dict[int, ClientState]:
        # Copies: a snapshot must not change when training goes on. Training replaces a state's
        # dicts and tensors, never writes into them, so a shallow copy suffices.
        return {cid: dataclasses.replace(st) for cid, st in self.states.items()}

    def set_states(self, states: dict[int, ClientState]) -> None:
        unknown = set(states) - set(self.states)
        if unknown:
            raise KeyError(f"clients {sorted(unknown)} are not hosted here")
        self.states.update({cid: dataclasses.replace(st) for cid, st in states.items()})
        for cid in states:
            self._pm_cache.pop(cid, None)
