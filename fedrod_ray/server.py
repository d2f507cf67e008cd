"""Server-side pure functions: which clients train in a round, and how their results become the new
global weights (FEDROD.md, "One round", steps 1 and 4)."""

from __future__ import annotations

import numpy as np
import torch

from .aggregate import StateDict
from .config import TrainConfig

SAMPLE_TAG = 2


def clients_per_round(num_clients: int, fraction: float) -> int:
    return max(1, min(num_clients, int(fraction * num_clients + 0.5)))


def sample_clients(seed: int, round_idx: int, num_clients: int, fraction: float) -> list[int]:
    """The round's clients, sorted; a function of (seed, round) only, so timing and restarts never change it."""
    rng = np.random.default_rng([seed, round_idx, SAMPLE_TAG])
    chosen = rng.choice(num_clients, size=clients_per_round(num_clients, fraction), replace=False)
    return sorted(int(c) for c in chosen)


def server_update(cfg: TrainConfig, previous: StateDict, averaged: StateDict, generic_keys: list[str],
                  num_participants: int, num_clients: int, dyn_h: StateDict | None) -> tuple[StateDict, StateDict | None]:
    """The new global weights from the round's weighted average.

    FedAvg and FedProx take the average as is. FedDyn (Acar et al., 2021) keeps a server state h:
    h <- h - alpha * (|P|/M) * (avg - previous), and the new theta, psi = avg - h / alpha.
    """
    if cfg.generic_rule != "feddyn":
        return averaged, None
    alpha = cfg.feddyn_alpha
    if dyn_h is None:
        dyn_h = {k: torch.zeros_like(previous[k]) for k in generic_keys}
    new = dict(averaged)
    new_h = {}
    for k in generic_keys:
        new_h[k] = dyn_h[k] - alpha * (num_participants / num_clients) * (averaged[k] - previous[k])
        new[k] = averaged[k] - new_h[k] / alpha
    return new, new_h
