"""Which clients train in a round (docs/method.md, "One round", step 1). How their results become the new
global weights is the generic rule's (``fedrod_ray.algorithms``)."""

from __future__ import annotations

import random

import numpy as np

SAMPLE_TAG = 2
POISSON_TAG = 5


def clients_per_round(num_clients: int, fraction: float) -> int:
    return max(1, min(num_clients, int(fraction * num_clients + 0.5)))


def sample_clients(seed: int, round_idx: int, num_clients: int, fraction: float) -> list[int]:
    """The round's clients, sorted; a function of (seed, round) only, so timing and restarts never change it."""
    return sample_count(seed, round_idx, num_clients, clients_per_round(num_clients, fraction))


def sample_count(seed: int, round_idx: int, num_clients: int, count: int) -> list[int]:
    """``count`` of the clients for round ``round_idx``, sorted (``rounds.mode: deadline`` over-selects)."""
    rng = np.random.default_rng([seed, round_idx, SAMPLE_TAG])
    return sorted(int(c) for c in rng.choice(num_clients, size=count, replace=False))


def poisson_sample(seed: int, round_idx: int, num_clients: int, rate: float) -> list[int]:
    """The round's clients under Poisson sampling (client-level DP, ``privacy.sampling: poisson``): each joins
    independently with probability ``rate``, so a round may have any number of them, none included. Sorted;
    a function of (seed, round) only."""
    rng = np.random.default_rng([seed, round_idx, POISSON_TAG])
    return [int(c) for c in np.flatnonzero(rng.random(num_clients) < rate)]


def secure_sample(num_clients: int, count: int) -> list[int]:
    """``count`` of the clients, sorted, drawn from the OS's CSPRNG (``random.SystemRandom``): a private run's
    fixed-size draw, which no seed reproduces, so that who took part stays unknown to whoever knows it."""
    return sorted(random.SystemRandom().sample(range(num_clients), count))


def secure_poisson_sample(num_clients: int, rate: float) -> list[int]:
    """Poisson sampling at ``rate`` (as ``poisson_sample``), each client's draw a 53-bit uniform from the OS's
    CSPRNG. Sorted."""
    rng = random.SystemRandom()
    return [c for c in range(num_clients) if rng.random() < rate]
