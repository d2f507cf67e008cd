"""The server re-checks every upload before it sums it, from the attacker's side: a participant that skips the
client's own checks (sends NaN, or under client-level DP an update far over the clip norm) is refused by the
server, counted as failed, and leaves the global model exactly as if it had failed; a secure sum that is not
finite is never applied. The check is in the round loop, so every runtime's results pass through it."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fedrod_ray.clients.client import ClientFailure, ClientUnavailable
from fedrod_ray.config import config_from_dict
from fedrod_ray.executors.base import RoundSkipped, SummedRound
from fedrod_ray.executors.in_process import InProcessExecutor
from fedrod_ray.federation_state.setup import make_host, prepare
from fedrod_ray.round_loop.federation import Federation, RoundFailedError
from fedrod_ray.server_math.aggregate import OrderedAverager, WeightedSum
from fedrod_ray.server_math.sums import Losses, RoundSums
from fedrod_ray.server_math.uploads import non_finite, upload_problem

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE = {
    "seed": 3,
    "data": {"dataset": "synthetic", "num_clients": 6, "alpha": 0.3, "synthetic_train_per_class": 12,
             "synthetic_test_per_class": 5, "min_per_client": 4},
    "train": {"head": "linear", "rounds": 2, "client_fraction": 0.5, "local_epochs": 1, "batch_size": 16},
    "eval": {"eval_every": 2},
}
DP = ("privacy.enabled=true", "privacy.noise_seed=11", "privacy.noise_multiplier=0.5", "privacy.clip_norm=0.3",
      "privacy.sampling=fixed")


def test_an_upload_is_refused_for_a_non_finite_value_or_an_update_over_the_clip_norm():
    anchor = {"w": torch.tensor([1.0, 1.0]), "b": torch.tensor([0.0])}
    shared = {"w": torch.tensor([4.0, 5.0]), "b": torch.tensor([0.0])}  # the update (3, 4, 0): norm 5
    assert upload_problem(shared, (), anchor, None) is None
    assert upload_problem(shared, (), anchor, 5.0) is None
    assert upload_problem(shared, (), anchor, 4.99) == ("its update's L2 norm 5 is over the clip norm 4.99 "
                                                        "(privacy.clip_norm)")
    assert upload_problem({**shared, "b": torch.tensor([math.nan])}, (), anchor, None) == "its upload is not finite (b)"
    assert upload_problem(shared, ({"dc": torch.tensor([math.inf])},), anchor, None) == "its upload is not finite (dc)"
    assert non_finite({"i": torch.tensor([1]), "x": torch.tensor([1.0, -math.inf])}) == "x"


class Attacker(InProcessExecutor):
    """A runtime one of whose participants (the first of round ``round_idx``) does not send what its client
    computed: ``forge`` makes its upload from the honest one and the anchor; ``forge`` None makes it fail."""

    def __init__(self, host, round_idx: int, forge=None):
        super().__init__(host)
        self.round_idx, self.forge, self.victims = round_idx, forge, []

    def train(self, round_idx, jobs, message):
        for slot, out in super().train(round_idx, jobs, message):
            cid = jobs[slot][0]
            if round_idx == self.round_idx and slot == 0 and not isinstance(out, ClientFailure | ClientUnavailable):
                self.victims.append(cid)
                res, state = out
                out = (ClientFailure(cid, "RuntimeError: it failed", "") if self.forge is None else
                       (dataclasses.replace(res, shared=self.forge(res.shared, message.weights)), state))
            yield slot, out


def run(overrides, forge, logs=None):
    cfg = config_from_dict(BASE, list(overrides))
    setup = prepare(cfg)
    executor = Attacker(make_host(setup), 0, forge)
    fed = Federation(setup, executor, log=(logs.append if logs is not None else lambda s: None))
    records = [fed.step(r) for r in range(cfg.train.rounds)]
    return fed, records, executor.victims


FORGED = {
    "nan": ((), lambda shared, anchor: {k: torch.full_like(v, math.nan) for k, v in shared.items()}),
    "inf": ((), lambda shared, anchor: {**shared, next(iter(shared)): torch.full_like(next(iter(shared.values())),
                                                                                       math.inf)}),
    "1e30 under DP": (DP, lambda shared, anchor: {k: a + 1e30 for k, a in anchor.items()}),
    "unclipped under DP": (DP, lambda shared, anchor: {k: a + 10 * (shared[k] - a) + 0.1 for k, a in anchor.items()}),
}


@pytest.mark.parametrize("attack", list(FORGED))
def test_a_forged_upload_never_reaches_the_global_model(attack):
    overrides, forge = FORGED[attack]
    logs: list[str] = []
    attacked, records, victims = run(["runtime.max_failed_fraction=0.5", *overrides], forge, logs)
    failed, honest_records, _ = run(["runtime.max_failed_fraction=0.5", *overrides], None)
    assert len(victims) == 1 and records[0]["clients_failed"] == 1
    # Logged (under DP without the client's id: which clients were sampled stays secret).
    assert any("failed: UploadRefused: the server refused" in line for line in logs), logs
    for k, v in attacked.global_shared.items():
        assert torch.isfinite(v).all() and torch.equal(v, failed.global_shared[k]), k
    assert attacked.clients[victims[0]].rounds_trained == 0
    strip = ("seconds", "train_seconds")
    assert [{k: v for k, v in r.items() if k not in strip} for r in records] == [
        {k: v for k, v in r.items() if k not in strip} for r in honest_records]


class NonFiniteSum(InProcessExecutor):
    """A secure-sum runtime whose total came back with a NaN (a participant sent one inside its masked share)."""

    sums_only = True

    def train_sums(self, round_idx, jobs, message, request):
        total = {k: torch.full_like(v, math.nan, dtype=torch.float64) for k, v in message.weights.items()}
        none = WeightedSum(None, 0.0, 0)
        sums = RoundSums(WeightedSum(total, float(len(jobs)), len(jobs)), none, none, none)
        return SummedRound(sums, Losses(len(jobs), 1.0, None), [cid for cid, _ in jobs])


def test_a_secure_sum_that_is_not_finite_is_never_applied():
    setup = prepare(config_from_dict(BASE, ["train.head=none"]))
    fed = Federation(setup, NonFiniteSum(make_host(setup)), log=lambda s: None)
    before = {k: v.clone() for k, v in fed.global_shared.items()}
    with pytest.raises(RoundFailedError, match=r"round 1: the secure sum is not finite \(generic\."):
        fed.step(0)
    assert all(torch.equal(before[k], v) for k, v in fed.global_shared.items())


class Declines(InProcessExecutor):
    """A secure-sum runtime that declines round 1 (``RoundSkipped``) and sums the clients' results itself after."""

    sums_only = True

    def train_sums(self, round_idx, jobs, message, request):
        if round_idx == 0:
            raise RoundSkipped("round 1: its sampled clients sit on one node")
        generic, rest, uploads, clipped = (OrderedAverager(len(jobs)) for _ in range(4))
        for slot, (res, _state) in self.train(round_idx, jobs, message):
            generic.add(slot, {k: v for k, v in res.shared.items() if k in request.generic_keys}, res.num_samples)
            rest.add(slot, {k: v for k, v in res.shared.items() if k not in request.generic_keys}, res.num_samples)
            uploads.add(slot, res.upload, 1.0)
            clipped.skip(slot)
        sums = RoundSums(generic.sum(), rest.sum(), uploads.sum(), clipped.sum())
        return SummedRound(sums, Losses(len(jobs), 1.0, None), [cid for cid, _ in jobs])


def test_a_round_a_secure_sum_declines_changes_nothing_and_says_why():
    setup = prepare(config_from_dict(BASE, ["train.head=none", "train.rounds=2"]))
    logs: list[str] = []
    fed = Federation(setup, Declines(make_host(setup)), log=logs.append)
    before = {k: v.clone() for k, v in fed.global_shared.items()}
    record = fed.step(0)
    assert record["round_skipped"] == "round 1: its sampled clients sit on one node"
    assert "[round 1] not aggregated: round 1: its sampled clients sit on one node" in logs
    assert all(torch.equal(before[k], v) for k, v in fed.global_shared.items())
    assert all(state.rounds_trained == 0 for _, state in fed.clients.items())
    record = fed.step(1)  # the next round is summed and applied
    assert "round_skipped" not in record and record["clients_done"] == 3
    assert not all(torch.equal(before[k], v) for k, v in fed.global_shared.items())
