"""The privacy accountant of client-level DP: epsilon at the run's delta after r rounds, from Google's
``dp_accounting`` library (``pip install "fedrod-ray[privacy]"``), never from formulas of our own.

One round is a Gaussian mechanism (noise std sigma S) on the clients sampled for it: Poisson sampling at
rate q (``PoissonSampledDpEvent``, add-or-remove-one neighbours: the sum moves by at most S, multiplier
sigma; RDP or PLD) or a fixed number of them without replacement (``SampledWithoutReplacementDpEvent``,
replace-one neighbours: replacing a client's update u by u' moves the sum by ||u - u'|| <= 2S, so the
Gaussian's multiplier over that sensitivity is sigma / 2; RDP only). r rounds compose (``SelfComposedDpEvent``). Epsilon after r rounds is a function of r
alone, computed afresh from a new accountant, so a resumed run reports exactly the uninterrupted run's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from dataclasses import dataclass

NOISE_BRACKET = (1e-3, 1e3)  # the noise multipliers a target epsilon is searched between
PLD_LEAST_NOISE = 0.25  # PLD's search goes no lower (about 0.3 GiB at q = 0.1 and 100 rounds; 1e-3: 38 GiB)


def _library():
    try:
        import dp_accounting
    except ImportError:
        raise ImportError("privacy.enabled needs Google's dp-accounting library: pip install "
                          "'fedrod-ray[privacy]' (or pip install dp-accounting)") from None
    return dp_accounting


@dataclass(frozen=True)
class Mechanism:
    """One round as the accountant sees it: noise ``noise_multiplier`` on the updates of clients sampled by
    ``sampling`` (poisson: each with probability ``rate``; fixed: ``rate * num_clients`` of them)."""

    noise_multiplier: float
    sampling: str  # "poisson" | "fixed"
    num_clients: int
    rate: float
    accountant: str = "rdp"  # "rdp" | "pld"

    def event(self, rounds: int):
        dp = _library()
        if self.sampling == "poisson":
            sampled = dp.PoissonSampledDpEvent(self.rate, dp.GaussianDpEvent(self.noise_multiplier))
        else:
            # The library's noise multiplier is over the sensitivity under its neighbouring relation: replace-one's
            # is 2S, twice add-or-remove's.
            size = round(self.rate * self.num_clients)
            sampled = dp.SampledWithoutReplacementDpEvent(self.num_clients, size,
                                                          dp.GaussianDpEvent(self.noise_multiplier / 2))
        return dp.SelfComposedDpEvent(sampled, rounds)

    def new_accountant(self):
        dp = _library()
        if self.accountant == "pld":
            return dp.pld.PLDAccountant()
        relation = dp.NeighboringRelation.ADD_OR_REMOVE_ONE if self.sampling == "poisson" else \
            dp.NeighboringRelation.REPLACE_ONE
        return dp.rdp.RdpAccountant(neighboring_relation=relation)

    def with_noise(self, noise_multiplier: float) -> Mechanism:
        return dataclasses.replace(self, noise_multiplier=noise_multiplier)


def composed_epsilon(runs: list[tuple[Mechanism, int]], delta: float) -> float:
    """Epsilon at ``delta`` of several runs on the same clients (a sweep's trials): every run's ``rounds``
    rounds of its mechanism composed on one accountant, of their kind (they must share sampling and
    accountant). 0 without any round; infinite where a run that trained had no noise."""
    runs = [(m, r) for m, r in runs if r > 0]
    if not runs:
        return 0.0
    if any(m.noise_multiplier == 0 for m, _ in runs):
        return math.inf
    kinds = {(m.sampling, m.accountant) for m, _ in runs}
    if len(kinds) > 1:
        raise ValueError(f"runs of different sampling or accountants do not compose on one accountant: {sorted(kinds)}")
    dp = _library()
    with _quiet_orders():
        event = dp.ComposedDpEvent([m.event(r) for m, r in runs])
        return float(runs[0][0].new_accountant().compose(event).get_epsilon(delta))


@functools.lru_cache(maxsize=4096)
def epsilon(mechanism: Mechanism, rounds: int, delta: float) -> float:
    """Epsilon at ``delta`` after ``rounds`` rounds of ``mechanism``: 0 before any, infinite without noise."""
    if rounds == 0:
        return 0.0
    if mechanism.noise_multiplier == 0:
        return math.inf
    with _quiet_orders():
        return float(mechanism.new_accountant().compose(mechanism.event(rounds)).get_epsilon(delta))


def rounds_within(mechanism, target_epsilon: float, delta: float, rounds: int, spent=None) -> int:
    """The most rounds, up to ``rounds``, whose epsilon is within ``target_epsilon`` (by bisection: epsilon
    grows with the rounds); ``spent(mechanism, rounds, delta)`` is the epsilon (None: this module's)."""
    spent = spent or epsilon
    low, high = 0, rounds
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if spent(mechanism, mid, delta) <= target_epsilon else (low, mid - 1)
    return low


@functools.lru_cache(maxsize=64)
def noise_for_epsilon(mechanism: Mechanism, target_epsilon: float, delta: float, rounds: int) -> float:
    """The smallest noise multiplier (to 1e-4) with which ``rounds`` rounds of ``mechanism`` spend at most
    ``target_epsilon`` at ``delta``: the library's calibration (Brent's method on its own accountant), which
    returns a value on the safe side of the target. ``mechanism``'s own noise multiplier is not read.

    PLD's memory grows as the noise shrinks (about 1/sigma^2: 38 GiB at 1e-3), so its search is bounded by
    RDP's answer, an upper bound on the noise PLD needs, and half of it, which PLD is far from ever needing;
    a target whose RDP noise is below ``PLD_LEAST_NOISE`` is refused rather than searched.

    Raises ValueError when no noise multiplier in ``NOISE_BRACKET`` reaches the target, or PLD's search would
    go where it is costly."""
    low, high = NOISE_BRACKET
    most = epsilon(mechanism.with_noise(high), rounds, delta)
    if most > target_epsilon:
        raise ValueError(f"epsilon {target_epsilon:g} at delta {delta:g} over {rounds} rounds is out of reach: "
                         f"even a noise multiplier of {high:g} spends {most:.4g}")
    if mechanism.accountant == "rdp":
        return _calibrate(mechanism, target_epsilon, delta, rounds, low, high)
    rdp = _calibrate(dataclasses.replace(mechanism, accountant="rdp"), target_epsilon, delta, rounds, low, high)
    low = rdp / 2
    if low < PLD_LEAST_NOISE or epsilon(mechanism.with_noise(low), rounds, delta) <= target_epsilon:
        raise ValueError(f"epsilon {target_epsilon:g} at delta {delta:g} over {rounds} rounds needs a noise "
                         f"multiplier of about {rdp:.3g} (RDP), below where privacy.accountant=pld can search "
                         f"({2 * PLD_LEAST_NOISE:g}) within its memory; use privacy.accountant=rdp")
    if epsilon(mechanism.with_noise(rdp), rounds, delta) > target_epsilon:
        rdp = high  # PLD is the tighter: never so far, but the bracket must hold the answer
    return _calibrate(mechanism, target_epsilon, delta, rounds, low, rdp)


def _calibrate(mechanism: Mechanism, target_epsilon: float, delta: float, rounds: int, low: float,
               high: float) -> float:
    dp = _library()
    with _quiet_orders():
        return float(dp.calibrate_dp_mechanism(
            mechanism.new_accountant, lambda sigma: mechanism.with_noise(sigma).event(rounds), target_epsilon,
            delta, dp.mechanism_calibration.ExplicitBracketInterval(low, high), tol=1e-4))


@contextlib.contextmanager
def _quiet_orders():
    """dp_accounting's RDP accountant warns, through absl's logger, of each fractional order whose series does
    not converge, and leaves that order out (which only loosens the bound): not news for every round."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
