"""The math of client-level differential privacy, central model (DP-FedAvg, McMahan et al., 2018; Andrew et
al., 2021 for adaptive clipping; docs/privacy.md), on state dicts, with nothing of a run around it.

A client's update to the shared weights, Delta = w_m - w_bar, is clipped to L2 norm S on the client
(``clip_update``); the server adds N(0, sigma^2 S^2) per coordinate to the sum of the clipped updates and
divides by the expected number of participants (``noised_mean``), so that adding or removing one client
moves the sum by at most S whatever the others did. Which clients took part, and the noise's source, are
the caller's; how much privacy a round spends is ``fedrod_ray.server_math.accounting``'s.
"""

from __future__ import annotations

import math
import os

import torch

from .aggregate import StateDict

# A clipped update is scaled to this fraction of the clip norm: the float64 rounding of its norm (about 1e-16
# of it) can then never take it past S.
CLIP_MARGIN = 1 - 1e-9


def update_norm(model: StateDict, anchor: StateDict) -> float:
    """||model - anchor||_2 over every tensor of ``anchor``, in float64, summed in the keys' sorted order (a
    restored state's dicts may hold them in another: the sum's rounding must not depend on it)."""
    squares = sum((model[k].to(torch.float64) - anchor[k].to(torch.float64)).square().sum() for k in sorted(anchor))
    return math.sqrt(float(squares))


class NonFiniteUpdateError(ArithmeticError):
    """An update whose norm is not finite (NaN or inf weights): scaled, it would be all NaN, and summed, it
    would end the sum's bound; its client failed instead."""


def clip_update(model: StateDict, anchor: StateDict, clip_norm: float) -> tuple[StateDict, bool]:
    """(anchor + clip(model - anchor), whether it was clipped): the update scaled to L2 norm at most
    ``clip_norm``. Raises NonFiniteUpdateError for an update that is not finite.

    An update within the norm comes back as ``model`` itself, bit for bit. A longer one is scaled by
    S / ||Delta|| (less ``CLIP_MARGIN``) in float64 and rounded to the model's dtype towards the anchor, not to
    the nearest value, so that the update the server reads back, (anchor + clip(Delta)) - anchor, is itself
    within S: rounded to the nearest, a small update on large weights could gain a good part of its norm.
    """
    norm = update_norm(model, anchor)
    if not math.isfinite(norm):
        raise NonFiniteUpdateError(f"the update's norm is {norm} (its weights are not finite)")
    if norm <= clip_norm:
        return model, False
    scale = clip_norm / norm * CLIP_MARGIN
    clipped = {}
    for k, a in anchor.items():
        a64 = a.to(torch.float64)
        step = (model[k].to(torch.float64) - a64) * scale
        x = (a64 + step).to(a.dtype)
        past = (x.to(torch.float64) - a64).abs() > step.abs()
        clipped[k] = torch.where(past, torch.nextafter(x, a), x)
    return clipped, True


class SeededNoise:
    """Standard normal draws from a torch generator seeded by the caller (the run's seed and the round): the
    same noise on every run, for reproducible research."""

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)

    def normal(self, n: int) -> torch.Tensor:
        return torch.randn(n, generator=self.generator, dtype=torch.float64)

    def uniform(self, n: int) -> torch.Tensor:
        """Uniforms on (0, 1] (never 0, so that their logarithm is finite)."""
        return 1 - torch.rand(n, generator=self.generator, dtype=torch.float64)


class SecureNoise:
    """Standard normal draws from the operating system's cryptographically secure generator (``os.urandom``),
    by the Box-Muller transform of 53-bit uniforms: noise that no seed reproduces. (Floating-point sampling
    has known side channels, Mironov 2012, which this does not close: see docs/privacy.md.)"""

    def normal(self, n: int) -> torch.Tensor:
        pairs = (n + 1) // 2
        u = self.uniform(2 * pairs).view(2, pairs)
        radius, angle = torch.sqrt(-2 * torch.log(u[0])), 2 * math.pi * u[1]
        return torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])[:n]

    def uniform(self, n: int) -> torch.Tensor:
        """Uniforms on (0, 1]: 53 random bits each, from ``os.urandom``."""
        bits = torch.frombuffer(bytearray(os.urandom(8 * n)), dtype=torch.int64) if n else torch.zeros(0, dtype=torch.int64)
        return ((bits & (2**53 - 1)).to(torch.float64) + 1) * 2.0**-53


def noised_mean(total: StateDict | None, count: int, anchor: StateDict, expected: float, std: float,
                noise: SeededNoise | SecureNoise) -> StateDict:
    """anchor + (sum_m clip(Delta_m) + N(0, std^2)) / expected: the new shared weights, in the anchor's dtypes.

    ``total`` is the float64 sum of the ``count`` clipped uploads anchor + clip(Delta_m) (None: no client took
    part, and the update is the noise alone), so the sum of the clipped updates is total - count * anchor.
    It is computed as (total + (expected - count) * anchor + noise) / expected: a round in which the expected
    number took part, without noise, is then the plain mean total / count, bit for bit. The noise is drawn
    key by key in the keys' sorted order (whatever order a restored state holds them in), ``std`` times
    standard normals.
    """
    out = {}
    for k in sorted(anchor):
        a = anchor[k]
        acc = total[k].clone() if total is not None else torch.zeros(a.shape, dtype=torch.float64)
        if count != expected:
            acc.add_(a.to(torch.float64), alpha=expected - count)
        if std > 0:
            acc.add_(noise.normal(a.numel()).view(a.shape), alpha=std)
        out[k] = (acc / expected).to(a.dtype)
    return {k: out[k] for k in anchor}


def update_noise_multiplier(noise_multiplier: float, count_noise: float) -> float:
    """The noise multiplier of the updates' sum with adaptive clipping (Andrew et al., 2021, Theorem 1).

    The round releases the clipped sum with noise multiplier z_Delta and the count of unclipped updates,
    centred (b_m - 1/2, sensitivity 1/2), with noise std sigma_b: together a Gaussian mechanism of multiplier
    (z_Delta^-2 + (2 sigma_b)^-2)^-1/2. For that to be ``noise_multiplier``, z_Delta = (sigma^-2 -
    (2 sigma_b)^-2)^-1/2, which needs 2 sigma_b > sigma (else the count alone spends the whole budget). Under
    replace-one neighbours (fixed-size sampling) both sensitivities double, and the two are one mechanism of
    multiplier sigma / 2, which is what the accountant charges there.
    """
    if noise_multiplier == 0:
        return 0.0
    if 2 * count_noise <= noise_multiplier:
        raise ValueError(f"the count's noise std {count_noise:g} must be more than half the noise multiplier "
                         f"{noise_multiplier:g}")
    return (noise_multiplier**-2 - (2 * count_noise) ** -2) ** -0.5


def adapted_clip_norm(clip_norm: float, unclipped: int, count: int, expected: float, target_quantile: float,
                      learning_rate: float, count_noise: float, noise: SeededNoise | SecureNoise) -> float:
    """The next round's clip norm (Andrew et al., 2021, geometric update): C exp(-eta (b~ - gamma)), where
    b~ = (sum_m (b_m - 1/2) + N(0, sigma_b^2)) / expected + 1/2 estimates the fraction of the ``count``
    participants' updates that were within C (``unclipped`` of them)."""
    fraction = (unclipped - count / 2 + count_noise * float(noise.normal(1)[0])) / expected + 0.5
    return clip_norm * math.exp(-learning_rate * (fraction - target_quantile))
