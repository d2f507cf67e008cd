"""FedBuff's math (buffered asynchronous aggregation, Nguyen et al., 2022; ``rounds.mode: fedbuff``): which idle
client the server sends out next, which update in flight arrives next, how a stale update is down-weighted,
and the server step over a full buffer. Pure functions; ``buffered_rounds`` drives them."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from .aggregate import StateDict

DISPATCH_TAG = 23  # the seed's stream of FedBuff's client picks, apart from every other draw


def pick_client(seed: int, dispatch: int, idle: Sequence[int]) -> int:
    """The client the ``dispatch``-th send-out goes to: uniform over the ``idle`` ones (sorted), a function of
    (seed, dispatch) only, so a resumed run picks the same."""
    rng = np.random.default_rng([seed, dispatch, DISPATCH_TAG])
    return int(idle[int(rng.integers(len(idle)))])


def next_arrival(arrivals: Sequence[tuple[float, int]]) -> int:
    """The position of the update that arrives first, of (virtual arrival time, dispatch number) pairs; a tie
    goes to the one sent out first."""
    return min(range(len(arrivals)), key=lambda i: arrivals[i])


def staleness_weight(staleness: int, kind: str) -> float:
    """How much an update computed ``staleness`` server steps ago counts: ``sqrt``, 1/sqrt(1 + s) (the
    paper's); ``constant``, 1."""
    if kind == "sqrt":
        return 1.0 / math.sqrt(1 + staleness)
    if kind == "constant":
        return 1.0
    raise ValueError(f"unknown staleness weighting {kind!r}")


def buffered_update(base: StateDict, deltas: Sequence[StateDict], weights: Sequence[float],
                    server_lr: float) -> StateDict:
    """The server step over a full buffer: ``base + server_lr * (1/K) sum_i weights_i * deltas_i``, the K
    updates folded in the order given (their arrival order) in float64, so that every runtime gets the same
    bits. The result has ``base``'s dtypes; an integer tensor (a batch-norm counter) takes the step rounded."""
    out = {}
    for k, w in base.items():
        total = torch.zeros(w.shape, dtype=torch.float64)
        for delta, weight in zip(deltas, weights, strict=True):
            total += weight * delta[k].to(torch.float64)
        new = w.to(torch.float64) + server_lr * total / len(deltas)
        out[k] = (new if w.is_floating_point() else new.round()).to(w.dtype)
    return out
