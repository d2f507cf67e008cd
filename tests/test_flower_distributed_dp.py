"""Distributed DP through Flower's SecAgg+ (``fedrod_ray_flower.distributed``), without Flower's processes: each
node's ring vector goes through SecAgg+'s own quantization, masking and dequantization functions (as
``secaggplus_mod`` and ``SecAggPlusWorkflow`` call them, with the ranges ``workflow_ranges`` gives), and comes
back as the exact sum mod m; the round's sums are the clipped updates' sum plus the nodes' noise, and what
the server unmasks is noised, checked from the attacker's side against the configured sigma."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flower_federation import require_flower
from scipy import stats

require_flower()

from flwr.common.secure_aggregation.ndarrays_arithmetic import (
    factor_combine,
    factor_extract,
    parameters_addition,
    parameters_mod,
    parameters_multiply,
    parameters_subtraction,
)
from flwr.common.secure_aggregation.quantization import dequantize, quantize
from fedrod_ray_flower import distributed

from fedrod_ray.client_update.local import LocalResult
from fedrod_ray.config import ConfigError, config_from_dict
from fedrod_ray.server_math.distributed_accounting import DistributedMechanism
from fedrod_ray.server_math.distributed_dp import DistributedRound

F64 = torch.float64


def secagg_mean(vectors: list[np.ndarray], dround: DistributedRound, seed: int = 0) -> np.ndarray:
    """What SecAggPlusWorkflow hands the strategy for ``vectors`` (weight 1 = max_weight each), computed with
    Flower's own functions in the order secaggplus_mod and the workflow apply them: scaled by q_ratio / T,
    quantized, the factor prepended, masked, summed mod m, unmasked, the factor extracted, dequantized, offset
    by the nodes' clipping ranges and divided by the summed factor."""
    c, t, m = distributed.workflow_ranges(dround)
    rng = np.random.default_rng(seed)
    masked, masks = [], []
    for v in vectors:
        q_ratio = round(1.0 * t)
        quantized = factor_combine(q_ratio, quantize(parameters_multiply([v], q_ratio / t), c, t))
        mask = [rng.integers(0, m, a.shape, dtype=np.int64) for a in quantized]  # SecAgg+'s private mask
        masks.append(mask)
        masked.append(parameters_mod(parameters_addition(quantized, mask), m))
    total = masked[0]
    for v in masked[1:]:
        total = parameters_addition(total, v)
    for mask in masks:
        total = parameters_subtraction(total, mask)
    q_total, parts = factor_extract(parameters_mod(total, m))
    (mean,) = dequantize(parts, c, t)
    return (mean - (len(vectors) - 1) * c) * (t / q_total)


def result(update: torch.Tensor, anchor: torch.Tensor, n: int, loss: float) -> LocalResult:
    return LocalResult(shared={"w": anchor + update.view(anchor.shape)}, num_samples=n, loss=loss, personal_loss=None,
                       steps=1, seconds=0.0, upload={}, clipped=True)


def mechanism(z: float, dim: int, bits: int = 16) -> DistributedRound:
    m = DistributedMechanism(noise_multiplier=z, clip_norm=0.5, rate=0.1, clients=6.0, min_participants=2,
                             max_participants=3, bits=bits, dim=dim)
    return DistributedRound(m.encoding(), rotation_seed=5, noise_seed=11)


@pytest.mark.parametrize("nodes", [1, 3])
def test_secaggs_arithmetic_carries_the_ring_exactly(nodes):
    dround = mechanism(1.0, 40)
    m = dround.encoding.modulus
    gen = np.random.default_rng(nodes)
    rings = [gen.integers(0, m, 64 + distributed.LOSSES) for _ in range(nodes)]
    vectors = [r.astype(np.float64) - (m - 1) / 2 for r in rings]  # what node_vector hands SecAgg+
    got = distributed.ring_total(secagg_mean(vectors, dround), nodes, dround)
    assert got.tolist() == (sum(rings) % m).tolist()


def test_the_round_sums_are_the_clipped_sum_noised_at_the_configured_scale_and_one_node_is_noised():
    """Three nodes, two clients each, every update clipped to S = 0.5: the round's clipped sum (less the
    anchor) is the updates' exact sum plus noise of std sqrt(3 / 2) z S (three nodes' shares of n_min = 2),
    the losses come back, and a node's vector alone decodes to its clients' sum plus noise of std z S / sqrt(2)."""
    z, dim = 0.8, 2000
    dround = mechanism(z, dim)
    anchor = {"w": torch.zeros(40, 50, dtype=torch.float32)}
    gen = torch.Generator().manual_seed(0)
    updates = [[0.5 * u / u.norm() for u in torch.randn(2, dim, generator=gen, dtype=F64)] for _ in range(3)]
    results = [[result(u.float().double(), anchor["w"], 10, 0.25 * (i + 1)) for u in ups]
               for i, ups in enumerate(updates)]
    head = {"distributed": distributed.to_header(dround, 3), "scales": [0.0, 60.0, 6.0], "clipping_range": 8.0}
    vectors = [distributed.node_vector_for(head, rs, anchor, ["w"], first_client=10 * i) for i, rs in enumerate(results)]
    total = distributed.ring_total(secagg_mean(vectors, dround), 3, dround)
    sums, losses = distributed.round_sums(total, ["w"], anchor, dround, done=6, samples=60.0, done_samples=60.0,
                                          clipping_range=8.0, participants=3, has_personal_loss=False)
    exact = sum(r.shared["w"].double().reshape(-1) for rs in results for r in rs)
    error = sums.clipped.total["w"].reshape(-1) - exact
    enc = dround.encoding
    want = 1.5 * (z * 0.5) ** 2 + 6 * enc.gamma**2 / 4  # the nodes' noise, and at most the roundings'
    low, high = (stats.chi2.ppf(p, dim) / dim for p in (1e-4, 1 - 1e-4))
    assert low * want <= float(error.square().mean()) <= high * want
    assert sums.clipped.count == 6 and sums.clipped.weight == 6.0
    assert losses.train_loss == pytest.approx((0.25 + 0.5 + 0.75) / 3, abs=1e-3)
    # One node's vector, as the server would read it could it unmask it alone: noised at its own share.
    ring = torch.from_numpy(np.rint(vectors[0] + (enc.modulus - 1) / 2)).to(torch.int64)
    alone = distributed.round_sums(ring, ["w"], anchor, dround, 2, 60.0, 20.0, 8.0, 3, False)[0]
    own = alone.clipped.total["w"].reshape(-1) - sum(r.shared["w"].double().reshape(-1) for r in results[0])
    share = (z * 0.5) ** 2 / 2
    assert low * share <= float(own.square().mean()) <= high * share * 1.01


def test_a_sum_that_may_hold_fewer_nodes_than_the_accountant_assumed_is_refused():
    cfg = config_from_dict({"data": {"dataset": "synthetic", "num_clients": 6},
                            "privacy": {"enabled": True, "noise_multiplier": 1.0, "mechanism": "distributed_dgauss",
                                        "min_participants": 3}})
    with pytest.raises(ConfigError, match="privacy.min_participants"):
        distributed.check_settings(cfg, reconstruction_threshold=2)
    distributed.check_settings(cfg, reconstruction_threshold=3)
    assert math.isfinite(mechanism(1.0, 10).encoding.gamma)
