"""A round's server step from its sums (``round_loop.round_sums``), by hand on tiny tensors: what the round
loop computes from each client's result and what a secure aggregation computes from the totals alone."""

from __future__ import annotations

import pytest
import torch

from fedrod_ray.algorithms import build_rule
from fedrod_ray.config import config_from_dict
from fedrod_ray.federation_state.dp_rounds import ClientLevelDP
from fedrod_ray.round_loop.round_sums import RoundSums, shared_update
from fedrod_ray.server_math.aggregate import OrderedAverager, WeightedSum

F32, F64 = torch.float32, torch.float64
NONE = WeightedSum(None, 0.0, 0)


def summed(total: dict, weight: float, count: int, dtype=F32) -> WeightedSum:
    return WeightedSum({k: torch.tensor(v, dtype=F64) for k, v in total.items()}, weight, count,
                       dict.fromkeys(total, dtype))


def test_a_weighted_sum_is_what_the_ordered_averager_folds():
    averager = OrderedAverager(3)
    averager.add(2, {"w": torch.tensor([3.0, 6.0])}, 3.0)
    averager.skip(1)
    averager.add(0, {"w": torch.tensor([1.0, 2.0])}, 1.0)
    s = averager.sum()
    # 1 * [1, 2] + 3 * [3, 6] = [10, 20] over weight 4, two states
    assert s.total["w"].dtype == F64 and s.total["w"].tolist() == [10.0, 20.0]
    assert (s.weight, s.count, s.dtypes) == (4.0, 2, {"w": F32})
    assert s.mean()["w"].dtype == F32 and s.mean()["w"].tolist() == [2.5, 5.0]
    with pytest.raises(RuntimeError, match="no results"):
        NONE.mean()


def test_fedavg_takes_the_means_theta_psi_by_the_rules_weight_and_nu_by_samples():
    # Two clients: theta w = [1, 2] and [3, 6] at sample counts 1 and 3; nu = [1] and [5].
    sums = RoundSums(summed({"w": [10.0, 20.0]}, 4.0, 2), summed({"nu": [16.0]}, 4.0, 2), WeightedSum({}, 2.0, 2),
                     NONE)
    previous = {"w": torch.zeros(2), "nu": torch.zeros(1)}
    out = shared_update(sums, previous, {"w"}, build_rule("fedavg"), {}, 10, None, {}, 0)
    assert out.weights["w"].tolist() == [2.5, 5.0] and out.weights["nu"].tolist() == [4.0]
    assert out.weights["w"].dtype == F32 and out.server_state == {} and out.privacy_state == {}


def test_scaffold_moves_c_by_the_participants_share_of_the_mean_upload():
    # Uploads delta_m sum to [2, -4] over 2 participants: mean [1, -2]; c <- c + (2 / 4) * mean.
    sums = RoundSums(summed({"w": [4.0]}, 2.0, 2), WeightedSum({}, 2.0, 2), summed({"w": [2.0, -4.0]}, 2.0, 2), NONE)
    c = {"w": torch.tensor([0.5, 0.5])}
    out = shared_update(sums, {"w": torch.zeros(1)}, {"w"}, build_rule("scaffold"), c, 4, None, {}, 0)
    assert out.weights["w"].tolist() == [2.0]
    assert out.server_state["w"].tolist() == [1.0, -0.5]


def test_feddyn_steps_h_by_the_plain_mean():
    # Plain mean [3] (weight 1 each) from previous [1]; alpha 0.5, 2 of 4 clients:
    # h = 0 - 0.5 * (2/4) * (3 - 1) = -0.5; w = 3 - h / alpha = 3 + 1 = 4.
    sums = RoundSums(summed({"w": [6.0]}, 2.0, 2), WeightedSum({}, 2.0, 2), WeightedSum({}, 2.0, 2), NONE)
    rule = build_rule("feddyn", {"alpha": 0.5})
    out = shared_update(sums, {"w": torch.tensor([1.0])}, {"w"}, rule, {"w": torch.zeros(1)}, 4, None, {}, 0)
    assert out.server_state["w"].tolist() == [-0.5] and out.weights["w"].tolist() == [4.0]


def test_client_level_dp_divides_the_clipped_sum_by_the_expected_number():
    # 8 clients, 4 a round (fixed sampling), no noise. Two participants' anchor + clip(Delta): [1.5, 1] and
    # [1, 0.5] around the anchor [1, 1]: (total + (4 - 2) * anchor) / 4 = ([2.5, 1.5] + [2, 2]) / 4.
    cfg = config_from_dict({"data": {"dataset": "synthetic", "num_clients": 8},
                            "train": {"rounds": 2, "client_fraction": 0.5},
                            "privacy": {"enabled": True, "noise_multiplier": 0.0, "clip_norm": 1.0,
                                        "sampling": "fixed", "noise_seed": 0}})
    dp = ClientLevelDP(cfg, 8)
    sums = RoundSums(NONE, NONE, NONE, summed({"w": [2.5, 1.5]}, 2.0, 2), unclipped=1)
    out = shared_update(sums, {"w": torch.ones(2)}, {"w"}, build_rule("fedavg"), {}, 8, dp, {}, 0)
    assert out.weights["w"].tolist() == [1.125, 0.875] and out.privacy_state == {}
    # A round without any participant: the weights stay (no noise), whatever the rule.
    empty = shared_update(RoundSums(NONE, NONE, NONE, NONE), {"w": torch.ones(2)}, {"w"}, build_rule("fedavg"), {},
                          8, dp, {}, 1)
    assert empty.weights["w"].tolist() == [1.0, 1.0]
