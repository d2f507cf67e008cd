"""The privacy accountant of the distributed discrete Gaussian (``distributed_dp``; Kairouz, Liu, Steinke, ICML
2021), and the choice of its grid from the bits per coordinate.

A round sums, in the integers, every client's conditionally rounded update (L2 norm at most Delta_2, the
``rounding_bound`` of S / gamma) and at least ``n_min`` participants' discrete Gaussians N_Z(0, s^2) each. A sum of
discrete Gaussians is not one; the paper's Proposition 14 bounds the mechanism's Renyi divergence of order alpha
by the least of
    alpha l2^2 / 2 + tau d,   alpha / 2 (l2^2 + 2 l1 tau + tau^2 d),   alpha / 2 (l2 + sqrt(d) tau)^2,
where l2 = Delta_2 / (sqrt(n) s), l1 = Delta_1 / (sqrt(n) s), d the padded dimension and tau = 10 sum_{k=1}^{n-1}
exp(-2 pi^2 s^2 k / (k + 1)) (their Theorem 1). Adding or removing one client moves the sum by one rounded
vector; the noise of participants beyond n_min is independent of the data, so it only post-processes the
mechanism of n_min: the bound at n_min holds for any number that finish. Poisson sampling of the clients at
rate q amplifies it by Zhu and Wang's general upper bound (ICML 2019, Theorem 6, for integer orders), as the
paper does; r rounds add up, and epsilon at delta is dp_accounting's conversion of the RDP curve. The modular
wraparound is post-processing (it costs accuracy, never privacy); its probability sets gamma.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np
from scipy import special

from .distributed_dp import Encoding, padded_dim, rounding_bound

ORDERS = np.arange(2, 257, dtype=np.float64)  # integer orders: Zhu and Wang's bound holds at integers
WRAP_PROBABILITY = 1e-6  # a round's chance, bounded above, that some coordinate of the sum wraps around m
NOISE_BRACKET = (1e-3, 1e3)  # the noise multipliers a target epsilon is searched between


def tau(participants: int, sigma: float) -> float:
    """The paper's tau: how far a sum of ``participants`` discrete Gaussians of parameter ``sigma`` is from one."""
    return 10 * sum(math.exp(-2 * math.pi**2 * sigma**2 * k / (k + 1)) for k in range(1, participants))


def round_rdp(orders: np.ndarray, l1: float, l2: float, t: float, dim: int) -> np.ndarray:
    """The RDP of one unsampled round at ``orders`` (Proposition 14): ``l1``, ``l2`` the sensitivities over the
    summed noise's parameter sqrt(n) s, ``t`` = tau, ``dim`` the padded dimension."""
    return np.minimum.reduce([orders * l2**2 / 2 + t * dim, orders / 2 * (l2**2 + 2 * l1 * t + t**2 * dim),
                              orders / 2 * (l2 + math.sqrt(dim) * t) ** 2])


def poisson_subsampled_rdp(orders: np.ndarray, q: float, rdp: np.ndarray) -> np.ndarray:
    """Zhu and Wang's general upper bound (ICML 2019, Theorem 6) on the RDP at integer ``orders`` of a mechanism
    of RDP ``rdp`` (at the orders 2, 3, ...: ``orders`` must be exactly those) run on a Poisson sample at rate
    ``q``, under add-or-remove-one neighbours: for each alpha, 1 / (alpha - 1) log((1 - q)^(alpha - 1)
    (alpha q - q + 1) + C(alpha, 2) q^2 (1 - q)^(alpha - 2) e^eps(2) + 3 sum_{l=3}^alpha C(alpha, l) (1 - q)^(alpha
    - l) q^l e^((l - 1) eps(l))); never above the unsampled RDP."""
    if q == 1:
        return rdp.copy()
    alpha, ls = orders[:, None], orders[None, :]  # every (alpha, l) at once; l > alpha left out
    log_comb = special.gammaln(alpha + 1) - special.gammaln(ls + 1) - special.gammaln(np.maximum(alpha - ls, 0) + 1)
    terms = log_comb + (alpha - ls) * math.log1p(-q) + ls * math.log(q) + (ls - 1) * rdp[None, :]
    terms = np.where(ls <= alpha, terms, -np.inf)
    first = (orders - 1) * math.log1p(-q) + np.log(orders * q - q + 1)
    weights = np.where(ls == 2, 1.0, 3.0) * np.ones_like(terms)
    total = special.logsumexp(np.concatenate([first[:, None], terms], axis=1),
                              b=np.concatenate([np.ones_like(first)[:, None], weights], axis=1), axis=1)
    return np.minimum(total / (orders - 1), rdp)


@dataclass(frozen=True)
class DistributedMechanism:
    """One round of the distributed discrete Gaussian as configured: total noise ``noise_multiplier`` z times
    the clip norm S over the gradients' sum when ``min_participants`` participants finish (each adds
    N_Z(0, (z S / gamma)^2 / n_min)), clients sampled at ``rate`` q, ``clients`` expected a round,
    ``max_participants`` at most summed, a ring of 2^``bits`` and ``dim`` coordinates."""

    noise_multiplier: float
    clip_norm: float
    rate: float
    clients: float
    min_participants: int
    max_participants: int
    bits: int
    dim: int

    def with_noise(self, noise_multiplier: float) -> DistributedMechanism:
        return dataclasses.replace(self, noise_multiplier=noise_multiplier)

    def encoding(self) -> Encoding:
        """The grid: the least gamma whose sum stays within the ring but with probability ``WRAP_PROBABILITY``.

        Each coordinate of the sum, in grid steps, is sub-Gaussian with variance proxy v = ||sum of updates||^2
        / (d gamma^2) (the random signs; the sum's norm at most clients * S) + clients / 4 (each rounding) +
        max_participants s^2 (the noise): it leaves [-m/2, m/2) with probability at most 2 exp(-(m/2)^2 / (2
        v)), which over the d coordinates is held at ``WRAP_PROBABILITY``. Raises ValueError (naming the bits)
        when no gamma does it: the roundings alone would wrap."""
        d, m, z, s = padded_dim(self.dim), 2**self.bits, self.noise_multiplier, self.clip_norm
        room = (m / 2) ** 2 / (2 * math.log(2 * d / WRAP_PROBABILITY)) - self.clients / 4
        if room <= 0:
            raise ValueError(f"{self.bits} bits per coordinate: the roundings of {self.clients:g} clients alone may "
                             f"wrap a ring of 2^{self.bits} (more than {WRAP_PROBABILITY:g} a round); raise the bits")
        spread = (self.clients * s) ** 2 / d + self.max_participants * (z * s) ** 2 / self.min_participants
        gamma = math.sqrt(spread / room)
        local = z * s / (gamma * math.sqrt(self.min_participants))
        return Encoding(gamma=gamma, modulus=m, local_sigma=local, bound=rounding_bound(s / gamma, d), dim=self.dim)

    def round_rdp(self) -> np.ndarray:
        """One round's RDP at ``ORDERS``, sampling included."""
        enc, n = self.encoding(), self.min_participants
        d, spread = enc.padded, math.sqrt(n) * enc.local_sigma
        l2 = enc.bound / spread
        l1 = enc.bound * min(math.sqrt(d), enc.bound) / spread  # L1 <= sqrt(d) L2, and <= L2^2 on integers
        return poisson_subsampled_rdp(ORDERS, self.rate, round_rdp(ORDERS, l1, l2, tau(n, enc.local_sigma), d))


@functools.lru_cache(maxsize=4096)
def epsilon(mechanism: DistributedMechanism, rounds: int, delta: float) -> float:
    """Epsilon at ``delta`` after ``rounds`` rounds: 0 before any, infinite without noise."""
    if rounds == 0:
        return 0.0
    if mechanism.noise_multiplier == 0:
        return math.inf
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    return float(compute_epsilon(ORDERS, rounds * mechanism.round_rdp(), delta)[0])


@functools.lru_cache(maxsize=64)
def noise_for_epsilon(mechanism: DistributedMechanism, target_epsilon: float, delta: float, rounds: int) -> float:
    """The least noise multiplier (to a relative 1e-4, on the safe side) whose ``rounds`` rounds spend at most
    ``target_epsilon``, by bisection (epsilon falls as the noise grows). Raises ValueError when even the
    bracket's largest does not reach it: at these bits, the rounding's own sensitivity sets a floor."""
    low, high = NOISE_BRACKET
    most = epsilon(mechanism.with_noise(high), rounds, delta)
    if most > target_epsilon:
        raise ValueError(f"epsilon {target_epsilon:g} at delta {delta:g} over {rounds} rounds is out of reach at "
                         f"{mechanism.bits} bits per coordinate: even a noise multiplier of {high:g} spends {most:.4g} "
                         "(the grid coarsens with the noise, and its rounding has a sensitivity of its own)")
    while high / low > 1 + 1e-4:
        mid = math.sqrt(low * high)
        low, high = (low, mid) if epsilon(mechanism.with_noise(mid), rounds, delta) <= target_epsilon else (mid, high)
    return high
