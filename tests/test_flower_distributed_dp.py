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

import test_flower
import yaml
from fedrod_ray_flower import distributed
from flwr.common.secure_aggregation.ndarrays_arithmetic import (
    factor_combine,
    factor_extract,
    parameters_addition,
    parameters_mod,
    parameters_multiply,
    parameters_subtraction,
)
from flwr.common.secure_aggregation.quantization import dequantize, quantize
from safetensors.torch import load_file
from test_flower import records, write_config

from fedrod_ray.client_update.local import LocalResult
from fedrod_ray.config import ConfigError, config_from_dict, load_config
from fedrod_ray.federation_state.dp_rounds import ClientLevelDP
from fedrod_ray.federation_state.setup import prepare
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
    rings = [gen.integers(0, m, 70) for _ in range(nodes)]
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
    head = {"distributed": distributed.to_header(dround, 3), "scales": [0.0, 60.0, 6.0]}
    vectors = [distributed.node_vector_for(head, rs, anchor, ["w"], first_client=10 * i) for i, rs in enumerate(results)]
    total = distributed.ring_total(secagg_mean(vectors, dround), 3, dround)
    sums, losses = distributed.round_sums(total, ["w"], anchor, dround, done=6, samples=60.0, done_samples=60.0,
                                          participants=3, has_personal_loss=False)
    exact = sum(r.shared["w"].double().reshape(-1) for rs in results for r in rs)
    error = sums.clipped.total["w"].reshape(-1) - exact
    enc = dround.encoding
    want = 1.5 * (z * 0.5) ** 2 + 6 * enc.gamma**2 / 4  # the nodes' noise, and at most the roundings'
    low, high = (stats.chi2.ppf(p, dim) / dim for p in (1e-4, 1 - 1e-4))
    assert low * want <= float(error.square().mean()) <= high * want
    assert sums.clipped.count == 6 and sums.clipped.weight == 6.0
    assert losses.train_loss == pytest.approx((0.25 + 0.5 + 0.75) / 3, abs=1e-6)  # to 2^-20
    # One node's vector, as the server would read it could it unmask it alone: noised at its own share.
    ring = torch.from_numpy(np.rint(vectors[0] + (enc.modulus - 1) / 2)).to(torch.int64)
    alone = distributed.round_sums(ring, ["w"], anchor, dround, 2, 60.0, 20.0, 3, False)[0]
    own = alone.clipped.total["w"].reshape(-1) - sum(r.shared["w"].double().reshape(-1) for r in results[0])
    share = (z * 0.5) ** 2 / 2
    assert low * share <= float(own.square().mean()) <= high * share * 1.01


@pytest.mark.parametrize("bits", [8, 16])
def test_the_losses_travel_as_digits_that_never_carry(bits):
    dround = mechanism(0.0, 3, bits=bits)
    anchor = {"w": torch.zeros(3)}
    nodes = [[LocalResult(shared={"w": torch.zeros(3)}, num_samples=n, loss=loss, personal_loss=0.7, steps=1,
                          seconds=0.0, upload={}, clipped=False)] for n, loss in ((10, 1234.5), (30, 8.77), (20, 0.0))]
    head = {"distributed": distributed.to_header(dround, 3), "scales": [0.0, 60.0, 3.0]}
    vectors = [distributed.node_vector_for(head, rs, anchor, ["w"], first_client=i) for i, rs in enumerate(nodes)]
    total = distributed.ring_total(secagg_mean(vectors, dround), 3, dround)
    _, losses = distributed.round_sums(total, ["w"], anchor, dround, 3, 60.0, 60.0, 3, True)
    assert losses.train_loss == pytest.approx((10 * 1234.5 + 30 * 8.77) / 60, abs=1e-5)
    assert losses.personal_loss == pytest.approx(0.7, abs=1e-5)


def test_a_sum_that_may_hold_fewer_nodes_than_the_accountant_assumed_is_refused():
    cfg = config_from_dict({"data": {"dataset": "synthetic", "num_clients": 6},
                            "privacy": {"enabled": True, "noise_multiplier": 1.0, "mechanism": "distributed_dgauss",
                                        "min_participants": 3}})
    with pytest.raises(ConfigError, match="privacy.min_participants"):
        distributed.check_settings(cfg, reconstruction_threshold=2)
    distributed.check_settings(cfg, reconstruction_threshold=3)
    assert math.isfinite(mechanism(1.0, 10).encoding.gamma)


# --- with Flower's processes: a SuperLink and three SuperNodes (tests/test_flower.py's fixtures) -------------

federation, nodes, in_process = test_flower.federation, test_flower.nodes, test_flower.in_process
SECAGG = ("secure-aggregation=true secagg-num-shares=3 secagg-reconstruction-threshold=2 "
          "secagg-clipping-range=8.0 secagg-quantization-range=1048576")
Z, CLIP = 0.5, 1.0


@pytest.fixture(scope="module")
def configs(tmp_path_factory, shared_data_dir) -> dict:
    """tests/test_flower.py's hyper config (whose clients ``nodes`` splits), for one round without evaluation,
    under the distributed mechanism (noise multiplier Z over n_min = 2 of at most 3 nodes) and, for the exact
    clipped mean, under the central one without noise: the same seeded Poisson sample in both."""
    folder = tmp_path_factory.mktemp("ddg-configs")
    out = {"hyper": write_config(folder, shared_data_dir, "hyper", head="hyper")}
    for name, privacy in (("ddg", {"noise_multiplier": Z, "mechanism": "distributed_dgauss", "min_participants": 2,
                                   "max_participants": 3, "bits": 20}),
                          ("exact", {"noise_multiplier": 0.0})):
        path = write_config(folder, shared_data_dir, name, evaluate=False, head="hyper", rounds=1)
        path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "privacy": {
            "enabled": True, "clip_norm": CLIP, "sampling": "poisson", "noise_seed": 3, **privacy}}))
        out[name] = path
    return out


@pytest.mark.slow
def test_the_server_unmasks_the_clipped_mean_noised_at_the_configured_scale(federation, configs, in_process, tmp_path):
    """From the server's side of a real SecAgg+ round: the weights it makes from what it unmasked differ from the
    exact clipped mean (the noise-free central run on the same sample) by the three nodes' noise over the
    expected participants E, per coordinate of std sqrt(3 / 2) Z S / E, checked against it by a chi-square
    interval; and the record's epsilon is the distributed accountant's."""
    run_dir = tmp_path / "ddg"
    federation.run(configs["ddg"], run_dir, extra=SECAGG)
    (got,), (want,) = records(run_dir), records(in_process("exact"))
    assert got["clients_done"] == want["clients_done"] > 0
    cfg = load_config(configs["ddg"])
    setup = prepare(cfg)
    model = setup.build_model()
    shared = {k: v for k, v in model.state_dict().items() if k in set(model.shared_keys())}
    dp = ClientLevelDP(cfg, setup.num_clients, sum(v.numel() for v in shared.values()))
    assert got["dp_epsilon"] == pytest.approx(dp.epsilon(1), rel=1e-12)
    a = load_file(str(run_dir / "final" / "model.safetensors"))
    b = load_file(str(in_process("exact") / "final" / "model.safetensors"))
    error = torch.cat([(a[k].double() - b[k].double()).reshape(-1) for k in shared])
    expected = dp.expected
    enc = dp.encoding
    want_var = (1.5 * (Z * CLIP) ** 2 + got["clients_done"] * enc.gamma**2 / 4) / expected**2
    n = error.numel()
    low, high = (stats.chi2.ppf(p, n) / n for p in (1e-4, 1 - 1e-4))
    assert low * want_var * 0.999 <= float(error.square().mean()) <= high * want_var * 1.001
