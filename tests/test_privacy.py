"""Client-level differential privacy (docs/privacy.md): clipping and the server step by hand, the noise's
standard deviation, the accountant against dp_accounting and a published setting, sigma from a target epsilon,
the run against the non-private one, resume, the budget's stop, what is refused, and final/ and the HTTP
model info stating the guarantee, Tune's sweeps. The Ray path's clipping is in tests/test_ray_runtime.py, the
privacy-utility table's rows in tests/test_reproduce.py."""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import shutil
from pathlib import Path

import dp_accounting
import pytest
import torch
from fastapi.testclient import TestClient
from fedrod_ray_api.app import create_app
from fedrod_ray_tune.repro_spec import build_spec, load_spec
from fedrod_ray_tune.space import load_sweep
from fedrod_ray_tune.spend import check_budget, most_spent, spent
from fedrod_ray_tune.sweep import write_results

from fedrod_ray.algorithms.fedavg import FedAvg
from fedrod_ray.client_update.local import LocalResult, LocalTrainingError, RoundInput, derived_seed
from fedrod_ray.clients.client import ClientFailure, clipped
from fedrod_ray.config import ConfigError, check_resume, config_from_dict, config_from_record
from fedrod_ray.drivers.console import format_record
from fedrod_ray.drivers.runner import run_local
from fedrod_ray.executors.batched import BatchedExecutor
from fedrod_ray.executors.in_process import InProcessExecutor
from fedrod_ray.federation_state.checkpoint import load_checkpoint, save_checkpoint
from fedrod_ray.federation_state.dp_rounds import NOISE_TAG, ClientLevelDP, check_shared
from fedrod_ray.federation_state.setup import make_host, prepare
from fedrod_ray.models.export import _version_id, load_final
from fedrod_ray.outputs.storage import RunStorage
from fedrod_ray.round_loop.federation import Federation, RoundFailedError
from fedrod_ray.server_math.accounting import Mechanism, composed_epsilon, epsilon, noise_for_epsilon
from fedrod_ray.server_math.privacy import (
    NonFiniteUpdateError,
    SecureNoise,
    SeededNoise,
    adapted_clip_norm,
    clip_update,
    noised_mean,
    update_noise_multiplier,
    update_norm,
)
from fedrod_ray.server_math.server import poisson_sample

pytestmark = pytest.mark.usefixtures("one_torch_thread")
REPO = Path(__file__).resolve().parents[1]

BASE = {
    "seed": 3,
    "data": {"dataset": "synthetic", "num_clients": 6, "alpha": 0.3, "synthetic_train_per_class": 12,
             "synthetic_test_per_class": 5, "min_per_client": 4},
    "train": {"head": "linear", "rounds": 4, "client_fraction": 0.5, "local_epochs": 1, "batch_size": 16},
    "eval": {"eval_every": 4},
}
PRIVATE = ("privacy.enabled=true",)
SEEDED = ("privacy.noise_seed=11",)  # seeded noise and sampling: the tests that compare runs bit for bit


def federation(*overrides: str) -> Federation:
    setup = prepare(config_from_dict(BASE, list(overrides)))
    return Federation(setup, InProcessExecutor(make_host(setup)), log=lambda s: None)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def without(record: dict, *prefixes: str) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(prefixes) and "seconds" not in k}


# --- the math, by hand --------------------------------------------------------------------------------


def test_clipping_by_hand():
    anchor = {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([2.0])}
    model = {"a": torch.tensor([4.0, 0.0]), "b": torch.tensor([6.0])}  # Delta = (3, 0 | 4), norm 5
    assert update_norm(model, anchor) == 5.0
    clipped, was = clip_update(model, anchor, 1.0)
    assert was
    assert torch.allclose(clipped["a"], torch.tensor([1.6, 0.0]), rtol=0, atol=1e-6)  # 1 + 3/5
    assert torch.allclose(clipped["b"], torch.tensor([2.8]), rtol=0, atol=1e-6)  # 2 + 4/5
    assert update_norm(clipped, anchor) <= 1.0
    # Within the norm: the model itself, untouched.
    kept, was = clip_update(model, anchor, 5.0)
    assert kept is model and not was


def test_every_clipped_update_the_server_reads_back_is_within_the_norm():
    """On large weights a small clip norm is a few float32 steps: rounded to the nearest, the update read
    back, (w_bar + clip(Delta)) - w_bar, would often be longer than S (checked here, so the test can fail);
    rounded towards w_bar, never."""
    g = torch.Generator().manual_seed(0)
    nearest_over = 0
    for _ in range(200):
        anchor = {"w": torch.randn(50, generator=g) * 100, "v": torch.randn(3, 4, generator=g)}
        model = {k: v + torch.randn(v.shape, generator=g) for k, v in anchor.items()}
        s = float(torch.rand(1, generator=g)) * 1e-3 + 1e-5
        clipped, was = clip_update(model, anchor, s)
        assert was and update_norm(clipped, anchor) <= s
        scale = s / update_norm(model, anchor)
        nearest = {k: (a.double() + (model[k].double() - a.double()) * scale).float() for k, a in anchor.items()}
        nearest_over += update_norm(nearest, anchor) > s
    assert nearest_over > 20


def test_an_update_that_is_not_finite_is_a_diverged_client_not_an_upload():
    """clip_update scaled NaN into all-NaN and inf into NaN, which the server then summed: now it refuses,
    and the client's upload becomes a failure marked diverged (which survives pickling, Ray's way back)."""
    anchor = {"a": torch.zeros(3), "b": torch.zeros(2)}
    for bad in (math.nan, math.inf, -math.inf):
        model = {"a": torch.tensor([1.0, bad, 0.0]), "b": torch.ones(2)}
        with pytest.raises(NonFiniteUpdateError):
            clip_update(model, anchor, 1.0)
        result = LocalResult(shared=model, num_samples=3, loss=0.1, personal_loss=None, steps=1, seconds=0.0)
        with pytest.raises(LocalTrainingError) as raised:
            clipped((result, {}, {}), RoundInput(anchor, {}, {}, 1.0))
        assert raised.value.diverged
        assert pickle.loads(pickle.dumps(raised.value)).diverged
        failure = ClientFailure.from_exception(4, raised.value)
        assert failure.diverged and failure.error.startswith("LocalTrainingError: the update's norm is")
        with pytest.raises(LocalTrainingError) as raised:  # without DP (no clip norm): the same failure
            clipped((result, {}, {}), RoundInput(anchor, {}, {}, None))
        assert raised.value.diverged
    assert not ClientFailure.from_exception(4, LocalTrainingError("the client has no training examples")).diverged


def poisoned(fed: Federation, clients: set[int], value: float = math.nan) -> None:
    """Clients ``clients`` of ``fed`` come back from their local update with ``value`` in their weights."""
    host = fed.executor.host
    train = host.train

    def poisoning(client_id, state, message, round_idx):
        if client_id in clients:
            method_train = host.method.train

            def bad(*args):
                result, personal, rule_state = method_train(*args)
                shared = {k: v.clone() for k, v in result.shared.items()}
                next(iter(shared.values())).view(-1)[0] = value
                return dataclasses.replace(result, shared=shared), personal, rule_state

            host.method.train = bad
            try:
                return train(client_id, state, message, round_idx)
            finally:
                host.method.train = method_train
        return train(client_id, state, message, round_idx)

    host.train = poisoning


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_diverged_client_is_dropped_from_the_noised_sum_and_the_round_goes_on(value):
    """Every client in the round, one of them not finite, no noise: the new weights are the anchor plus the
    others' clipped updates over the expected number (the diverged client's term is missing, not zero
    weighted into a smaller divisor), and the failure limits do not stop the round, even when every client
    diverges (a private round may have no participant: it is the noise alone)."""
    overrides = (*PRIVATE, *SEEDED, "privacy.noise_multiplier=0", "privacy.clip_norm=0.05", "train.client_fraction=1",
                 "privacy.sampling=fixed", "runtime.max_failed_fraction=0", "train.rounds=2", "eval.eval_every=2")
    fed = federation(*overrides)
    poisoned(fed, {2}, value)
    anchor = dict(fed.global_shared)
    record = fed.step(0)
    assert record["clients_failed"] == 1 and record["clients_done"] == 5  # not named: sampling_secrecy
    for k, a in anchor.items():
        others = sum(st.local_model[k].double() - a.double() for c, st in fed.clients.items() if c != 2)
        assert torch.allclose(fed.global_shared[k].double(), a.double() + others / 6, rtol=0, atol=1e-6), k
    assert fed.clients[2].rounds_trained == 0
    poisoned(fed, set(range(6)), value)
    before = dict(fed.global_shared)
    record = fed.step(1)
    assert record["clients_failed"] == 6 and same(before, fed.global_shared)


def test_a_private_run_whose_clients_diverge_runs_to_its_end(tmp_path):
    """End to end (issue 47: quickstart at sigma 1, S 1 stopped at round 3, "1 of 1 clients failed"): at a
    learning rate where local updates diverge, the private run drops the diverged clients from each
    round and finishes, stating its guarantee, whatever runtime.max_failed_fraction says; the same run
    without privacy stops at it."""
    overrides = ["train.lr=1e12", "train.rounds=3", "eval.eval_every=3", "runtime.max_failed_fraction=0"]
    cfg = config_from_dict({**BASE, "run_dir": str(tmp_path / "dp")}, [*overrides, *PRIVATE, "privacy.noise_multiplier=1"])
    lines: list[str] = []
    records = run_local(cfg, RunStorage(str(tmp_path / "dp")), log=lines.append)
    assert [r["round"] for r in records] == [1, 2, 3]
    assert sum(r["clients_failed"] for r in records) > 0
    assert any("non-finite loss" in line for line in lines)
    assert load_final(str(tmp_path / "dp")).meta.privacy.epsilon == records[-1]["dp_epsilon"]
    with pytest.raises(RoundFailedError, match="non-finite loss"):
        run_local(config_from_dict({**BASE, "run_dir": str(tmp_path / "plain")}, overrides),
                  RunStorage(str(tmp_path / "plain")), log=lambda s: None)


def test_without_privacy_the_failure_limits_still_stop_a_round_of_diverged_clients():
    fed = federation("train.client_fraction=1", "runtime.max_failed_fraction=0")
    host = fed.executor.host
    method_train = host.method.train

    def bad(*args):
        raise LocalTrainingError("non-finite loss in local epoch 1 (lr=0.01)", diverged=True)

    host.method.train = bad
    try:
        with pytest.raises(RoundFailedError, match="1 of 6 clients failed .* non-finite loss"):
            fed.step(0)
    finally:
        host.method.train = method_train


def test_the_server_step_by_hand():
    anchor = {"w": torch.tensor([1.0, 2.0])}
    # Two clipped uploads, w_bar + Delta_m: Delta = (1, 0) and (0, 2); the expected number is 4.
    total = {"w": torch.tensor([2.0, 2.0], dtype=torch.float64) + torch.tensor([1.0, 4.0], dtype=torch.float64)}
    out = noised_mean(total, 2, anchor, 4.0, 0.0, SeededNoise(0))
    assert out["w"].tolist() == [1.25, 2.5]  # w_bar + (sum Delta) / 4
    # No participant, no noise: w_bar, bit for bit; the expected number took part: the plain mean.
    assert torch.equal(noised_mean(None, 0, anchor, 2.5, 0.0, SeededNoise(0))["w"], anchor["w"])
    assert noised_mean(total, 2, anchor, 2.0, 0.0, SeededNoise(0))["w"].tolist() == [1.5, 3.0]


def test_adaptive_clipping_by_hand():
    # sigma 1 and a count's noise std of 1: z_Delta = (1 - 1/4)^-1/2.
    assert update_noise_multiplier(1.0, 1.0) == pytest.approx(0.75**-0.5, rel=1e-15)
    assert update_noise_multiplier(0.0, 1.0) == 0.0
    with pytest.raises(ValueError, match="more than half"):
        update_noise_multiplier(2.0, 1.0)
    # 3 of 4 updates within C, 4 expected: b~ = (3 - 2) / 4 + 1/2 = 0.75, and C moves by exp(-0.2 (0.75 - 0.5)).
    assert adapted_clip_norm(1.0, 3, 4, 4.0, 0.5, 0.2, 0.0, SeededNoise(0)) == pytest.approx(math.exp(-0.05))


def test_the_noise_std_is_sigma_s_over_the_expected_number():
    """Zero updates, noise only: the new weights' coordinates are N(0, (sigma S / E)^2). With n = 200,000
    coordinates the sample std's relative standard error is 1/sqrt(2n) = 0.16%: a 1% tolerance is over six
    of them (a fixed seed: the test is deterministic, and a factor's error, e.g. sigma S / count or sigma /
    E, fails it by far more), and the mean's standard error is std / sqrt(n)."""
    sigma, s, expected, n = 1.3, 0.7, 50.0, 200_000
    anchor = {"a": torch.zeros(n // 2), "b": torch.zeros(2, n // 4)}
    out = noised_mean(None, 0, anchor, expected, sigma * s, SeededNoise(1234))
    flat = torch.cat([v.flatten().double() for v in out.values()])
    target = sigma * s / expected
    assert abs(flat.std().item() / target - 1) < 0.01
    assert abs(flat.mean().item()) < 5 * target / math.sqrt(n)
    again = noised_mean(None, 0, anchor, expected, sigma * s, SeededNoise(1234))
    assert same(out, again)  # seeded: the same bits


def test_secure_noise_is_standard_normal_and_not_reproducible():
    """Box-Muller on os.urandom: n = 100,000 draws, std within 2% (the standard error is 0.22%) and the mean
    within 5 standard errors; two draws never agree."""
    a, b = SecureNoise().normal(100_001), SecureNoise().normal(100_001)
    assert a.shape == (100_001,) and a.dtype == torch.float64
    assert abs(a.std().item() - 1) < 0.02 and abs(a.mean().item()) < 5 / math.sqrt(len(a))
    assert not torch.equal(a, b)


def test_poisson_sampling_is_independent_at_the_rate():
    ids = [poisson_sample(0, r, 1000, 0.1) for r in range(200)]
    sizes = torch.tensor([len(i) for i in ids], dtype=torch.float64)
    # Binomial(1000, 0.1): mean 100, std 9.5; over 200 rounds the mean's standard error is 0.67.
    assert abs(sizes.mean().item() - 100) < 3 and 7 < sizes.std().item() < 12
    assert ids[0] == sorted(ids[0]) == poisson_sample(0, 0, 1000, 0.1)
    assert any(len(poisson_sample(5, r, 6, 0.2)) == 0 for r in range(30))  # an empty round happens


# --- the accountant -----------------------------------------------------------------------------------


def test_epsilon_is_the_librarys_for_a_published_setting():
    """DP-SGD on MNIST (Abadi et al., 2016): q = 256/60,000, sigma 1.3 for 20 epochs and 0.7 for 70, delta 1e-5,
    whose moments accountant Bu et al. (HDSR 2020, Figure 4) report as epsilon 1.34 and 8.68. Ours is the
    library's RDP accountant on the same event, exactly, and at most the published figures (the library
    converts RDP to (epsilon, delta) more tightly than the moments accountant did), within 25% of them."""
    q = 256 / 60_000
    for sigma, epochs, published in ((1.3, 20, 1.34), (0.7, 70, 8.68)):
        steps = round(epochs / q)
        ours = epsilon(Mechanism(sigma, "poisson", 60_000, q), steps, 1e-5)
        event = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
        assert ours == dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-5)
        assert 0.75 * published <= ours <= published
    assert epsilon(Mechanism(1.0, "poisson", 1000, 0.1), 0, 1e-5) == 0
    assert epsilon(Mechanism(0.0, "poisson", 1000, 0.1), 3, 1e-5) == math.inf


def gaussian_epsilon(mu: float, delta: float) -> float:
    """The exact epsilon at ``delta`` of a Gaussian mechanism whose sensitivity is ``mu`` noise stds (mu-GDP,
    Dong, Roth and Su, 2022, Corollary 2.13): delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2),
    solved by bisection; no accountant involved. r rounds of it are one of sensitivity mu sqrt(r)."""
    def phi(x: float) -> float:
        return 0.5 * math.erfc(-x / math.sqrt(2))

    low, high = 0.0, 500.0
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if phi(-mid / mu + mu / 2) - math.exp(mid) * phi(-mid / mu - mu / 2) > delta else \
            (low, mid)
    return high


def one_replaced_client(rate: float, sigma: float, rounds: int, delta: float) -> float:
    """The exact epsilon of one pair of neighbouring federations under the fixed-size draw: every client sends
    S e, and the replaced one sends -S e instead. The round's sum is then N(m S e) on one side and, when the
    replaced client is drawn (probability m / M), shifted by 2S: Poisson-sampled Gaussian neighbours at
    sensitivity 2S, i.e. multiplier sigma / 2 (dp_accounting's PLD, tight up to its discretisation). A
    fixed-size accountant that reports less than this understates what the pair reveals."""
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma / 2)), rounds)
    return dp_accounting.pld.PLDAccountant().compose(event).get_epsilon(delta)


@pytest.mark.parametrize("clients, drawn, sigma, rounds", [(10, 10, 2.0, 10), (20, 20, 4.0, 50), (1000, 100, 1.0, 100),
                                                            (100, 10, 2.0, 50), (50, 25, 1.5, 20)])
def test_fixed_size_sampling_accounts_for_a_replaced_client_moving_the_sum_by_2s(clients, drawn, sigma, rounds):
    """Replacing one client moves the clipped sum by up to 2S. Checked against formulations that do not go
    through the fixed-size event: every client in every round (q = 1) is a plain Gaussian of sensitivity
    2S, whose exact epsilon is closed-form (the issue's q = 1, sigma 2, 10 rounds: 17.86, where the
    sensitivity-S accounting said 8.08); for q < 1 a concrete pair of neighbouring federations, whose exact
    epsilon the accountant may not undercut (at 1,000 clients, 100 a round, sigma 1, 100 rounds: at least
    31.4, and the fixed-size RDP bound says 83.9, not 14.05)."""
    ours = epsilon(Mechanism(sigma, "fixed", clients, drawn / clients), rounds, 1e-5)
    if drawn == clients:
        exact = gaussian_epsilon(2 / sigma * math.sqrt(rounds), 1e-5)
        assert exact <= ours <= 1.1 * exact  # RDP's conversion is loose by a few percent
    else:
        assert one_replaced_client(drawn / clients, sigma, rounds, 1e-5) <= ours
    if (clients, sigma, rounds) == (10, 2.0, 10):
        assert gaussian_epsilon(2 / sigma * math.sqrt(rounds), 1e-5) == pytest.approx(17.86, abs=0.01)
    if (clients, sigma, rounds) == (1000, 1.0, 100):
        assert one_replaced_client(0.1, 1.0, 100, 1e-5) == pytest.approx(31.37, abs=0.01)
        assert ours == pytest.approx(83.94, abs=0.01)


def test_fixed_size_sampling_with_adaptive_clipping_charges_the_counts_replace_one_sensitivity_too():
    """Replacing a client moves the count of unclipped updates by up to 1 (add-or-remove: 1/2). With every
    client in every round the round is two Gaussians, the sum at z_Delta over 2S and the count at sigma_b
    over 1: together mu = sqrt(rounds ((2 / z_Delta)^2 + (1 / sigma_b)^2)), closed-form."""
    cfg = config_from_dict(BASE, [*PRIVATE, "privacy.sampling=fixed", "train.client_fraction=1",
                                  "privacy.noise_multiplier=2", "privacy.adaptive_clip={count_noise: 1.5}"])
    dp = ClientLevelDP(cfg, 6)
    mu = math.sqrt(10 * ((2 / dp.update_noise) ** 2 + (1 / dp.count_noise) ** 2))
    exact = gaussian_epsilon(mu, 1e-5)
    assert exact <= dp.epsilon(10) <= 1.1 * exact


def test_sigma_for_a_target_epsilon_under_fixed_size_sampling_keeps_to_it():
    """The sigma derived for epsilon 8 over 10 rounds with every client, at q = 1 a Gaussian of sensitivity
    2S: its exact epsilon (closed form) is within 8, and 1e-3 less noise is not, by the accountant."""
    mechanism = Mechanism(0.0, "fixed", 10, 1.0)
    sigma = noise_for_epsilon(mechanism, 8.0, 1e-5, 10)
    assert gaussian_epsilon(2 / sigma * math.sqrt(10), 1e-5) <= 8.0
    assert epsilon(mechanism.with_noise(sigma - 1e-3), 10, 1e-5) > 8.0


def test_rdp_and_pld_agree_within_their_tolerance():
    """The privacy-utility table's setting (q = 0.1, sigma 1, 100 rounds). PLD is tight up to its
    discretisation (pessimistic), RDP an upper bound whose conversion to (epsilon, delta) is loose by about
    10% here: PLD <= RDP <= 1.2 PLD."""
    rdp = epsilon(Mechanism(1.0, "poisson", 1000, 0.1, "rdp"), 100, 1e-5)
    pld = epsilon(Mechanism(1.0, "poisson", 1000, 0.1, "pld"), 100, 1e-5)
    assert pld <= rdp <= 1.2 * pld


def test_sigma_from_a_target_epsilon_is_the_smallest_within_it():
    mechanism = Mechanism(0.0, "poisson", 1000, 0.1)
    sigma = noise_for_epsilon(mechanism, 4.0, 1e-5, 100)
    assert epsilon(mechanism.with_noise(sigma), 100, 1e-5) <= 4.0 < epsilon(mechanism.with_noise(sigma - 1e-3), 100,
                                                                             1e-5)
    # Unreachable: a config error naming the field, before the run starts.
    with pytest.raises(ConfigError, match=r"privacy\.target_epsilon: epsilon 0\.0001 .* out of reach"):
        federation(*PRIVATE, "privacy.target_epsilon=1e-4")


def test_sigma_for_a_target_epsilon_under_pld_searches_only_where_pld_is_cheap(monkeypatch):
    """PLD's memory grows as the noise shrinks (a search from sigma = 1e-3 asked for 38 GiB): every noise
    multiplier PLD is asked about lies between half of RDP's answer and the answer it returns, which is the
    smallest within the target. A target that would take PLD below its floor is a config error naming the
    accountant, and nothing is allocated (a PLD event below the floor fails the test here before it is)."""
    asked: list[float] = []
    event = Mechanism.event

    def spied(self, rounds):
        if self.accountant == "pld":
            if self.noise_multiplier < 0.2:
                raise AssertionError(f"PLD asked about sigma {self.noise_multiplier:g}")
            asked.append(self.noise_multiplier)
        return event(self, rounds)

    monkeypatch.setattr(Mechanism, "event", spied)
    mechanism = Mechanism(0.0, "poisson", 100, 0.5, "pld")
    rdp = noise_for_epsilon(dataclasses.replace(mechanism, accountant="rdp"), 3.0, 1e-5, 5)
    sigma = noise_for_epsilon(mechanism, 3.0, 1e-5, 5)
    assert rdp / 2 <= min(asked) and sigma <= rdp
    assert epsilon(mechanism.with_noise(sigma), 5, 1e-5) <= 3.0 < epsilon(mechanism.with_noise(sigma - 1e-3), 5, 1e-5)
    with pytest.raises(ConfigError, match=r"privacy\.target_epsilon: epsilon 500 .* use privacy\.accountant=rdp"):
        federation(*PRIVATE, "privacy.accountant=pld", "privacy.target_epsilon=500")


# --- runs ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["fedavg", "feddyn"])
def test_without_noise_or_clipping_a_private_run_is_the_uniform_non_private_run(rule, monkeypatch):
    """sigma = 0 and S = inf, the fixed-size sample: bitwise the non-private run with uniform weights (FedDyn's
    own; FedAvg's patched to 1)."""
    monkeypatch.setattr(FedAvg, "aggregation_weight", lambda self, num_samples: 1.0)
    rounds = ("train.rounds=2", f"train.generic_rule={rule}")
    plain = federation(*rounds)
    private = federation(*rounds, *PRIVATE, *SEEDED, "privacy.noise_multiplier=0", "privacy.clip_norm=.inf",
                         "privacy.sampling=fixed", "privacy.disclose_sampling=true")  # the records' fields too
    for r in range(2):
        a, b = plain.step(r), private.step(r)
        assert without(a) == without(b, "dp_") and b["dp_epsilon"] == math.inf
    assert same(plain.global_shared, private.global_shared) and same(plain.server_state, private.server_state)
    assert bool(plain.server_state) == (rule == "feddyn")
    for cid, st in plain.clients.items():
        assert same(st.tensors(), private.clients[cid].tensors()), cid


def test_a_resumed_private_run_continues_the_uninterrupted_ones_weights_clip_norm_and_epsilon(tmp_path):
    """Poisson sampling, adaptive clipping (the clip norm is server state, checkpointed), seeded noise, the
    hyper head (nu is noised with theta and psi)."""
    overrides = (*PRIVATE, *SEEDED, "train.head=hyper", "privacy.noise_multiplier=0.5", "privacy.clip_norm=0.3",
                 "privacy.adaptive_clip={count_noise: 1.0}")
    a = federation(*overrides)
    records = [a.step(r) for r in range(4)]
    b = federation(*overrides)
    b.step(0)
    b.step(1)
    save_checkpoint(RunStorage(str(tmp_path)), b.snapshot())
    resumed = federation(*overrides)
    resumed.restore(load_checkpoint(RunStorage(str(tmp_path))))
    again = [resumed.step(r) for r in (2, 3)]
    assert [without(r) for r in again] == [without(r) for r in records[2:]]
    assert same(a.global_shared, resumed.global_shared) and same(a.privacy_state, resumed.privacy_state)
    clip_norms = [r["dp_clip_norm"] for r in records]
    assert clip_norms[0] == 0.3 and len(set(clip_norms)) == 4  # it moved every round: restoring it matters
    epsilons = [r["dp_epsilon"] for r in records]
    assert epsilons == sorted(epsilons) and epsilons[0] > 0


def test_a_resumed_private_run_with_secure_noise_continues_from_its_checkpoint(tmp_path):
    """Secure noise and sampling (the default): a resumed run is not the uninterrupted one bit for bit (no seed
    replays the noise), but it continues correctly: from the checkpoint's weights and clip norm, the same
    epsilon for the same rounds, and through the runner as a resumed run is."""
    overrides = (*PRIVATE, "privacy.noise_multiplier=0.5", "privacy.clip_norm=0.3",
                 "privacy.adaptive_clip={count_noise: 1.0}")
    b = federation(*overrides)
    first = [b.step(r) for r in (0, 1)]
    save_checkpoint(RunStorage(str(tmp_path / "fed")), b.snapshot())
    resumed = federation(*overrides)
    resumed.restore(load_checkpoint(RunStorage(str(tmp_path / "fed"))))
    assert same(resumed.global_shared, b.global_shared) and same(resumed.privacy_state, b.privacy_state)
    again = [resumed.step(r) for r in (2, 3)]
    assert again[0]["dp_clip_norm"] == float(b.privacy_state["clip_norm"])
    assert [r["dp_epsilon"] for r in first + again] == [b.dp.epsilon(r) for r in (1, 2, 3, 4)]
    cfg = config_from_dict({**BASE, "run_dir": str(tmp_path / "run")}, [*overrides, "train.rounds=2"])
    storage = RunStorage(str(tmp_path / "run"))
    run_local(cfg, storage, log=lambda s: None)
    records = run_local(config_from_dict({**BASE, "run_dir": str(tmp_path / "run")}, list(overrides)), storage,
                        load_checkpoint(storage), log=lambda s: None)
    assert [r["round"] for r in records] == [1, 2, 3, 4] and load_final(str(tmp_path / "run")).meta.round == 4
    assert load_final(str(tmp_path / "run")).meta.privacy.noise == "secure"


def released_noise(fed: Federation, anchor: dict, r: int, noise_seed: int) -> float:
    """An attacker's try at round ``r``'s noise: regenerate it from ``noise_seed`` (the scheme of seeded runs,
    which is the run's seed for a record of an earlier version), subtract it from what round r released, and
    compare with the exact sum of the clipped updates (read here from the clients, which kept them). Returns
    the norm of what is left over that of the noise."""
    generator = SeededNoise(derived_seed(noise_seed, r, NOISE_TAG))
    std, expected = fed.dp.noise_multiplier * fed.cfg.privacy.clip_norm, fed.dp.expected
    left, noise = 0.0, 0.0
    for k in sorted(anchor):
        exact = sum(st.local_model[k].double() - anchor[k].double() for st in fed.clients.values()
                    if st.rounds_trained == r + 1)
        guess = std * generator.normal(anchor[k].numel()).view(anchor[k].shape)
        released = (fed.global_shared[k].double() - anchor[k].double()) * expected
        left += float((released - guess - exact).square().sum())
        noise += float(guess.square().sum())
    return math.sqrt(left / noise)


@pytest.mark.parametrize("head", ["none", "hyper"])
def test_the_noise_cannot_be_regenerated_from_the_config_by_default(head):
    """The attack of issue 47: seeded noise is regenerated from config.yaml's seed and subtracted, and the
    exact sum of the clipped updates comes back (checked here under privacy.noise_seed, so the test can
    fail). With the default, secure noise, what is left is as large as the noise itself."""
    overrides = (*PRIVATE, "privacy.noise_multiplier=1", "privacy.clip_norm=0.5", "train.client_fraction=1",
                 f"train.head={head}", "train.balanced_loss=ce" if head == "none" else "train.balanced_loss=bsm")
    for extra, recovered in (((f"privacy.noise_seed={BASE['seed']}",), True), ((), False)):
        fed = federation(*overrides, *extra)
        anchor = dict(fed.global_shared)
        fed.step(0)
        left = released_noise(fed, anchor, 0, BASE["seed"])
        assert (left < 1e-3) if recovered else (left > 1), left


def test_who_took_part_cannot_be_replayed_from_the_seed_by_default():
    """Poisson sampling at 0.5 over 6 clients and 6 rounds: under privacy.noise_seed each round's clients are
    poisson_sample(seed, round) (so the test can fail); by default they come from the OS's CSPRNG, and the
    seed's draw matches all six rounds with probability (1/64)^6."""
    for extra, replayed in ((SEEDED, True), ((), False)):
        fed = federation(*PRIVATE, *extra, "privacy.noise_multiplier=1", "train.rounds=6", "eval.eval_every=6")
        matches = 0
        for r in range(6):
            before = {c: st.rounds_trained for c, st in fed.clients.items()}
            fed.step(r)
            took_part = sorted(c for c, st in fed.clients.items() if st.rounds_trained > before[c])
            matches += took_part == poisson_sample(BASE["seed"], r, 6, 0.5)
        assert (matches == 6) == replayed


def test_a_round_without_participants_moves_the_weights_by_the_noise_alone_and_spends_privacy():
    seed = 5
    empty = next(r for r in range(30) if not poisson_sample(seed, r, 6, 0.2))
    overrides = (f"seed={seed}", f"train.rounds={empty + 1}", "train.client_fraction=0.2", f"eval.eval_every={empty + 1}",
                 *PRIVATE, *SEEDED)
    for sigma in (0.0, 1.0):
        fed = federation(*overrides, f"privacy.noise_multiplier={sigma}")
        for r in range(empty):
            fed.step(r)
        before = dict(fed.global_shared)
        record = fed.step(empty)
        assert record["clients"] == 0 and math.isnan(record["train_loss"])
        assert same(before, fed.global_shared) == (sigma == 0)
        assert record["dp_epsilon"] == epsilon(fed.dp.mechanism, empty + 1, 1e-5)


def test_the_budget_stops_the_run_and_final_and_the_http_service_state_the_guarantee(tmp_path):
    mechanism = Mechanism(1.0, "poisson", 6, 0.5)
    budget = (epsilon(mechanism, 2, 1e-5) + epsilon(mechanism, 3, 1e-5)) / 2  # lasts 2 rounds of 4
    cfg = config_from_dict({**BASE, "run_dir": str(tmp_path)},
                           [*PRIVATE, "privacy.noise_multiplier=1.0", f"privacy.target_epsilon={budget}"])
    lines: list[str] = []
    records = run_local(cfg, RunStorage(str(tmp_path)), log=lines.append)
    assert [r["round"] for r in records] == [1, 2] and "gfl_gm" in records[-1]
    assert any("lasts 2 of the 4 rounds" in line for line in lines)
    assert any(line.endswith(f"ε {records[-1]['dp_epsilon']:.3f}") for line in lines)
    served = load_final(str(tmp_path))
    guarantee = served.meta.privacy
    assert served.meta.round == 2 and guarantee.epsilon == records[-1]["dp_epsilon"] <= budget
    assert (guarantee.delta, guarantee.noise_multiplier, guarantee.clip_norm, guarantee.sampling,
            guarantee.sampling_rate, guarantee.accountant) == (1e-5, 1.0, 1.0, "poisson", 0.5, "rdp")
    with TestClient(create_app(str(tmp_path))) as client:
        info = client.get("/v1/model").json()
    assert info["privacy"]["epsilon"] == guarantee.epsilon and info["privacy"]["adaptive_clip"] is False


def test_seeded_noise_is_an_explicit_opt_in_and_a_seeded_run_says_so(tmp_path):
    """Secure by default; privacy.noise_seed opts into seeded noise and sampling, and the run then says on the
    console and in final/meta.json that it is not private against whoever knows the seed. The key it
    replaced is an error that names the new one; a record written with it still loads, as it ran."""
    for overrides in (["privacy.secure_rng=true"], []):
        data = {**BASE, "privacy": {"enabled": True, "noise_multiplier": 1.0, "secure_rng": False}}
        with pytest.raises(ConfigError, match=r"privacy\.secure_rng was replaced by privacy\.noise_seed"):
            config_from_dict(data if not overrides else BASE, [*PRIVATE, *overrides])
    record = {**BASE, "privacy": {"enabled": True, "noise_multiplier": 1.0, "secure_rng": False}}
    assert config_from_record(record).privacy.noise_seed == BASE["seed"]  # what the earlier version seeded by
    record["privacy"]["secure_rng"] = True
    assert config_from_record(record).privacy.noise_seed is None
    assert config_from_record({**BASE, "privacy": {"secure_rng": False}}).privacy == config_from_dict(BASE).privacy
    for extra, noise in ((SEEDED, "seeded"), ((), "secure")):
        run_dir = tmp_path / noise
        cfg = config_from_dict({**BASE, "run_dir": str(run_dir)},
                               [*PRIVATE, *extra, "privacy.noise_multiplier=1", "train.rounds=1", "eval.eval_every=1"])
        lines: list[str] = []
        run_local(cfg, RunStorage(str(run_dir)), log=lines.append)
        assert load_final(str(run_dir)).meta.privacy.noise == noise
        warned = [line for line in lines if "not private against anyone who knows the seed" in line]
        assert len(warned) == (noise == "seeded")


def test_a_final_written_before_privacy_still_loads(tmp_path):
    cfg = config_from_dict({**BASE, "run_dir": str(tmp_path)}, ["train.rounds=1", "eval.eval_every=1"])
    run_local(cfg, RunStorage(str(tmp_path)), log=lambda s: None)
    path = tmp_path / "final" / "meta.json"
    doc = json.loads(path.read_text())
    assert doc["privacy"] is None
    del doc["privacy"]
    doc["version_id"] = _version_id(doc)
    path.write_text(json.dumps(doc))
    assert load_final(str(tmp_path)).meta.privacy is None


def test_the_console_line_shows_epsilon():
    record = {"round": 3, "seconds": 1.0, "lr": 0.01, "clients_done": 2, "clients": 2, "clients_failed": 0,
              "train_loss": 0.5, "dp_epsilon": 1.23456}
    assert format_record(record, 5).endswith("|  ε 1.235")


# --- what composes, and what is refused ---------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    ((), r"privacy\.noise_multiplier: client-level DP needs its noise"),
    (("privacy.enabled=false", "privacy.clip_norm=2"), r"privacy\.clip_norm: has no effect without privacy\.enabled"),
    (("privacy.noise_multiplier=1", "privacy.clip_norm=.inf"), r"privacy\.clip_norm: an infinite clip norm"),
    (("privacy.noise_multiplier=.inf",), r"privacy\.noise_multiplier: must be finite"),
    (("privacy.noise_multiplier=1", "privacy.sampling=fixed", "privacy.accountant=pld"),
     r"privacy\.accountant: pld .* Poisson sampling only"),
    (("privacy.noise_multiplier=1", "train.generic_rule=scaffold"), r"train\.generic_rule: scaffold .* control"),
    (("privacy.noise_multiplier=1", "train.generic_rule=local", "train.head=linear"),
     r"train\.generic_rule: local .* nothing to protect"),
    (("privacy.noise_multiplier=1", "train.head=fedfomo", "train.balanced_loss=ce"),
     r"train\.head: fedfomo .* reads every client's own upload"),
    (("privacy.noise_multiplier=1", "train.head=mtl", "train.balanced_loss=ce"), r"train\.head: mtl .* no global model"),
    (("privacy.noise_multiplier=1", "train.head=fedper", "train.balanced_loss=ce"),
     r"train\.head: fedper .* no global model"),
])
def test_what_client_level_dp_refuses_names_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(BASE, [*PRIVATE, *overrides])


@pytest.mark.parametrize("overrides", [("train.generic_rule=fedprox",), ("train.head=ditto", "train.balanced_loss=ce"),
                                       ("train.head=pfedme", "train.balanced_loss=ce", "train.momentum=0",
                                        "train.weight_decay=0")], ids=["fedprox", "ditto", "pfedme"])
def test_private_rounds_of_the_rules_and_methods_that_compose(overrides):
    """Each shares its whole shared part through the clipped, noised sum: one round trains and spends (seeded:
    secure Poisson sampling leaves a round of 6 clients empty now and then)."""
    fed = federation(*PRIVATE, *SEEDED, "privacy.noise_multiplier=1", "privacy.clip_norm=0.5", *overrides)
    before = dict(fed.global_shared)
    record = fed.step(0)
    assert record["clients_done"] > 0 and record["dp_epsilon"] > 0 and not same(before, fed.global_shared)


def test_the_batched_executor_clips_every_update_too():
    setup = prepare(config_from_dict(BASE, [*PRIVATE, *SEEDED, "privacy.noise_multiplier=1", "privacy.clip_norm=0.01",
                                            "runtime.batched_clients=3"]))
    fed = Federation(setup, BatchedExecutor(make_host(setup), 3), log=lambda s: None)
    before = dict(fed.global_shared)
    record = fed.step(0)
    trained = [st for st in fed.clients.values() if st.rounds_trained]
    assert len(trained) == record["clients_done"] > 0
    assert all(0 < update_norm(st.local_model, before) <= 0.01 for st in trained)


def test_refused_before_the_run_a_count_noise_too_small_and_integer_shared_state():
    with pytest.raises(ConfigError, match=r"privacy\.adaptive_clip\.count_noise: .* more than half"):
        federation(*PRIVATE, "privacy.noise_multiplier=2", "privacy.adaptive_clip={count_noise: 0.5}")
    with pytest.raises(ConfigError, match=r"model\.arch: .* integer tensors \(bn\.num_batches_tracked\)"):
        check_shared({"w": torch.zeros(2), "bn.num_batches_tracked": torch.tensor(3)})


def test_a_resume_cannot_change_the_rounds_a_derived_sigma_was_made_for():
    saved = config_from_dict(BASE, [*PRIVATE, "privacy.target_epsilon=10"])
    with pytest.raises(ConfigError, match=r"train\.rounds: .* derived from privacy\.target_epsilon over 4 rounds"):
        check_resume(saved, config_from_dict(BASE, [*PRIVATE, "privacy.target_epsilon=10", "train.rounds=6"]), 2)
    given = config_from_dict(BASE, [*PRIVATE, "privacy.noise_multiplier=1"])
    check_resume(given, config_from_dict(BASE, [*PRIVATE, "privacy.noise_multiplier=1", "train.rounds=6"]), 2)


def test_tune_sweeps_sigma_and_the_clip_norm(tmp_path):
    sweep = tmp_path / "dp.yaml"
    base = tmp_path / "base.yaml"
    base.write_text(json.dumps({**BASE, "privacy": {"enabled": True, "noise_multiplier": 1.0}}))
    sweep.write_text(json.dumps({"base": str(base), "search": {"privacy.noise_multiplier": {"grid": [0.5, 2.0]},
                                                                "privacy.clip_norm": {"choice": [0.1, 1.0]}}}))
    spec = load_sweep(sweep)
    cfg = spec.trial_config({"privacy.noise_multiplier": 2.0, "privacy.clip_norm": 0.1})
    assert (cfg.privacy.noise_multiplier, cfg.privacy.clip_norm) == (2.0, 0.1)


def sweep_of_sigma(tmp_path, privacy: dict):
    base = tmp_path / "base.yaml"
    base.write_text(json.dumps({**BASE, "train": {**BASE["train"], "client_fraction": 1.0},
                                "privacy": {"enabled": True, "noise_multiplier": 1.0, "clip_norm": 0.5, **privacy}}))
    sweep = tmp_path / "dp.yaml"
    sweep.write_text(json.dumps({"base": str(base), "search": {"privacy.noise_multiplier": {"grid": [0.5, 2.0]}}}))
    return load_sweep(sweep)


def test_two_trials_of_a_seeded_sweep_do_not_cancel_each_others_noise(tmp_path):
    """Issue 47's attack on a sweep: two trials that differ only in sigma released w_a and w_b after a round
    whose clipped sum is the same in both (same clients, same start); with the same noise z,
    (sigma_b (w_a - w) - sigma_a (w_b - w)) / (sigma_b - sigma_a) is the noise-free mean. Each trial of a
    seeded sweep has a noise seed of its own (the same on every call), so the combination is as noisy as a
    model; a secure sweep's trials have none to share."""
    spec = sweep_of_sigma(tmp_path, {"noise_seed": 5})
    params = [{"privacy.noise_multiplier": s} for s in (0.5, 2.0)]
    seeds = [spec.trial_config(p).privacy.noise_seed for p in params]
    assert len(set(seeds)) == 2 and seeds == [spec.experiment_config(p).privacy.noise_seed for p in params]
    feds, anchor = [], None
    for p in params:
        setup = prepare(spec.trial_config(p))
        fed = Federation(setup, InProcessExecutor(make_host(setup)), log=lambda s: None)
        anchor = dict(fed.global_shared)
        fed.step(0)
        feds.append(fed)
    (a, b), (sa, sb) = feds, (0.5, 2.0)
    left, noise = 0.0, 0.0
    for k in anchor:
        exact = sum(st.local_model[k].double() - anchor[k].double() for st in a.clients.values()) / a.dp.expected
        combined = (sb * (a.global_shared[k].double() - anchor[k].double())
                    - sa * (b.global_shared[k].double() - anchor[k].double())) / (sb - sa)
        left += float((combined - exact).square().sum())
        noise += float((a.global_shared[k].double() - anchor[k].double() - exact).square().sum())
    assert math.sqrt(left / noise) > 0.5
    secure = sweep_of_sigma(tmp_path, {})
    assert all(secure.trial_config(p).privacy.noise_seed is None for p in params)


def test_every_private_row_of_a_seeded_reproduction_has_its_own_noise_seed(tmp_path):
    """--set privacy.noise_seed=3 on the privacy table: a seed of its own for every private row and seed
    of the reproduction; the rows without DP (epsilon = inf) drop it."""
    spec = build_spec("privacy", REPO / "configs" / "synthetic_tiny.yaml", seeds=[0, 1], rounds=2,
                      overrides={"privacy.noise_seed": 3})
    seeds = {(row, seed): spec.row_config(row, seed).privacy.noise_seed for row in spec.rows for seed in (0, 1)}
    private = [v for (row, _), v in seeds.items() if "∞" not in row]
    assert len(private) == 12 and len(set(private)) == 12
    assert all(v is None for (row, _), v in seeds.items() if "∞" in row)


def test_a_sweeps_trials_spend_privacy_together():
    """Four trials at epsilon 8 each, on the same clients, compose on one accountant: 400 rounds of the
    sampled Gaussian, by RDP more than 16 (issue 47: at least 16.2), not 8."""
    mechanism = Mechanism(0.0, "poisson", 1000, 0.1)
    sigma = noise_for_epsilon(mechanism, 8.0, 1e-5, 100)
    total = composed_epsilon([(mechanism.with_noise(sigma), 100)] * 4, 1e-5)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(sigma)), 400)
    assert total == pytest.approx(dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-5), rel=1e-9)
    assert total > 16.2
    assert composed_epsilon([(mechanism.with_noise(sigma), 0)], 1e-5) == 0
    assert composed_epsilon([(mechanism.with_noise(sigma), 3), (mechanism, 1)], 1e-5) == math.inf


def budgeted_sweep(tmp_path, search: dict, budget, num_samples: int = 1, privacy: bool = True):
    base = tmp_path / "base.yaml"
    base.write_text(json.dumps({**BASE, "privacy": {"enabled": True, "noise_multiplier": 1.0}} if privacy else BASE))
    sweep = tmp_path / "dp.yaml"
    sweep.write_text(json.dumps({"base": str(base), "search": search, "num_samples": num_samples,
                                 "privacy_budget": budget}))
    return load_sweep(sweep)


def test_a_sweep_refuses_to_start_past_its_privacy_budget(tmp_path):
    """The most a sweep can spend: every trial at all its rounds, a random dimension at its costliest
    extreme (the least noise), num_samples times; past privacy_budget it is a config error before any
    trial, and a budget on a sweep that is not private has no effect (an error too)."""
    grid = {"privacy.noise_multiplier": {"grid": [0.8, 3.0]}, "train.lr": {"loguniform": [0.001, 0.1]}}
    spec = budgeted_sweep(tmp_path, grid, 1000.0, num_samples=2)
    at = [({"privacy.noise_multiplier": s, "train.lr": 0.01}, 4) for s in (0.8, 0.8, 3.0, 3.0)]
    assert most_spent(spec) == pytest.approx(spent(spec, at), rel=1e-12)
    uniform = budgeted_sweep(tmp_path, {"privacy.noise_multiplier": {"uniform": [0.8, 3.0]}}, 1000.0, num_samples=3)
    assert most_spent(uniform) == pytest.approx(spent(uniform, [({"privacy.noise_multiplier": 0.8}, 4)] * 3))
    check_budget(spec)
    tight = budgeted_sweep(tmp_path, grid, most_spent(spec) * 0.99, num_samples=2)
    with pytest.raises(ConfigError, match=r"privacy_budget: the sweep's trials could spend epsilon [0-9.]+ in all"):
        check_budget(tight)
    with pytest.raises(ConfigError, match=r"privacy_budget: has no effect: the base config is not private"):
        budgeted_sweep(tmp_path, grid, 8.0, privacy=False)
    with pytest.raises(ConfigError, match=r"privacy_budget: must be a positive number"):
        budgeted_sweep(tmp_path, grid, -1)


def test_a_private_sweeps_results_and_best_yaml_say_what_it_spent(tmp_path):
    """The results table and best.yaml of a private sweep give the total epsilon of its trials' rounds as
    they ran (one stopped early by the scheduler spends only its rounds), and say what it does not cover."""
    spec = budgeted_sweep(tmp_path, {"privacy.noise_multiplier": {"grid": [0.8, 3.0]}}, 100.0)
    rows = [{"privacy.noise_multiplier": 0.8, "rounds": 4, "status": "finished", "objective": 0.5, "gfl_gm": 0.5,
             "pfl_gm": 0.5, "pfl_pm": 0.6, "best_objective": 0.5, "best_round": 4},
            {"privacy.noise_multiplier": 3.0, "rounds": 2, "status": "stopped", "objective": 0.4, "gfl_gm": 0.4,
             "pfl_gm": 0.4, "pfl_pm": 0.5, "best_objective": 0.4, "best_round": 2}]
    out = tmp_path / "sweep"
    out.mkdir()
    write_results(spec, rows, out)
    total = spent(spec, [({"privacy.noise_multiplier": 0.8}, 4), ({"privacy.noise_multiplier": 3.0}, 2)])
    mechanism = Mechanism(0.8, "poisson", 6, 0.5)
    assert total == composed_epsilon([(mechanism, 4), (mechanism.with_noise(3.0), 2)], 1e-5)
    line = f"Privacy: the trials spent epsilon {total:.4g} in all at delta 1e-05, of a budget of 100"
    assert line in (out / "results.md").read_text()
    best = (out / "best.yaml").read_text()
    assert f"# {line}" in best and "the selection metric, whose P-FL comes from un-noised local models" in best


def test_a_reproduction_recorded_with_secure_rng_resumes_with_the_noise_it_drew(tmp_path):
    """The published privacy_eps8 job's reproduce.yaml holds privacy.secure_rng: false (seeded by the run's
    seed): it still loads for --resume and --status, its private rows seeded as they ran."""
    (tmp_path / "trials").mkdir()
    shutil.copy(REPO / "bench" / "results" / "fmnist" / "privacy_eps8" / "reproduce.yaml", tmp_path)
    spec = load_spec(tmp_path)
    for row in spec.rows:
        cfg = spec.row_config(row, 0)
        assert cfg.privacy.enabled and cfg.privacy.noise_seed == cfg.seed == 0
