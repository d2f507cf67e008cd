"""What a round's participants give the server, summed: ``RoundSums`` (the weights its server step reads) and
``Losses`` (how many finished and their mean losses).

The round loop folds each client's result into them in the round's client order; a secure aggregation (an
executor that is ``sums_only``, e.g. Flower's SecAgg+) hands over the same sums without any one client's
result. ``round_loop.round_sums.shared_update`` turns them into the new shared weights either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .aggregate import WeightedSum


@dataclass
class RoundSums:
    """The round's sums over its participants: without client-level DP, theta and psi under the rule's
    ``aggregation_weight`` (``generic``), the other shared weights (the hyper head's nu) by sample count
    (``rest``) and the rule's uploads unweighted (``uploads``); with it, every shared weight unweighted
    (``clipped``, each participant's anchor + clip(Delta)) and how many updates were within the clip norm
    (``unclipped``). The sums a mode does not use are empty."""

    generic: WeightedSum
    rest: WeightedSum
    uploads: WeightedSum
    clipped: WeightedSum
    unclipped: int = 0

    def total_state(self) -> dict:
        """Every sum's total in one state (keys prefixed by the sum's name), to check them all at once."""
        return {f"{name}.{k}": v for name in ("generic", "rest", "uploads", "clipped")
                for k, v in (getattr(self, name).total or {}).items()}

    @classmethod
    def empty(cls) -> RoundSums:
        """The sums of a round with no participant (a DP round under Poisson sampling may have none)."""
        none = WeightedSum(None, 0.0, 0)
        return cls(none, none, none, none)


@dataclass
class Losses:
    """A round's participants as its record reports them: how many finished, their sample-weighted mean loss
    (NaN without any: a DP round under Poisson sampling may have none) and personal loss (None: the method has
    none)."""

    done: int
    train_loss: float
    personal_loss: float | None


def mean_losses(done: list) -> Losses:
    """The ``Losses`` of the clients ``done`` (each with ``num_samples``, ``loss`` and ``personal_loss``)."""
    weights = np.array([res.num_samples for res in done], dtype=np.float64)
    return Losses(len(done), float(np.average([res.loss for res in done], weights=weights)) if done else math.nan,
                  (float(np.average([res.personal_loss for res in done], weights=weights))
                   if done and done[0].personal_loss is not None else None))
