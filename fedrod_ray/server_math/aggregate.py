"""Sample-count-weighted averaging of the shared parameters (theta, psi, and nu for the hyper variant).

Floating-point sums depend on their order, so results are always folded in the order of the round's
client list, whatever order they arrive in: the in-process and Ray runtimes then give bitwise-equal
global weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

StateDict = dict[str, torch.Tensor]


def weighted_average(states: Sequence[Mapping[str, torch.Tensor]] | Sequence[torch.Tensor],
                     weights: Sequence[float]) -> StateDict | torch.Tensor:
    """sum_m w_m * state_m / sum_m w_m over state dicts (key by key) or flat vectors.

    Accumulated in float64 and returned in the inputs' dtype.
    """
    averager = OrderedAverager(len(states))
    for i, (state, w) in enumerate(zip(states, weights, strict=True)):
        averager.add(i, {"": state} if isinstance(state, torch.Tensor) else state, w)
    result = averager.result()
    return result[""] if states and isinstance(states[0], torch.Tensor) else result


@dataclass
class WeightedSum:
    """What a weighted mean is made of, whoever summed it: ``total`` = sum_m w_m * state_m in float64 (None:
    no state was added), ``weight`` = sum_m w_m, over ``count`` states, to be cast back to ``dtypes``. The
    round loop folds each client's result into one (``OrderedAverager``); a secure aggregation hands over
    only the totals, never one client's state."""

    total: StateDict | None
    weight: float
    count: int
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)

    def mean(self) -> StateDict:
        """total / weight, key by key, in each state's own dtype."""
        if self.total is None:
            raise RuntimeError("no results to average: every slot was skipped")
        return {k: (v / self.weight).to(self.dtypes[k]) for k, v in self.total.items()}


class OrderedAverager:
    """Streaming weighted average that folds slot i only after slots 0..i-1.

    Results may arrive in any order; out-of-order ones wait in a buffer, and a slot marked ``skip``
    (a client that failed) is passed over. Memory is the accumulator plus the waiting results.
    """

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._next = 0
        self._pending: dict[int, tuple[Mapping[str, torch.Tensor], float] | None] = {}
        self._acc: dict[str, torch.Tensor] | None = None
        self._dtypes: dict[str, torch.dtype] = {}
        self.total_weight = 0.0
        self.count = 0

    def add(self, slot: int, state: Mapping[str, torch.Tensor], weight: float) -> None:
        if weight <= 0:
            raise ValueError(f"slot {slot}: weight must be positive, got {weight}")
        self._put(slot, (state, float(weight)))

    def skip(self, slot: int) -> None:
        self._put(slot, None)

    def _put(self, slot: int, item) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range 0..{self.num_slots - 1}")
        if slot < self._next or slot in self._pending:
            raise ValueError(f"slot {slot} was already given")
        self._pending[slot] = item
        while self._next in self._pending:
            item = self._pending.pop(self._next)
            if item is not None:
                self._fold(*item)
            self._next += 1

    def _fold(self, state: Mapping[str, torch.Tensor], weight: float) -> None:
        if self._acc is None:
            self._acc = {k: v.detach().to(torch.float64) * weight for k, v in state.items()}
            self._dtypes = {k: v.dtype for k, v in state.items()}
        else:
            if state.keys() != self._acc.keys():
                raise KeyError(f"state keys differ: {sorted(set(state) ^ set(self._acc))}")
            for k, v in state.items():
                self._acc[k].add_(v.detach().to(torch.float64), alpha=weight)
        self.total_weight += weight
        self.count += 1

    @property
    def done(self) -> bool:
        return self._next == self.num_slots

    def sum(self) -> WeightedSum:
        """The weighted sum once every slot is in (its total None: every slot was skipped)."""
        if not self.done:
            raise RuntimeError(f"{self.num_slots - self._next} slot(s) still missing")
        return WeightedSum(self._acc, self.total_weight, self.count, self._dtypes)

    def result(self) -> StateDict:
        return self.sum().mean()
