"""Empirical and balanced risks as pure functions of (logits, labels, the client's class counts).

``counts`` is the client's per-class example count N_{m,c} (a length-C tensor). All losses return the
mean over the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..config.values import check_registry
from ..specs.losses import LOSSES

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, counts: torch.Tensor | None = None,
                  gamma: float = 0.0) -> torch.Tensor:
    """Empirical risk: plain cross-entropy (counts and gamma are ignored)."""
    return F.cross_entropy(logits, labels)


def balanced_softmax(logits: torch.Tensor, labels: torch.Tensor, counts: torch.Tensor,
                     gamma: float | torch.Tensor = 1.0, reduction: str = "mean") -> torch.Tensor:
    """-log( N_y^gamma e^{g_y} / sum_c N_c^gamma e^{g_c} ): cross-entropy on g + gamma * log N.

    A class with N_c = 0 gets an offset of -inf, i.e. probability exactly 0 (for gamma > 0; gamma = 0 is
    plain cross-entropy); masked_fill keeps both the value and the gradient finite (a -inf offset times a
    zero softmax weight would give NaN). ``gamma`` may be a 0-d tensor that requires grad (Meta-BSM's
    learned gamma_m); ``reduction`` is cross-entropy's (``"none"``: one loss per example).
    """
    if not torch.is_tensor(gamma) and gamma == 0:
        return F.cross_entropy(logits, labels, reduction=reduction)
    counts = counts.to(logits.dtype)
    present = counts > 0
    log_counts = torch.log(torch.where(present, counts, torch.ones_like(counts)))
    # A tensor gamma's value is not branched on in Python (that would need its value on the host).
    absent = ~present & (gamma > 0) if torch.is_tensor(gamma) else ~present
    adjusted = (logits + gamma * log_counts).masked_fill(absent, float("-inf"))
    return F.cross_entropy(adjusted, labels, reduction=reduction)


def importance_reweighting(logits: torch.Tensor, labels: torch.Tensor, counts: torch.Tensor,
                           gamma: float = 1.0) -> torch.Tensor:
    """Cross-entropy with per-example weight sum_c N_c / N_y (a batch's mean of weighted losses)."""
    counts = counts.to(logits.dtype)
    weights = counts.sum() / counts.clamp_min(1)[labels]
    return (weights * F.cross_entropy(logits, labels, reduction="none")).mean()


def ldam(logits: torch.Tensor, labels: torch.Tensor, counts: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Subtract the margin gamma * N_y^{-1/4} from the true-class logit, then cross-entropy."""
    counts = counts.to(logits.dtype)
    margins = gamma * counts.clamp_min(1)[labels].pow(-0.25)
    adjusted = logits - F.one_hot(labels, logits.shape[1]).to(logits.dtype) * margins[:, None]
    return F.cross_entropy(adjusted, labels)


def cdt(logits: torch.Tensor, labels: torch.Tensor, counts: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Class-dependent temperatures: multiply logit g_c by (N_c / N_max)^gamma, then cross-entropy."""
    counts = counts.to(logits.dtype)
    scale = (counts / counts.max()).pow(gamma)
    return F.cross_entropy(logits * scale, labels)


BALANCED_LOSSES: dict[str, LossFn] = {
    "ce": cross_entropy,
    "bsm": balanced_softmax,
    "reweight": importance_reweighting,
    "ldam": ldam,
    "cdt": cdt,
}
check_registry(BALANCED_LOSSES, [n for n, s in LOSSES.items() if not s.objective], "train.balanced_loss")


def get_loss(name: str) -> LossFn:
    try:
        return BALANCED_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; expected one of {sorted(BALANCED_LOSSES)}") from None
