"""The distributed discrete Gaussian (``server_math.distributed_dp``, ``server_math.distributed_accounting``;
docs/privacy.md, "Distributed DP"): its pieces by hand, its sampler against the pmf, its accountant against
dp_accounting's independent computations, its settings, and from the attacker's side what the secure sum
unmasks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from fedrod_ray.config import ConfigError, config_from_dict
from fedrod_ray.federation_state.dp_rounds import ClientLevelDP
from fedrod_ray.server_math import distributed_accounting as acc
from fedrod_ray.server_math.distributed_dp import (
    BETA,
    Encoding,
    center,
    conditional_round,
    decode,
    discrete_gaussian,
    encode,
    hadamard,
    padded_dim,
    random_signs,
    randomized_round,
    rotate,
    rounding_bound,
    unrotate,
    wrap,
)
from fedrod_ray.server_math.privacy import SecureNoise, SeededNoise

dp_accounting = pytest.importorskip("dp_accounting")
F64 = torch.float64


# --- the pieces ------------------------------------------------------------------------------------------------

def test_hadamard_by_hand_and_orthonormal():
    # Sylvester's H_4 times (1, 2, 3, 4) is (10, -2, -4, 0); over sqrt(4) = 2.
    assert hadamard(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [5.0, -1.0, -2.0, 0.0]
    n = 16
    matrix = torch.stack([hadamard(e) for e in torch.eye(n, dtype=F64)])
    torch.testing.assert_close(matrix @ matrix.T, torch.eye(n, dtype=F64), rtol=0, atol=1e-12)
    torch.testing.assert_close(matrix, matrix.T, rtol=0, atol=0)  # symmetric: its own inverse


def test_rotation_pads_keeps_the_norm_and_inverts():
    assert [padded_dim(d) for d in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    x = torch.randn(5, generator=torch.Generator().manual_seed(0), dtype=F64)
    signs = random_signs(3, 8)
    assert set(signs.tolist()) == {-1.0, 1.0} and signs.equal(random_signs(3, 8))  # shared from the seed
    y = rotate(x, signs)
    assert y.numel() == 8 and float(y.norm()) == pytest.approx(float(x.norm()), rel=1e-12)
    torch.testing.assert_close(unrotate(y, signs, 5), x, rtol=0, atol=1e-12)
    # The random signs spread a spike evenly: every coordinate of H D e_1 is +-1 / sqrt(8).
    spike = rotate(torch.tensor([1.0]), signs)
    torch.testing.assert_close(spike.abs(), torch.full((8,), 8**-0.5, dtype=F64), rtol=0, atol=1e-15)


def test_rounding_bound_by_hand():
    # norm 3, 4 coordinates, beta = e^-1/2 (sqrt(2 log(1 / beta)) = 1): min(3 + 2, sqrt(9 + 1 + (3 + 1))).
    assert BETA == math.exp(-0.5)
    assert rounding_bound(3.0, 4) == pytest.approx(math.sqrt(14), rel=1e-15)
    assert rounding_bound(0.0, 100) == pytest.approx(math.sqrt(25 + 5), rel=1e-15)  # min(10, sqrt(30))


def test_randomized_rounding_is_unbiased_and_the_conditional_one_stays_within_its_bound():
    noise = SeededNoise(0)
    assert conditional_round(torch.tensor([2.0, -3.0]), 10.0, noise).tolist() == [2, -3]  # integers stay
    x = torch.tensor([0.25, -1.5, 2.75, 0.0], dtype=F64) * 3
    free = torch.stack([randomized_round(x, noise) for _ in range(4000)]).to(F64)
    assert ((free - torch.floor(x)) == (free - torch.floor(x)).clamp(0, 1)).all()  # floor or ceil
    torch.testing.assert_close(free.mean(0), x, rtol=0, atol=4 * 0.5 / math.sqrt(4000))  # unbiased: 4 std errors
    bound = rounding_bound(float(x.norm()), 4)
    assert (free.norm(dim=1) > bound).any()  # unconditioned, some roundings exceed the bound...
    draws = torch.stack([conditional_round(x, bound, noise) for _ in range(2000)]).to(F64)
    assert (draws.norm(dim=1) <= bound).all()  # ...conditioned, none does
    with pytest.raises(ValueError, match="clip norm"):
        conditional_round(x * 10, bound, noise)


def test_wrap_and_center_by_hand():
    z = torch.tensor([0, 3, 4, 5, 7, -1, 8, 12])
    assert wrap(z, 8).tolist() == [0, 3, 4, 5, 7, 7, 0, 4]
    assert center(z, 8).tolist() == [0, 3, -4, -3, -1, -1, 0, -4]


def test_discrete_gaussian_mean_and_variance():
    draws = discrete_gaussian(200_000, 10.0, SeededNoise(1)).to(F64)
    assert draws.dtype == F64 and (draws == draws.round()).all()
    # For sigma = 10 the discrete Gaussian's variance is sigma^2 to within 1e-80; the estimates' standard errors
    # are 0.022 (mean) and 0.32 (variance).
    assert abs(float(draws.mean())) < 0.1
    assert float(draws.var()) == pytest.approx(100.0, abs=1.5)
    assert discrete_gaussian(5, 0.0, SeededNoise(1)).tolist() == [0] * 5


def _chi_square_p(draws: torch.Tensor, sigma: float, top: int = 6) -> float:
    """The p-value of the draws' counts of -top..top (the rest lumped in two tails) against N_Z(0, sigma^2)'s pmf."""
    support = np.arange(-60, 61)
    pmf = np.exp(-support**2 / (2 * sigma**2))
    pmf /= pmf.sum()
    values = draws.numpy()
    observed = [np.sum(values < -top)] + [np.sum(values == k) for k in range(-top, top + 1)] + [np.sum(values > top)]
    expected = [pmf[support < -top].sum()] + [pmf[support == k][0] for k in range(-top, top + 1)] + \
        [pmf[support > top].sum()]
    return float(stats.chisquare(observed, np.array(expected) * len(values) / np.sum(expected)).pvalue)


def test_discrete_gaussian_matches_its_pmf_where_a_rounded_gaussian_does_not():
    sigma, n = 1.5, 200_000
    assert _chi_square_p(discrete_gaussian(n, sigma, SeededNoise(2)), sigma) > 1e-3
    # The test can fail: a rounded continuous Gaussian of the same sigma (P(0) = 0.261 against 0.266) is
    # rejected by it at this many draws.
    rounded = torch.round(torch.randn(n, generator=torch.Generator().manual_seed(2), dtype=F64) * sigma)
    assert _chi_square_p(rounded, sigma) < 1e-6


def test_secure_noise_draws_discrete_gaussians_too():
    assert _chi_square_p(discrete_gaussian(50_000, 1.5, SecureNoise()), 1.5) > 1e-4


def test_encode_and_decode_by_hand_without_noise():
    # Two participants, dim 2, signs (1, -1), gamma 1/2, ring 16: x1 is chosen so that rotate(x1) / gamma is
    # (3, -1), x2 so that it is (-2, 5). Their vectors: (3, -1) and (-2, 5) mod 16; the sum (1, 4).
    enc = Encoding(gamma=0.5, modulus=16, local_sigma=0.0, bound=100.0, dim=2)
    signs = torch.tensor([1.0, -1.0], dtype=F64)
    x1, x2 = (unrotate(torch.tensor(k, dtype=F64) * 0.5, signs, 2) for k in ([3.0, -1.0], [-2.0, 5.0]))
    noise = SeededNoise(0)
    v1, v2 = encode([x1], enc, signs, noise), encode([x2], enc, signs, noise)
    assert v1.tolist() == [3, 15] and v2.tolist() == [14, 5]
    total = wrap(v1 + v2, 16)
    assert total.tolist() == [1, 4]
    torch.testing.assert_close(decode(total, enc, signs), x1 + x2, rtol=0, atol=1e-12)
    # A participant's clients are summed after each is rounded: both on one participant give the same sum.
    torch.testing.assert_close(decode(encode([x1, x2], enc, signs, noise), enc, signs), x1 + x2, rtol=0, atol=1e-12)
    # Without a client, a participant sends its noise alone: here none.
    assert encode([], enc, signs, noise).tolist() == [0, 0]


# --- the accountant against dp_accounting ------------------------------------------------------------------------

def _library_epsilon(event, delta: float, orders=None) -> float:
    """dp_accounting's epsilon of ``event`` (at ``orders``: None, its own, fractional ones included)."""
    accountant = dp_accounting.rdp.RdpAccountant(None if orders is None else list(orders))
    return float(accountant.compose(event).get_epsilon(delta))


def test_one_participant_unsampled_is_the_gaussians_zcdp():
    # n = 1: tau = 0, and the discrete Gaussian is (l2^2 / 2)-zCDP (Canonne et al.), the continuous one's RDP: the
    # library's zCDP and Gaussian events give the same curve (at its own orders, fractional ones too).
    l2, d, rounds, delta = 0.7, 1000, 20, 1e-5
    rdp = acc.round_rdp(acc.ORDERS, l2 * math.sqrt(d), l2, 0.0, d)
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon
    ours = float(compute_epsilon(acc.ORDERS, rounds * rdp, delta)[0])
    zcdp = dp_accounting.SelfComposedDpEvent(dp_accounting.ZCDpEvent(l2**2 / 2), rounds)
    gauss = _library_epsilon(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(1 / l2), rounds), delta)
    assert _library_epsilon(zcdp, delta) == pytest.approx(gauss, rel=1e-6)
    assert ours == pytest.approx(_library_epsilon(zcdp, delta, acc.ORDERS), rel=1e-9)  # at the same orders
    assert gauss <= ours <= gauss * 1.05  # at integer orders only: never below, a little above


def test_tau_and_the_sum_of_discrete_gaussians_bound_its_exact_epsilon():
    """One round, one coordinate, three participants of sigma = 0.6 (tau = 0.374, far from negligible), the
    sum moved by 1: the exact epsilon at delta of the sum's pmf (three pmfs convolved) against the same sum
    shifted is within the paper's bound, computed from ``round_rdp``; and the zCDP events of the
    bound's terms, composed by dp_accounting, give the same epsilon as our curve's least term."""
    sigma, n, delta = 0.6, 3, 1e-5
    t = acc.tau(n, sigma)
    assert t == pytest.approx(10 * (math.exp(-2 * math.pi**2 * 0.36 / 2) + math.exp(-2 * math.pi**2 * 0.36 * 2 / 3)))
    support = np.arange(-40, 41)
    one = np.exp(-support**2 / (2 * sigma**2))
    one /= one.sum()
    total = np.convolve(np.convolve(one, one), one)
    shifted = np.concatenate([[0.0], total[:-1]])

    def exact_delta(eps: float) -> float:
        return max(np.maximum(total - math.exp(eps) * shifted, 0).sum(), np.maximum(shifted - math.exp(eps) * total, 0).sum())

    l2 = 1 / (math.sqrt(n) * sigma)
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon
    ours = float(compute_epsilon(acc.ORDERS, acc.round_rdp(acc.ORDERS, l2, l2, t, 1), delta)[0])
    assert exact_delta(ours) <= delta  # the bound holds
    assert exact_delta(ours / 3) > delta  # and is not vacuous: a third of it would not
    terms = [dp_accounting.ZCDpEvent(l2**2 / 2, t), dp_accounting.ZCDpEvent((l2 + t) ** 2 / 2),
             dp_accounting.ZCDpEvent((l2**2 + 2 * l2 * t + t**2) / 2)]
    assert ours <= min(_library_epsilon(e, delta, acc.ORDERS) for e in terms) + 1e-9


@pytest.mark.parametrize(("sigma", "q", "rounds"), [(2.0, 0.1, 50), (1.0, 0.1, 100)])
def test_sampled_rounds_bound_the_sampled_discrete_gaussians_exact_pld(sigma, q, rounds):
    """Poisson sampling's amplification (Zhu and Wang's bound) on one participant's discrete Gaussian, sensitivity
    1, one coordinate: never below dp_accounting's privacy loss distribution of the same sampled discrete
    Gaussian, composed (an upper bound on its exact epsilon, by pessimistic rounding: an amplification that
    undercounted would fall below it), nor below its tight RDP of the sampled continuous Gaussian. Zhu and
    Wang's general bound is looser than the Gaussian's own (up to about 2x at these settings: the price of a
    bound that holds for any mechanism's RDP curve)."""
    delta = 1e-5
    rdp = acc.poisson_subsampled_rdp(acc.ORDERS, q, acc.round_rdp(acc.ORDERS, 1 / sigma, 1 / sigma, 0.0, 1))
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon
    ours = float(compute_epsilon(acc.ORDERS, rounds * rdp, delta)[0])
    pld = dp_accounting.pld.privacy_loss_distribution.from_discrete_gaussian_mechanism(
        sigma, sensitivity=1, sampling_prob=q, value_discretization_interval=1e-4)
    exact = float(pld.self_compose(rounds).get_epsilon_for_delta(delta))
    gauss = _library_epsilon(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), rounds), delta)
    assert exact <= ours and gauss <= ours <= 2 * exact


def test_sampling_never_costs_more_than_no_sampling():
    rdp = acc.round_rdp(acc.ORDERS, 3.0, 0.5, 0.01, 100)
    assert (acc.poisson_subsampled_rdp(acc.ORDERS, 0.05, rdp) <= rdp).all()
    assert acc.poisson_subsampled_rdp(acc.ORDERS, 1.0, rdp).tolist() == rdp.tolist()


def _mechanism(**changes) -> acc.DistributedMechanism:
    base = {"noise_multiplier": 1.0, "clip_norm": 0.5, "rate": 0.1, "clients": 10.0, "min_participants": 3,
            "max_participants": 3, "bits": 16, "dim": 5000}
    return acc.DistributedMechanism(**{**base, **changes})


def test_the_grid_keeps_the_sum_in_the_ring_and_the_noise_at_its_multiplier():
    m = _mechanism()
    enc = m.encoding()
    d = enc.padded
    assert d == 8192 and enc.modulus == 2**16
    # The total noise over n_min participants is z S (in the weights' units); each adds its 1 / n_min share.
    assert enc.local_sigma * enc.gamma * math.sqrt(3) == pytest.approx(1.0 * 0.5, rel=1e-12)
    # The wrap bound by hand: v = (10 * 0.5)^2 / (d gamma^2) + 10 / 4 + 3 s^2 and 2 d exp(-(m/2)^2 / (2 v)) = 1e-6.
    v = 25 / (d * enc.gamma**2) + 2.5 + 3 * enc.local_sigma**2
    assert 2 * d * math.exp(-(2**15) ** 2 / (2 * v)) == pytest.approx(acc.WRAP_PROBABILITY, rel=1e-6)
    assert enc.bound == rounding_bound(0.5 / enc.gamma, d)
    with pytest.raises(ValueError, match="8 bits"):
        _mechanism(bits=8, clients=1e4).encoding()


def test_calibrated_noise_spends_the_target_and_the_bits_set_a_floor():
    m = _mechanism()
    z = acc.noise_for_epsilon(m, 4.0, 1e-5, 30)
    assert acc.epsilon(m.with_noise(z), 30, 1e-5) <= 4.0 < acc.epsilon(m.with_noise(z * 0.999), 30, 1e-5)
    # Above central DP's noise for the same target (the rounding's sensitivity, tau, Zhu and Wang's bound).
    central = dp_accounting.calibrate_dp_mechanism(
        dp_accounting.rdp.RdpAccountant, lambda s: dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(s)), 30), 4.0, 1e-5)
    assert central < z < 1.5 * central
    with pytest.raises(ValueError, match="out of reach at 8 bits"):
        acc.noise_for_epsilon(_mechanism(bits=8, dim=100_000), 0.5, 1e-5, 100)


# --- the settings -------------------------------------------------------------------------------------------------

BASE = {"data": {"dataset": "synthetic", "num_clients": 20}, "train": {"rounds": 4, "client_fraction": 0.5}}
DISTRIBUTED = {"enabled": True, "noise_multiplier": 1.0, "mechanism": "distributed_dgauss", "min_participants": 2}


@pytest.mark.parametrize(("privacy", "field"), [
    ({"enabled": True, "noise_multiplier": 1.0, "bits": 16}, "bits"),
    ({"enabled": True, "noise_multiplier": 1.0, "min_participants": 2}, "min_participants"),
    ({**DISTRIBUTED, "min_participants": None}, "min_participants"),
    ({**DISTRIBUTED, "max_participants": 1}, "max_participants"),
    ({**DISTRIBUTED, "sampling": "fixed"}, "sampling"),
    ({**DISTRIBUTED, "accountant": "pld"}, "accountant"),
    ({**DISTRIBUTED, "adaptive_clip": {"target_quantile": 0.5}}, "adaptive_clip"),
    ({**DISTRIBUTED, "bits": 4}, "bits"),
    ({**DISTRIBUTED, "mechanism": "skellam"}, "mechanism"),
])
def test_distributed_settings_are_checked_naming_the_field(privacy, field):
    with pytest.raises(ConfigError, match=f"privacy.{field}"):
        config_from_dict({**BASE, "privacy": privacy})


def test_too_few_bits_for_the_target_is_a_config_error_naming_them():
    cfg = config_from_dict({**BASE, "privacy": {**DISTRIBUTED, "noise_multiplier": None, "target_epsilon": 0.05,
                                                "bits": 8}})
    with pytest.raises(ConfigError, match="privacy.target_epsilon: .*8 bits"):
        ClientLevelDP(cfg, 20, dim=100_000)


def test_the_distributed_mechanism_runs_only_on_a_secure_sum():
    from fedrod_ray.executors.in_process import InProcessExecutor
    from fedrod_ray.federation_state.setup import make_host, prepare
    from fedrod_ray.round_loop.federation import Federation

    setup = prepare(config_from_dict({**BASE, "privacy": DISTRIBUTED}))
    with pytest.raises(ConfigError, match="privacy.mechanism: distributed_dgauss needs a secure sum"):
        Federation(setup, InProcessExecutor(make_host(setup)), log=lambda line: None)


def test_the_central_accountant_is_unchanged_by_the_distributed_one():
    cfg = config_from_dict({**BASE, "privacy": {"enabled": True, "noise_multiplier": 1.0}})
    dp = ClientLevelDP(cfg, 20, dim=123)
    assert not dp.distributed and dp.encoding is None
    distributed = ClientLevelDP(config_from_dict({**BASE, "privacy": DISTRIBUTED}), 20, dim=123)
    assert distributed.distributed and distributed.encoding.dim == 123
    assert distributed.epsilon(4) > dp.epsilon(4)
    with pytest.raises(ConfigError, match="privacy.mechanism"):  # as a Tune sweep asks, without a model
        ClientLevelDP(config_from_dict({**BASE, "privacy": DISTRIBUTED}), 20)


# --- from the attacker's side ----------------------------------------------------------------------------------

def test_what_the_server_unmasks_is_noised_at_the_configured_scale_and_no_share_is_clean():
    """Four participants (n_min = 3), 3 clients each, clipped updates of norm S: the secure sum that the server
    unmasks, decoded, differs from the exact sum of the clipped updates by noise whose per-coordinate standard
    deviation is sqrt(4 / 3) z S (every participant's share; the rounding's is far smaller), checked against
    the configured sigma by a chi-square interval on the variance. One participant's vector, even if the
    server could unmask it alone, is its clients' sum plus noise of std z S / sqrt(3): never the clean sum."""
    z, s, dim = 0.8, 0.5, 3000
    m = _mechanism(noise_multiplier=z, clip_norm=s, clients=12.0, max_participants=4, dim=dim)
    enc = m.encoding()
    signs = random_signs(11, enc.padded)
    gen = torch.Generator().manual_seed(5)
    updates = [[s * u / u.norm() for u in torch.randn(3, dim, generator=gen, dtype=F64)] for _ in range(4)]
    vectors = [encode(ups, enc, signs, SeededNoise(20 + i)) for i, ups in enumerate(updates)]
    exact = sum(u for ups in updates for u in ups)
    error = decode(wrap(sum(vectors), enc.modulus), enc, signs) - exact
    want = (4 / 3) * (z * s) ** 2 + 12 * enc.gamma**2 / 4  # the noise, and (at most) the roundings' variance
    low, high = (stats.chi2.ppf(p, dim) / dim for p in (1e-4, 1 - 1e-4))
    assert low * want <= float(error.square().mean()) <= high * want
    assert float(error.mean()) == pytest.approx(0.0, abs=6 * math.sqrt(want / dim))
    alone = decode(vectors[0], enc, signs) - sum(updates[0])
    share = (z * s) ** 2 / 3
    assert low * share <= float(alone.square().mean()) <= high * share * 1.01
