"""Which clients train in a round (docs/method.md, "One round", step 1). How their results become the new
global weights is the generic rule's (``fedrod_ray.algorithms``)."""

from __future__ import annotations

import numpy as np

SAMPLE_TAG = 2
POISSON_TAG = 5


def clients_per_round(num_clients: int, fraction: float) -> int:
    return max(1, min(num_clients, int(fraction * num_clients + 0.5)))


def sample_clients(seed: int, round_idx: int, num_clients: int, fraction: float) -> list[int]:
    """The round's clients, sorted; a function of (seed, round) only, so timing and restarts never change it."""
    rng = np.random.default_rng([seed, round_idx, SAMPLE_TAG])
    chosen = rng.choice(num_clients, size=clients_per_round(num_clients, fraction), replace=False)
    return sorted(int(c) for c in chosen)


def poisson_sample(seed: int, round_idx: int, num_clients: int, rate: float) -> list[int]:
    """The round's clients under Poisson sampling (client-level DP, ``privacy.sampling: poisson``): each joins
    independently with probability ``rate``, so a round may have any number of them, none included. Sorted;
    a function of (seed, round) only."""
    rng = np.random.default_rng([seed, round_idx, POISSON_TAG])
    return [int(c) for c in np.flatnonzero(rng.random(num_clients) < rate)]
