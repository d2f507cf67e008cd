"""Client sampling (docs/method.md, "One round", step 1). The server updates are the rules': test_algorithms.py."""

from __future__ import annotations

import pytest

from fedrod_ray.server_math.server import clients_per_round, sample_clients


@pytest.mark.parametrize(("num_clients", "fraction"), [(100, 0.2), (20, 0.4), (10, 0.01), (7, 0.3), (3, 1.0)])
def test_sample_clients_count_sorted_unique(num_clients, fraction):
    expected = max(1, round(fraction * num_clients))
    assert clients_per_round(num_clients, fraction) == expected
    for r in range(5):
        chosen = sample_clients(0, r, num_clients, fraction)
        assert len(chosen) == expected
        assert chosen == sorted(chosen)
        assert len(set(chosen)) == expected
        assert all(isinstance(c, int) and 0 <= c < num_clients for c in chosen)


def test_clients_per_round_rounds_halves_up():
    assert clients_per_round(5, 0.5) == 3
    assert clients_per_round(10, 0.25) == 3
    assert clients_per_round(100, 0.001) == 1


def test_sample_clients_deterministic_and_varies():
    a = [sample_clients(3, r, 100, 0.2) for r in range(10)]
    b = [sample_clients(3, r, 100, 0.2) for r in range(10)]
    assert a == b
    assert len({tuple(s) for s in a}) == 10  # every round differs
    assert sample_clients(4, 0, 100, 0.2) != a[0]  # and the seed matters
    # the full fraction picks everyone
    assert sample_clients(3, 0, 20, 1.0) == list(range(20))
