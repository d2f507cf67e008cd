"""The distributed discrete Gaussian mechanism (Kairouz, Liu, Steinke, ICML 2021; docs/privacy.md, "Distributed
DP"): each participant of a secure sum adds its own share of the noise, in the integers, before the sum is
masked, so that whoever unmasks the sum sees it noised.

A participant (a SuperNode, for its sampled clients) rotates each client's clipped update by a randomized
Hadamard transform (``rotate``: random signs shared by every party for the round, then the Walsh-Hadamard
transform, the vector zero-padded to a power of 2), which spreads its norm evenly over the coordinates, scales
it by 1 / gamma, rounds it to integers by conditional randomized rounding (``conditional_round``: rounding
again until the rounded vector is within the bound that the accountant charges), sums its clients' vectors,
adds discrete Gaussian noise (``discrete_gaussian``) and reduces the sum modulo m (``encode``). The secure sum
of the participants' vectors mod m, centred (``center``), scaled by gamma and rotated back (``decode``), is
the sum of the clipped updates plus the noise of every participant, plus the rounding. The privacy this
spends is ``distributed_accounting``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

# The conditional rounding's constant beta (the paper's exp(-1/2)): a rounded vector is within the bound with
# probability at least 1 - beta, so a participant rounds 1 / (1 - beta) = 2.5 times on average.
BETA = math.exp(-0.5)
MOST_ROUNDINGS = 1000  # a vector that no rounding of this many brings within the bound is not a clipped one


class Uniforms(Protocol):
    """Where the randomness comes from: ``privacy.SecureNoise`` (the OS's CSPRNG) or ``privacy.SeededNoise``."""

    def uniform(self, n: int) -> torch.Tensor: ...


def padded_dim(dim: int) -> int:
    """The dimension the Walsh-Hadamard transform needs: the least power of 2 at least ``dim``."""
    return 1 << max(dim - 1, 0).bit_length()


def random_signs(seed: int, dim: int) -> torch.Tensor:
    """The rotation's diagonal of +-1 for a padded dimension ``dim``, from ``seed`` (every party derives the same
    from the round's public seed: the rotation is for the vectors' flatness, not a secret)."""
    bits = torch.randint(0, 2, (dim,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64)
    return (2 * bits - 1).to(torch.float64)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard transform H x / sqrt(n) of a vector whose length n is a power of 2: its
    own inverse (H is symmetric and H H = n I). O(n log n) by butterflies."""
    n = x.numel()
    y, h = x.reshape(-1).to(torch.float64), 1
    while h < n:
        pairs = y.view(-1, 2, h)
        y = torch.stack((pairs[:, 0] + pairs[:, 1], pairs[:, 0] - pairs[:, 1]), dim=1).reshape(n)
        h *= 2
    return y / math.sqrt(n)


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """H D x: ``x`` zero-padded to the length of ``signs`` (D), flipped by them, then transformed."""
    padded = torch.zeros(signs.numel(), dtype=torch.float64)
    padded[:x.numel()] = x.reshape(-1).to(torch.float64)
    return hadamard(padded * signs)


def unrotate(y: torch.Tensor, signs: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of ``rotate``: D H y, the first ``dim`` coordinates."""
    return (hadamard(y) * signs)[:dim]


def rounding_bound(norm: float, dim: int, beta: float = BETA) -> float:
    """The L2 norm that conditional randomized rounding keeps a vector of norm at most ``norm`` in ``dim``
    coordinates within (the paper's Theorem 1 / Proposition 22): min(norm + sqrt(d), sqrt(norm^2 + d / 4 +
    sqrt(2 log(1 / beta)) (norm + sqrt(d) / 2))). The first holds for every rounding; a rounding lies within
    the second with probability at least 1 - beta."""
    always = norm + math.sqrt(dim)
    likely = math.sqrt(norm**2 + dim / 4 + math.sqrt(2 * math.log(1 / beta)) * (norm + math.sqrt(dim) / 2))
    return min(always, likely)


def randomized_round(x: torch.Tensor, noise: Uniforms) -> torch.Tensor:
    """Each coordinate to floor(x) + 1 with probability x - floor(x), else floor(x): unbiased, as int64."""
    low = torch.floor(x)
    return (low + (noise.uniform(x.numel()).view(x.shape) <= x - low)).to(torch.int64)


def conditional_round(x: torch.Tensor, bound: float, noise: Uniforms) -> torch.Tensor:
    """``randomized_round`` of ``x``, drawn again until the rounded vector's L2 norm is at most ``bound``
    (``rounding_bound`` of x's norm bound): the sensitivity the accountant charges then holds for every
    vector sent. Raises ValueError after ``MOST_ROUNDINGS`` draws (x was not within the norm bound)."""
    for _ in range(MOST_ROUNDINGS):
        rounded = randomized_round(x, noise)
        if math.sqrt(float(rounded.to(torch.float64).square().sum())) <= bound:
            return rounded
    raise ValueError(f"no rounding of a vector of norm {float(x.norm()):.4g} came within {bound:.4g} in "
                     f"{MOST_ROUNDINGS} draws: it exceeds the clip norm it was rounded for")


def discrete_gaussian(n: int, sigma: float, noise: Uniforms) -> torch.Tensor:
    """``n`` independent draws of the discrete Gaussian N_Z(0, sigma^2) (P(y) proportional to exp(-y^2 / (2
    sigma^2)) on the integers), as int64, by Canonne, Kamath and Steinke's rejection sampler (NeurIPS 2020,
    Algorithm 3): a discrete Laplace Y of scale t = floor(sigma) + 1, kept with probability exp(-(|Y| -
    sigma^2 / t)^2 / (2 sigma^2)). The discrete Laplace is the difference of two geometric variables floor(t E)
    of exponential E = -log U. In float64 arithmetic, not the paper's exact rationals (as TensorFlow
    Federated's implementation does): tests/test_distributed_dp.py checks the draws against the pmf."""
    if sigma == 0:
        return torch.zeros(n, dtype=torch.int64)
    t = math.floor(sigma) + 1
    kept: list[torch.Tensor] = []
    need = n
    while need > 0:
        batch = 2 * need + 16  # at least half are kept (the paper's bound on the rejections)
        u = noise.uniform(3 * batch).view(3, batch)
        y = torch.floor(-torch.log(u[0]) * t) - torch.floor(-torch.log(u[1]) * t)
        keep = u[2] <= torch.exp(-(y.abs() - sigma**2 / t).square() / (2 * sigma**2))
        kept.append(y[keep][:need].to(torch.int64))
        need -= kept[-1].numel()
    return torch.cat(kept) if kept else torch.zeros(0, dtype=torch.int64)


def wrap(z: torch.Tensor, modulus: int) -> torch.Tensor:
    """z mod m, in [0, m)."""
    return torch.remainder(z, modulus)


def center(z: torch.Tensor, modulus: int) -> torch.Tensor:
    """The representative of z mod m in [-m / 2, m / 2): a sum that did not wrap comes back as it was."""
    return torch.remainder(z + modulus // 2, modulus) - modulus // 2


@dataclass(frozen=True)
class Encoding:
    """One round's public parameters of the mechanism: the scale ``gamma`` (the integer grid's step, in the
    weights' units), the ring's ``modulus`` m, each participant's noise ``local_sigma`` (in grid steps), the
    conditional rounding's ``bound`` (in grid steps) and the vector's ``dim`` (unpadded)."""

    gamma: float
    modulus: int
    local_sigma: float
    bound: float
    dim: int

    @property
    def padded(self) -> int:
        return padded_dim(self.dim)


def encode(updates: list[torch.Tensor], enc: Encoding, signs: torch.Tensor, noise: Uniforms) -> torch.Tensor:
    """A participant's vector for the secure sum: sum over its clients' clipped ``updates`` (flat float64
    vectors of ``enc.dim``) of the conditionally rounded rotate(update) / gamma, plus its discrete Gaussian
    noise, mod m (int64 in [0, m)). A participant without a client sends its noise alone."""
    total = torch.zeros(enc.padded, dtype=torch.int64)
    for x in updates:
        total += conditional_round(rotate(x, signs) / enc.gamma, enc.bound, noise)
    return wrap(total + discrete_gaussian(enc.padded, enc.local_sigma, noise), enc.modulus)


def decode(total: torch.Tensor, enc: Encoding, signs: torch.Tensor) -> torch.Tensor:
    """The noised sum of the clipped updates (float64, ``enc.dim``) from the secure sum mod m of the
    participants' ``encode``d vectors: centred, scaled by gamma, rotated back."""
    return unrotate(center(total.to(torch.int64), enc.modulus).to(torch.float64) * enc.gamma, signs, enc.dim)


@dataclass(frozen=True)
class DistributedRound:
    """One round of the mechanism as its participants are told it: the ``encoding``, the seed of the round's
    rotation (``random_signs``; public) and, for experiments only, the seed each participant's rounding and
    noise are derived from (None: each draws from the OS's CSPRNG, which nothing replays)."""

    encoding: Encoding
    rotation_seed: int
    noise_seed: int | None

    def signs(self) -> torch.Tensor:
        return random_signs(self.rotation_seed, self.encoding.padded)
