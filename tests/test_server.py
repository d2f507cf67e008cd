"""Client sampling and the server's update rule (FEDROD.md, "One round", steps 1 and 4)."""

from __future__ import annotations

import pytest
import torch

from fedrod_ray.config import TrainConfig
from fedrod_ray.server import clients_per_round, sample_clients, server_update


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


def _states():
    prev = {"body.w": torch.tensor([1.0, 2.0]), "generic_head.weight": torch.tensor([[0.0, 4.0]]),
            "hypernet.net.0.weight": torch.tensor([1.0])}
    avg = {"body.w": torch.tensor([2.0, 0.0]), "generic_head.weight": torch.tensor([[1.0, 3.0]]),
           "hypernet.net.0.weight": torch.tensor([5.0])}
    return prev, avg, ["body.w", "generic_head.weight"]


@pytest.mark.parametrize("rule", ["fedavg", "fedprox"])
def test_fedavg_and_fedprox_take_the_average(rule):
    prev, avg, keys = _states()
    new, h = server_update(TrainConfig(generic_rule=rule), prev, avg, keys, 2, 4, None)
    assert h is None
    assert set(new) == set(avg)
    for k in avg:
        assert torch.equal(new[k], avg[k])


def test_feddyn_by_hand():
    prev, avg, keys = _states()
    cfg = TrainConfig(generic_rule="feddyn", feddyn_alpha=0.5)
    new, h = server_update(cfg, prev, avg, keys, 2, 4, None)
    # h = 0 - 0.5 * (2/4) * (avg - prev);  new = avg - h / 0.5
    assert torch.allclose(h["body.w"], torch.tensor([-0.25, 0.5]))
    assert torch.allclose(h["generic_head.weight"], torch.tensor([[-0.25, 0.25]]))
    assert torch.allclose(new["body.w"], torch.tensor([2.5, -1.0]))
    assert torch.allclose(new["generic_head.weight"], torch.tensor([[1.5, 2.5]]))
    # the hypernetwork is not a generic parameter: averaged as is, no server state
    assert torch.equal(new["hypernet.net.0.weight"], avg["hypernet.net.0.weight"])
    assert set(h) == set(keys)

    # a second round with the carried state: h2 = h - 0.25 * (avg2 - prev2)
    prev2 = new
    avg2 = {k: v + 1.0 for k, v in new.items()}
    new2, h2 = server_update(cfg, prev2, avg2, keys, 2, 4, h)
    assert torch.allclose(h2["body.w"], torch.tensor([-0.5, 0.25]))
    assert torch.allclose(new2["body.w"], avg2["body.w"] - h2["body.w"] / 0.5)
    # inputs are not modified
    assert torch.allclose(h["body.w"], torch.tensor([-0.25, 0.5]))
    assert torch.equal(avg["body.w"], torch.tensor([2.0, 0.0]))
