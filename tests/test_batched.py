"""The batched local update (many clients in one pass) against local_update run per client.

Tolerance: the batched pass sums in another order (grouped convolutions, per-example loss weights), so
its results equal local_update's up to float32 rounding, about 1e-8 on these weights; ATOL = 1e-5 leaves
room for another CPU's kernels. Images with flat regions (shifted by augmentation, or synthetic digits on
a blank ground) make near-ties in max-pooling windows, and a tie resolved the other way under that
rounding sends one gradient to another pixel: about 1e-5 on one first-layer filter in the augmented case
here, hence AUG_ATOL = 2e-4 there, still far below the updates (about 1e-2). Over several epochs such
flips compound: two epochs of the Federation below differ by 4e-5 after a round, exactly as much as the
one-client-at-a-time run differs from itself with contiguous instead of channels_last weights and 2 torch
threads instead of 1, so that test runs one epoch per round. (In float64 the two paths agree to 1e-8 even
after 5 epochs on MNIST, where float32 drifts apart by up to 4e-2: bench/batched_round.py.)
"""

from __future__ import annotations

import pytest
import torch
from tiny import MEAN, STD, make_data, model_and_global

from fedrod_ray.algorithms import RULES, build_rule
from fedrod_ray.client_update.batched import BatchJob, batched_local_update
from fedrod_ray.client_update.local import (
    ClientData,
    ClientStart,
    LocalTrainingError,
    RoundInput,
    UpdateContext,
    local_update,
)
from fedrod_ray.client_update.losses import BALANCED_LOSSES
from fedrod_ray.clients.client import ClientFailure, ClientState
from fedrod_ray.config import ConfigError, TrainConfig, config_from_dict
from fedrod_ray.executors.batched import BatchedExecutor
from fedrod_ray.executors.in_process import InProcessExecutor
from fedrod_ray.executors.runtimes import runtime_of
from fedrod_ray.federation_state.setup import make_host, prepare
from fedrod_ray.round_loop.federation import Federation

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ATOL, AUG_ATOL = 1e-5, 2e-4
SEED, ROUND = 11, 1
# Batch 10: 3, 1, 4 and 2 steps per epoch, last batches of 4, 9, 5 and 10 examples.
SIZES = (24, 9, 35, 20)
GENERIC = ("body.", "generic_head.")


def train_cfg(head="linear", **kw) -> TrainConfig:
    base = {"head": head, "local_epochs": 2, "batch_size": 10, "lr": 0.05, "lr_decay": 0.9, "momentum": 0.9,
            "weight_decay": 1e-3}
    return TrainConfig(**(base | kw))


def random_like(t: torch.Tensor, seed: int, scale: float = 0.1) -> torch.Tensor:
    return torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)) * scale


def make_jobs(variant, shared, rule_name, sizes=SIZES) -> list[BatchJob]:
    """Clients of different sizes; every other one with a P-head, a rule state and its own starting model
    of its own (the others start fresh), so both kinds share a pass."""
    generic = {k: v for k, v in shared.items() if k.startswith(GENERIC)}
    jobs = []
    for i, n in enumerate(sizes):
        job = BatchJob(20 + i, make_data(seed=i, n=n))
        if i % 2:
            if variant == "linear":
                job.personal = {"personal_head.weight": random_like(torch.zeros(10, 50), 100 + i)}
            if rule_name in ("scaffold", "feddyn"):
                job.rule_state = {k: random_like(v, 200 + i, 0.01) for k, v in generic.items()}
            job.initial = {k: v + random_like(v, 300 + i, 0.01) for k, v in shared.items()}
        jobs.append(job)
    return jobs


def message_for(rule, shared) -> RoundInput:
    generic = {k: v for k, v in shared.items() if k.startswith(GENERIC)}
    server = {k: random_like(v, 7, 0.01) for k, v in rule.init_server_state(generic).items()}
    return RoundInput(shared, rule.broadcast(server))


def sequential(variant, message, jobs, cfg, rule, augment):
    out = []
    for job in jobs:
        model, _ = model_and_global(variant)
        try:
            out.append(local_update(model, message, job.data,
                                    UpdateContext(cfg, rule, ROUND, SEED, job.client_id, MEAN, STD, augment),
                                    ClientStart(job.personal, job.rule_state,
                                                job.initial if rule.starts_from_local_model else None,
                                                momentum=job.momentum)))
        except LocalTrainingError as e:
            out.append(e)
    return out


def assert_same(got, expected, atol):
    """One client's (result, P-head, rule state) from both paths."""
    (res, personal, state), (ref, ref_personal, ref_state) = got, expected
    assert (res.steps, res.num_samples) == (ref.steps, ref.num_samples)
    assert res.loss == pytest.approx(ref.loss, rel=1e-5, abs=1e-6)
    if ref.personal_loss is None:
        assert res.personal_loss is None
    else:
        assert res.personal_loss == pytest.approx(ref.personal_loss, rel=1e-5, abs=1e-6)
    for name, a, b in (("shared", res.shared, ref.shared), ("personal", personal or {}, ref_personal or {}),
                       ("rule state", state, ref_state), ("upload", res.upload, ref.upload),
                       ("momentum", res.momentum, ref.momentum)):
        assert a.keys() == b.keys(), name
        for k in b:
            assert a[k].device.type == "cpu"
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=f"{name} {k}")


def run_both(variant, rule_name, augment=False, sizes=SIZES, **cfg_kw):
    cfg = train_cfg("none" if variant is None else variant, generic_rule=rule_name, **cfg_kw)
    rule = build_rule(rule_name)
    model, shared = model_and_global(variant)
    message = message_for(rule, shared)
    jobs = make_jobs(variant, shared, rule_name, sizes)
    if not rule.starts_from_local_model:
        for job in jobs:
            job.initial = None
    if cfg.momentum_buffers == "keep":
        # Every other client continues buffers of its own; the others start theirs at zero.
        for i, job in enumerate(jobs[1::2]):
            job.momentum = {k: random_like(p.detach(), 400 + i) for k, p in model.named_parameters()}
    got = batched_local_update(model, message, jobs, cfg, rule, round_idx=ROUND, seed=SEED, mean=MEAN, std=STD,
                               augment=augment)
    return got, sequential(variant, message, jobs, cfg, rule, augment), shared


@pytest.mark.parametrize(("variant", "rule_name"), [(None, "fedavg"), ("linear", "scaffold"), ("hyper", "feddyn"),
                                                    ("linear", "fedavg")])
def test_batched_equals_per_client_updates(variant, rule_name):
    got, expected, shared = run_both(variant, rule_name)
    assert len(got) == len(expected) == len(SIZES)
    for g, e in zip(got, expected):
        assert_same(g, e, ATOL)
    # Not trivially equal: every client moved, each its own way.
    moved = [g[0].shared["generic_head.weight"] - shared["generic_head.weight"] for g in got]
    assert all(m.abs().max() > 1e-3 for m in moved)
    assert not torch.allclose(moved[0], moved[2])
    if rule_name in ("scaffold", "feddyn"):
        assert all(g[2] for g in got)  # a new rule state for every client


@pytest.mark.parametrize(("variant", "rule_name"), [("linear", "fedavg"), ("hyper", "feddyn"), (None, "local")])
def test_batched_equals_per_client_updates_keeping_momentum_buffers(variant, rule_name):
    """train.momentum_buffers: keep, with clients that kept buffers and clients that start at zero in one
    pass: the same weights and the same buffers to keep (of every parameter) as one client at a time."""
    got, expected, _ = run_both(variant, rule_name, momentum_buffers="keep")
    model, _ = model_and_global(variant)
    for g, e in zip(got, expected):
        assert_same(g, e, ATOL)
        assert set(g[0].momentum) == {k for k, _ in model.named_parameters()}


def test_batched_equals_per_client_updates_with_augmentation():
    got, expected, _ = run_both("linear", "scaffold", augment=True)
    for g, e in zip(got, expected):
        assert_same(g, e, AUG_ATOL)


@pytest.mark.parametrize("rule_name", sorted(RULES))
def test_every_rule_works_batched(rule_name):
    """Holds every registered rule to what the batched pass assumes of its correction (elementwise over
    stacked clients, no state between steps): a new rule is checked here without a test of its own."""
    got, expected, _ = run_both("linear", rule_name, sizes=(24, 9, 20), local_epochs=1)
    for g, e in zip(got, expected):
        assert_same(g, e, ATOL)


@pytest.mark.parametrize("loss", sorted(BALANCED_LOSSES))
def test_every_balanced_loss_works_batched(loss):
    """Padded batches weigh each example on its own: right for every loss that is a mean of per-example
    terms, as each of losses.py is."""
    got, expected, _ = run_both(None, "fedavg", sizes=(24, 9), local_epochs=1, balanced_loss=loss)
    for g, e in zip(got, expected):
        assert_same(g, e, ATOL)


def test_a_failing_client_fails_alone():
    """No examples, a rule state of the wrong shape, a non-finite loss: that client's own error, as its own
    update would raise it; the others train as if it were not there."""
    cfg = train_cfg("linear", generic_rule="feddyn", local_epochs=1)
    rule = build_rule("feddyn")
    model, shared = model_and_global("linear")
    message = message_for(rule, shared)
    jobs = make_jobs("linear", shared, "feddyn", sizes=(24, 20, 7, 35))
    for job in jobs:
        job.initial = None
    empty = make_data(n=0)
    jobs[0].data = ClientData(empty.x, empty.y, torch.zeros(10, dtype=torch.long))
    jobs[1].rule_state = {"generic_head.weight": torch.zeros(3)}
    jobs[2].personal = {"personal_head.weight": torch.full((10, 50), float("inf"))}
    got = batched_local_update(model, message, jobs, cfg, rule, round_idx=ROUND, seed=SEED, mean=MEAN, std=STD,
                               augment=False)
    assert isinstance(got[0], LocalTrainingError) and "no training examples" in str(got[0])
    assert isinstance(got[1], ValueError) and "generic_head.weight" in str(got[1])
    assert isinstance(got[2], LocalTrainingError) and "non-finite loss in local epoch 1" in str(got[2])
    expected = sequential("linear", message, jobs[2:], cfg, rule, False)
    assert isinstance(expected[0], LocalTrainingError) and str(expected[0]) == str(got[2])
    assert_same(got[3], expected[1], ATOL)


BASE = {
    "seed": 3,
    "data": {"dataset": "synthetic", "num_clients": 6, "alpha": 0.3, "synthetic_train_per_class": 24,
             "synthetic_test_per_class": 10, "min_per_client": 4},
    "train": {"rounds": 2, "client_fraction": 0.7, "local_epochs": 1, "batch_size": 16, "head": "hyper",
              "generic_rule": "scaffold"},
}


def test_federation_round_batched_equals_in_process():
    """A round of a Federation with the batched executor (groups of at most 2 clients) against the
    in-process one: the same records, global weights, server state and client states."""
    cfg = config_from_dict(BASE, ["runtime.batched_clients=2"])
    assert cfg.runtime.mode == "local"
    setup = prepare(cfg)
    batched = Federation(setup, runtime_of(cfg).start(setup)[1], log=print)
    plain = Federation(setup, InProcessExecutor(make_host(setup)), log=print)
    assert isinstance(batched.executor, BatchedExecutor) and type(plain.executor) is InProcessExecutor
    for r in range(2):
        a, b = batched.step(r), plain.step(r)
        assert a["clients_done"] == b["clients_done"] == a["clients"] > 2
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert a["gfl_gm"] == pytest.approx(b["gfl_gm"], abs=0.02)
    for part_a, part_b in ((batched.global_shared, plain.global_shared), (batched.server_state, plain.server_state)):
        assert part_a.keys() == part_b.keys()
        for k in part_b:
            torch.testing.assert_close(part_a[k], part_b[k], rtol=0, atol=ATOL)
    for cid, state in plain.clients.items():
        mine = batched.clients[cid]
        assert mine.rounds_trained == state.rounds_trained
        assert mine.tensors().keys() == state.tensors().keys()
        for k, v in state.tensors().items():
            torch.testing.assert_close(mine.tensors()[k], v, rtol=0, atol=ATOL)


def test_federation_rounds_keeping_momentum_batched_equal_in_process():
    """train.momentum_buffers=keep through both executors: each round's clients continue the buffers they
    kept, and both give the same weights and states. Each round starts both federations from the
    in-process one's state: the rounding differences of a round, carried in a client's buffers into a
    longer trajectory, can flip a max-pooling tie in a later round (a 1e-7 change of client 1's
    start weights moves its round-2 ones by 1e-2 here), which would compare chaos, not the two paths. Within
    a round such a tie moves one filter by about 1e-5 (1.01e-5 seen on an AVX2 CPU): AUG_ATOL, as above."""
    cfg = config_from_dict(BASE, ["runtime.batched_clients=2", "train.generic_rule=fedavg",
                                  "train.momentum_buffers=keep"])
    setup = prepare(cfg)
    batched = Federation(setup, runtime_of(cfg).start(setup)[1], log=print)
    plain = Federation(setup, InProcessExecutor(make_host(setup)), log=print)
    for r in range(2):
        batched.restore(plain.snapshot())
        a, b = batched.step(r), plain.step(r)
        assert a["clients_done"] == b["clients_done"] == a["clients"] > 2
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert batched.global_shared.keys() == plain.global_shared.keys()
        for k, v in plain.global_shared.items():
            torch.testing.assert_close(batched.global_shared[k], v, rtol=0, atol=AUG_ATOL)
        for cid, state in plain.clients.items():
            mine = batched.clients[cid]
            assert mine.rounds_trained == state.rounds_trained
            assert mine.tensors().keys() == state.tensors().keys()
            for k, v in state.tensors().items():
                torch.testing.assert_close(mine.tensors()[k], v, rtol=0, atol=AUG_ATOL)
    # Round 2 continued kept buffers: some client trained in both rounds, and every trained client keeps
    # a buffer per parameter.
    assert any(st.rounds_trained == 2 for st in plain.clients.values())
    params = {k for k, _ in batched.model.named_parameters()}
    assert all(set(st.momentum) == params for st in plain.clients.values() if st.rounds_trained)


def test_executor_reports_a_client_it_cannot_train():
    cfg = config_from_dict(BASE, ["runtime.batched_clients=4"])
    setup = prepare(cfg)
    executor = runtime_of(cfg).start(setup)[1]
    bad = ClientState(rule_state={"generic_head.weight": torch.zeros(2)})
    message = RoundInput(Federation(setup, executor).global_shared, {})
    out = dict(executor.train(0, [(0, ClientState()), (1, bad), (2, ClientState())], message))
    assert sorted(out) == [0, 1, 2]
    assert isinstance(out[1], ClientFailure) and out[1].client_id == 1 and "ValueError" in out[1].error
    for slot in (0, 2):
        result, state = out[slot]
        assert state.rounds_trained == 1 and state.local_model is result.shared


def test_config_switch():
    assert config_from_dict(BASE).runtime.batched_clients == 0
    with pytest.raises(ConfigError, match="runtime.batched_clients: must be >= 0"):
        config_from_dict(BASE, ["runtime.batched_clients=-1"])
    with pytest.raises(ConfigError, match="runtime.batched_clients: has no effect with runtime.mode=ray"):
        config_from_dict(BASE, ["runtime.batched_clients=4", "runtime.mode=ray"])


def test_meta_bsm_and_compiled_step_are_refused():
    with pytest.raises(ConfigError, match="train.step: compiled has no effect with runtime.batched_clients"):
        config_from_dict(BASE, ["runtime.batched_clients=4", "train.step=compiled"])
    with pytest.raises(ConfigError, match="runtime.batched_clients: .*meta_bsm"):
        config_from_dict(BASE, ["runtime.batched_clients=4", "train.balanced_loss=meta_bsm"])
