"""The in-process round loop: sampling, aggregation, evaluation, the PM cache, client failures."""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch
from safetensors import safe_open

from fedrod_ray.client_update.local import RoundInput
from fedrod_ray.clients.client import ClientState
from fedrod_ray.config import config_from_dict
from fedrod_ray.drivers.runner import run_local
from fedrod_ray.executors.in_process import InProcessExecutor
from fedrod_ray.federation_state.checkpoint import load_checkpoint, save_checkpoint
from fedrod_ray.federation_state.client_store import ClientStore
from fedrod_ray.federation_state.setup import make_host, prepare
from fedrod_ray.lifecycle.run import Run
from fedrod_ray.models.export import load_final
from fedrod_ray.models.metrics import class_correct, features_and_logits, personal_class_correct
from fedrod_ray.outputs.metric_schema import ESTIMATES
from fedrod_ray.outputs.storage import RunStorage
from fedrod_ray.round_loop.evaluation import _gm_counts, anchored, confidence_halfwidth, estimate_offset
from fedrod_ray.round_loop.federation import Federation, RoundFailedError
from fedrod_ray.server_math.aggregate import weighted_average
from fedrod_ray.server_math.server import sample_clients

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE = {
    "seed": 3,
    "data": {"dataset": "synthetic", "num_clients": 6, "new_clients": 2, "alpha": 0.3,
             "synthetic_train_per_class": 24, "synthetic_test_per_class": 10, "min_per_client": 4},
    "train": {"rounds": 2, "client_fraction": 0.5, "local_epochs": 1, "batch_size": 16},
}


def make_federation(*overrides, log=None):
    cfg = config_from_dict(BASE, list(overrides))
    setup = prepare(cfg)
    executor = InProcessExecutor(make_host(setup))
    return Federation(setup, executor, log=log or (lambda s: None))


def test_round_is_the_weighted_average_of_the_sampled_clients(tmp_path):
    fed = make_federation()
    start = {k: v.clone() for k, v in fed.global_shared.items()}
    ids = sample_clients(3, 0, fed.setup.num_clients, 0.5)

    # The same client updates, done by hand on a second host, then averaged by sample count.
    ref = make_federation()
    results = [ref.executor.host.train(cid, ClientState(), RoundInput(start), 0)[0] for cid in ids]
    expected = weighted_average([r.shared for r in results], [r.num_samples for r in results])

    record = fed.step(0)
    assert record["clients"] == len(ids) == record["clients_done"]
    assert record["clients_failed"] == 0
    for k, v in expected.items():
        assert torch.equal(fed.global_shared[k], v), k
    # The linear P-head never leaves the client.
    assert not any(k.startswith("personal_head") for k in fed.global_shared)


def test_evaluation_reports_train_and_new_clients(tmp_path):
    fed = make_federation()
    fed.step(0)
    metrics = fed.evaluate()
    for key in ("gfl_gm", "pfl_gm", "pfl_pm", "pfl_pm_global", "pfl_gm_new", "pfl_new_before"):
        assert 0.0 <= metrics[key] <= 1.0, key
    # A new client never trains; with a zero-initialised linear head its PM is exactly the GM.
    assert metrics["pfl_new_before"] == pytest.approx(metrics["pfl_gm_new"])
    assert "pfl_new_after" not in metrics and "pfl_ft" not in metrics


def test_ctrl_c_in_an_evaluation_waits_for_the_client_in_hand_not_for_every_client():
    """Ctrl-C while the executor's thread fine-tunes the new clients (a last round's evaluation) raises
    KeyboardInterrupt in the main thread, which scores the GM meanwhile: the evaluation ends once the client in
    hand is done, and the other clients never start."""
    fed = make_federation("data.new_clients=4", "eval.finetune_epochs=1")
    fed.step(0)
    host, evaluation = fed.executor.host, fed.evaluation
    adapted, started, cancelled = [], threading.Event(), threading.Event()
    adapt, cancel = host.method.adapt, host.cancel

    def adapt_until_cancelled(*args, **kwargs):
        adapted.append(threading.current_thread())
        if len(adapted) == 1:
            started.set()
            assert cancelled.wait(30), "the evaluation's calls were never cancelled"
        return adapt(*args, **kwargs)

    def cancel_and_say_so():
        cancel()
        cancelled.set()

    def ctrl_c_once_the_first_new_client_adapts(*args):
        assert started.wait(30)
        raise KeyboardInterrupt

    host.method.adapt, host.cancel = adapt_until_cancelled, cancel_and_say_so
    evaluation.generic_model = ctrl_c_once_the_first_new_client_adapts
    with pytest.raises(KeyboardInterrupt):
        fed.evaluate(final=True)
    assert len(adapted) == 1 and not adapted[0].is_alive()


class CountingExecutor(InProcessExecutor):
    """Records which clients each PM evaluation was asked for."""

    def __init__(self, host):
        super().__init__(host)
        self.asked: list[list[int]] = []

    def evaluate(self, jobs, estimate=False):
        self.asked.append([cid for cid, _ in jobs])
        return super().evaluate(jobs, estimate)


def test_pm_evaluation_runs_only_clients_that_trained_since_the_last(tmp_path):
    fed = make_federation("train.head=hyper", "train.rounds=5")  # no evaluation inside step()
    fed.executor = CountingExecutor(fed.executor.host)
    ids = [sample_clients(3, r, fed.setup.num_clients, 0.5) for r in range(2)]
    fed.step(0)
    fed.evaluate()
    fed.step(1)
    second = fed.evaluate()
    assert fed.executor.asked == [sorted(ids[0]), sorted(ids[1])]
    assert {c for c, st in fed.clients.items() if st.local_model is not None} == set(ids[0]) | set(ids[1])

    # A federation restored from the snapshot has no cached counts, evaluates every trained client, and
    # gets exactly the same metrics.
    fresh = make_federation("train.head=hyper", "train.rounds=5")
    fresh.executor = CountingExecutor(fresh.executor.host)
    fresh.restore(fed.snapshot())
    assert fresh.evaluate() == second
    assert fresh.executor.asked == [sorted(set(ids[0]) | set(ids[1]))]


@pytest.mark.parametrize("head", ["hyper", "linear", "none"])
def test_the_estimate_on_the_whole_test_set_is_the_exact_evaluation(head):
    # synthetic_test_per_class 10, 10 classes: a sample of 100 is the whole test set, in the same order.
    fed = make_federation(f"train.head={head}", "train.rounds=3", "eval.eval_every=2", "eval.estimate_size=100",
                          *(["train.balanced_loss=ce"] if head == "none" else []))
    for r in (0, 1, 2):
        record = fed.step(r)
        assert {"gfl_gm_est", "pfl_gm_est", "pfl_pm_est"} <= set(record)
        # Exact rounds (1: the estimate's first anchor; 2: eval_every; 3: the last) carry both, each computed
        # from its own counts.
        for key in ("gfl_gm", "pfl_gm", "pfl_pm"):
            assert record[f"{key}_est"] == record[key], (r, key)


class EstimateCountingExecutor(InProcessExecutor):
    """Records which clients each PM evaluation was asked for, and whether on the estimate's sample."""

    def __init__(self, host):
        super().__init__(host)
        self.asked: list[tuple[list[int], bool]] = []

    def evaluate(self, jobs, estimate=False):
        self.asked.append(([cid for cid, _ in jobs], estimate))
        return super().evaluate(jobs, estimate)


def test_the_estimate_is_a_fixed_class_balanced_sample_and_reads_only_changed_pms():
    overrides = ("train.head=hyper", "train.rounds=5", "eval.eval_every=5", "eval.estimate_size=30")
    fed = make_federation(*overrides)
    fed.executor = EstimateCountingExecutor(fed.executor.host)
    sample = fed.evaluation.estimate_test
    assert torch.bincount(sample.y, minlength=10).tolist() == [3] * 10
    ids = [sample_clients(3, r, fed.setup.num_clients, 0.5) for r in range(2)]
    records = [fed.step(0), fed.step(1)]
    # Round 1 is also evaluated exactly (the estimate's first anchor); round 2 only estimated.
    assert fed.executor.asked == [(sorted(ids[0]), True), (sorted(ids[0]), False), (sorted(ids[1]), True)]
    assert "pfl_pm" in records[0] and "pfl_pm" not in records[1]
    # The same run again gives the same estimates, bitwise.
    again = make_federation(*overrides)
    assert torch.equal(again.evaluation.estimate_test.x, sample.x)
    for r, record in enumerate(records):
        repeat = again.step(r)
        assert [repeat[k] for k in ESTIMATES] == [record[k] for k in ESTIMATES]


def test_offset_and_anchored_estimates_by_hand():
    sample = {"gfl_gm_est": 0.50, "pfl_gm_est": 0.25, "pfl_pm_est": 0.75}
    exact = {"gfl_gm": 0.625, "pfl_gm": 0.125, "pfl_pm": float("nan"), "round": 4}
    # pfl_pm had no PM to evaluate (NaN): no offset for it, so it stays the sample's.
    assert estimate_offset(exact, sample) == {"gfl_gm_est": 0.125, "pfl_gm_est": -0.125}
    later = {"gfl_gm_est": 0.5625, "pfl_gm_est": 0.375, "pfl_pm_est": 0.875}
    assert anchored(later, estimate_offset(exact, sample)) == {
        "gfl_gm_est": 0.6875, "pfl_gm_est": 0.25, "pfl_pm_est": 0.875}
    assert anchored(later, {}) == later  # before the first exact evaluation


def test_the_estimate_carries_the_last_exact_evaluations_offset_and_resumes_with_it(tmp_path):
    """Between exact rounds, an estimate is the sample's plus (exact - sample) of the last exact round:
    checked against a twin federation that trains the same and is evaluated exactly only at round 1 (the
    anchor every estimating run has) before the end; the offset survives a checkpoint."""
    sized = ("train.rounds=5", "eval.estimate_size=30")
    fed, twin = make_federation(*sized, "eval.eval_every=2"), make_federation(*sized, "eval.eval_every=4")
    records, raw, first = [], [], {}
    for r in range(3):
        records.append(fed.step(r))
        raw.append(twin.step(r))
        if r == 0:
            first = dict(fed.estimate_offset)
    assert ["gfl_gm" in record for record in records] == [True, True, False]
    assert ["gfl_gm" in record for record in raw] == [True, False, False]
    assert first == twin.estimate_offset and any(abs(v) > 0.01 for v in first.values())  # the test can fail
    # Round 2: the sample's value is the twin's estimate less round 1's offset; the exact minus it is the
    # offset that round 3 carries.
    offset = {k: records[1][k.removesuffix("_est")] - (raw[1][k] - first[k]) for k in first}
    for k in first:
        assert records[0][k] == raw[0][k] == pytest.approx(records[0][k.removesuffix("_est")], abs=1e-12)
        assert records[1][k] == pytest.approx(records[1][k.removesuffix("_est")], abs=1e-12)
        assert records[2][k] == pytest.approx(raw[2][k] - first[k] + offset[k], abs=1e-12)

    save_checkpoint(RunStorage(str(tmp_path)), fed.snapshot())
    resumed = make_federation(*sized, "eval.eval_every=2")
    resumed.restore(load_checkpoint(RunStorage(str(tmp_path))))
    assert resumed.estimate_offset == fed.estimate_offset
    assert fed.estimate_offset == pytest.approx(offset, abs=1e-12)
    after = [resumed.step(3), fed.step(3)]
    assert [{k: v for k, v in record.items() if not k.endswith("seconds")} for record in after] == [
        {k: v for k, v in after[1].items() if not k.endswith("seconds")}] * 2


def test_an_estimate_larger_than_the_test_set_allows_names_the_setting():
    with pytest.raises(ValueError, match=r"eval\.estimate_size=101 asks for 11 test images of class 0"):
        make_federation("train.rounds=3", "eval.eval_every=2", "eval.estimate_size=101")


@pytest.mark.parametrize("head", ["hyper", "linear", "none"])
def test_global_reading_pm_is_the_global_model_with_the_clients_own_head(head):
    """Scored from one pass of the GM over the test set: the same counts, on the classes the client has,
    as the global weights with the client's head evaluated alone (phi_m, H(a_m; nu), or the GM itself),
    for trained clients, untrained ones and new ones."""
    fed = make_federation(f"train.head={head}", *(["train.balanced_loss=ce"] if head == "none" else []))
    fed.step(0)
    untrained = [c for c, st in fed.clients.items() if st.local_model is None]
    assert untrained and len(untrained) < len(fed.clients)
    fed.model.load_partial(fed.global_shared)
    z, logits = features_and_logits(fed.model, fed.setup.test, 7)
    correct, total = class_correct(logits.argmax(1), fed.setup.test.y, fed.setup.test.num_classes)
    ids = fed.setup.all_client_ids
    gm = _gm_counts(logits.argmax(1), fed.setup.test, ids, correct, total)
    counts = fed.evaluation._global_reading_pms(fed.clients, ids, fed.global_shared, fed.global_shared, z, logits,
                                                gm, fed.setup.test).correct
    for cid, state in fed.clients.items():
        model = fed.setup.build_model()
        model.load_partial(fed.global_shared)
        if state.personal is not None:
            model.load_partial(state.personal)
        dist = fed.setup.class_dists[cid].to(torch.float32)
        own_correct, own_total = personal_class_correct(model, fed.setup.test, dist, 7, head != "none")
        has = dist > 0
        assert torch.equal(counts[cid][has], own_correct[has]), cid
        assert torch.equal(total[has], own_total[has]), cid
    if head == "linear":  # the trained clients' heads were used, and they are not the zeros of the GM
        assert all(fed.clients[c].personal["personal_head.weight"].abs().sum() > 0
                   for c in fed.clients if c not in untrained)


def test_failed_client_is_reported_and_skipped():
    logs: list[str] = []
    fed = make_federation("runtime.max_failed_fraction=0.5", log=logs.append)
    bad = sample_clients(3, 0, fed.setup.num_clients, 0.5)[0]
    fed.clients[bad] = ClientState(personal={"personal_head.weight": torch.zeros(1, 1)})
    record = fed.step(0)
    assert record["clients_failed"] == 1 and record["failed_ids"] == [bad]
    assert record["clients_done"] == record["clients"] - 1
    assert any(f"client {bad} failed" in line and "Traceback" in line for line in logs)
    # Its broken state cannot be evaluated either: reported and left out, the others still count.
    assert record["pm_eval_failed"] == 1 and 0 <= record["pfl_pm"] <= 1
    assert any(f"client {bad}: personalized model not evaluated" in line for line in logs)


def test_too_many_failures_stop_the_run_with_a_clear_message():
    fed = make_federation("runtime.max_failed_fraction=0.0")
    before = {k: v.clone() for k, v in fed.global_shared.items()}
    bad = sample_clients(3, 0, fed.setup.num_clients, 0.5)[0]
    fed.clients[bad] = ClientState(personal={"personal_head.weight": torch.zeros(1, 1)})
    with pytest.raises(RoundFailedError, match=rf"clients {bad}\b.*max_failed_fraction=0.0"):
        fed.step(0)
    # The server did not take the failed round.
    assert fed.next_round == 0
    assert all(torch.equal(before[k], v) for k, v in fed.global_shared.items())


def test_step_takes_only_the_next_round():
    fed = make_federation()
    with pytest.raises(ValueError, match="next round is 0"):
        fed.step(1)
    fed.step(0)
    with pytest.raises(ValueError, match="next round is 1"):
        fed.step(0)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("overrides", [
    ("train.generic_rule=feddyn", "train.rule_params={alpha: 0.1}"),
    ("train.generic_rule=scaffold", "train.head=hyper"),
    ("train.generic_rule=feddyn", "train.head=hyper", "train.momentum_buffers=keep"),
], ids=["feddyn-linear", "scaffold-hyper", "feddyn-hyper-keep"])
def test_snapshot_restore_continues_bitwise(overrides):
    """A federation restored from a snapshot continues exactly as the original: global weights, the
    rule's server state and every client's state (including the rule's per-client state)."""
    a = make_federation(*overrides, "train.rounds=4")
    a.step(0)
    a.step(1)
    snap = a.snapshot()
    assert snap.rounds_done == 2
    assert snap.server_state and any(st.rule_state for st in snap.clients.values())
    b = make_federation(*overrides, "train.rounds=4")
    b.restore(snap)
    assert b.next_round == 2
    for r in (2, 3):
        ra, rb = a.step(r), b.step(r)
        assert {k: v for k, v in ra.items() if "seconds" not in k} == {k: v for k, v in rb.items() if "seconds" not in k}
    assert _same(a.global_shared, b.global_shared)
    assert _same(a.server_state, b.server_state)
    sa, sb = a.clients, b.clients
    for cid in sa:
        assert sa[cid].rounds_trained == sb[cid].rounds_trained
        assert _same(sa[cid].tensors(), sb[cid].tensors()), cid


def test_a_run_resumed_from_its_checkpoint_continues_bitwise_keeping_momentum(tmp_path):
    """train.momentum_buffers=keep: the clients' buffers go through the checkpoint's files (safetensors,
    contiguous) and the resumed federation trains on to the same bits as the uninterrupted one."""
    overrides = ("train.head=linear", "train.momentum_buffers=keep", "train.rounds=4")
    a = make_federation(*overrides)
    a.step(0)
    a.step(1)
    storage = RunStorage(str(tmp_path))
    save_checkpoint(storage, a.snapshot())
    snap = load_checkpoint(storage)
    assert any(st.momentum for st in snap.clients.values())
    b = make_federation(*overrides)
    b.restore(snap)
    for r in (2, 3):
        ra, rb = a.step(r), b.step(r)
        assert {k: v for k, v in ra.items() if "seconds" not in k} == {k: v for k, v in rb.items() if "seconds" not in k}
    assert _same(a.global_shared, b.global_shared)
    # Buffers continued from the checkpoint: some client trained both before and after it.
    assert any(st.rounds_trained > snap.clients[cid].rounds_trained > 0 for cid, st in a.clients.items())
    for cid, st in a.clients.items():
        assert st.rounds_trained == b.clients[cid].rounds_trained
        assert _same(st.tensors(), b.clients[cid].tensors()), cid


def test_run_local_writes_every_result_file(tmp_path):
    cfg = config_from_dict(BASE, ["train.head=none", "train.balanced_loss=ce"])
    records = run_local(cfg, RunStorage(str(tmp_path)), log=lambda s: None)
    last = records[-1]
    assert last["round"] == 2 and "gfl_gm" in last
    for name in ("config.yaml", "metrics.jsonl", "metrics.csv", "curves.png", "checkpoints/latest",
                 "final/model.safetensors", "final/meta.json"):
        assert (tmp_path / name).is_file(), name
    assert [json.loads(line)["round"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    served = load_final(str(tmp_path))
    assert served.meta.head == "none" and served.meta.rule == "fedavg" and served.meta.num_classes == 10
    assert served.meta.round == 2 and served.meta.metrics["gfl_gm"] == last["gfl_gm"]
    assert served.personal_heads == {}


def test_confidence_halfwidth_by_hand():
    # Values 0.5, 0.7, 0.9: sample sd 0.2; 95% half-width 1.96 * 0.2 / sqrt(3), times sqrt((10 - 3) / (10 - 1)).
    assert confidence_halfwidth([0.5, 0.7, 0.9], 10) == pytest.approx(1.96 * 0.2 / 3**0.5 * (7 / 9) ** 0.5)
    assert confidence_halfwidth([0.5, 0.7, 0.9], 3) == 0.0  # the whole population: exact
    assert math.isnan(confidence_halfwidth([0.5], 10))


def test_evaluation_by_a_sample_of_clients_scores_only_them_with_intervals():
    """eval.clients: a seeded sample of the training clients, the same every evaluation and on every run; its
    PMs alone are evaluated, and each P-FL mean comes with its 95% half-width."""
    fed = make_federation("eval.clients=4", "train.client_fraction=1.0")
    fed.executor = EstimateCountingExecutor(fed.executor.host)
    sample = fed.evaluation.client_ids
    assert len([c for c in sample if c < 6]) == 4 and sample[4:] == [6, 7]  # and every new client
    assert sample == make_federation("eval.clients=4").evaluation.client_ids
    record = fed.step(0)
    assert fed.executor.asked == [(sample[:4], False)]
    assert all(record[f"{k}_ci"] >= 0 for k in ("pfl_gm", "pfl_pm", "pfl_pm_global"))
    full = make_federation("train.client_fraction=1.0").step(0)
    assert not any(k.endswith("_ci") for k in full) and full["gfl_gm"] == record["gfl_gm"]


def test_a_run_can_skip_the_evaluation_after_its_last_round():
    fed = make_federation("train.rounds=3", "eval.eval_every=2", "eval.at_end=false")
    records = [fed.step(r) for r in range(3)]
    assert ["gfl_gm" in record for record in records] == [False, True, False]


def _records(records: list[dict]) -> str:
    # As JSON: a reading a method has not is NaN in both, which == would call different.
    return json.dumps([{k: v for k, v in r.items() if "seconds" not in k} for r in records])


def _same_clients(a, b) -> None:
    assert list(a) == list(b)
    for cid in a:
        assert a[cid].rounds_trained == b[cid].rounds_trained, cid
        assert _same(a[cid].tensors(), b[cid].tensors()), cid


@pytest.mark.parametrize("overrides", [
    ("train.generic_rule=feddyn", "train.momentum_buffers=keep", "train.momentum=0.5", "eval.finetune_epochs=1"),
    ("train.generic_rule=scaffold", "train.head=hyper", "eval.finetune_epochs=1"),
    ("train.head=fedfomo", "train.balanced_loss=ce"),
    ("train.head=mtl", "train.balanced_loss=ce"),
    ("train.head=perfedavg", "train.balanced_loss=ce", "train.momentum=0", "train.weight_decay=0"),
    ("rounds.mode=fedbuff", "rounds.buffer_size=2", "rounds.concurrency=4"),
    ("privacy.enabled=true", "privacy.noise_multiplier=0.5", "train.head=hyper", "privacy.noise_seed=1"),
], ids=["feddyn-linear-keep", "scaffold-hyper", "fedfomo", "mtl", "perfedavg", "fedbuff", "dp"])
@pytest.mark.parametrize("cache", [0, 1])
def test_a_tiny_client_cache_trains_and_evaluates_bitwise_as_all_in_memory(overrides, cache):
    """runtime.client_cache: with at most `cache` states in memory between rounds (the rest read back from
    the store's files), every record, the global weights and every client's state are those of the run that
    keeps them all in memory."""
    common = (*overrides, "train.rounds=4", "eval.clients=5")
    ref = make_federation(*common)
    fed = make_federation(*common, f"runtime.client_cache={cache}")
    expected, records = [], []
    for r in range(4):
        expected.append(ref.step(r))
        records.append(fed.step(r))
        assert fed.clients.in_memory <= cache
    assert _records(records) == _records(expected)
    assert _same(fed.global_shared, ref.global_shared)
    assert sum(st.rounds_trained > 0 for st in ref.clients.values()) > cache
    _same_clients(fed.clients, ref.clients)
    assert fed.clients.in_memory <= cache


def test_the_client_store_keeps_at_most_its_bound_and_a_client_that_never_trained_costs_no_entry(tmp_path):
    store = ClientStore(50, 3, RunStorage(str(tmp_path)))
    states = {cid: ClientState(local_model={"w": torch.full((4,), float(cid))}, rounds_trained=1)
              for cid in range(0, 50, 5)}
    for cid, state in states.items():
        store[cid] = state
        assert store.in_memory <= 3
    for cid in [*states, *states]:  # every read brings one back, pushing the oldest out
        assert torch.equal(store[cid].local_model["w"], states[cid].local_model["w"])
        assert store.in_memory <= 3
    assert store[1] == ClientState() and store.rounds_trained(1) == 0 and not store.has_model(1)
    assert len(store.snapshot().entries) == len(states)  # none for the clients that never trained
    with pytest.raises(KeyError):
        store[50]


@pytest.mark.parametrize("cache", [1, 1000])
def test_a_run_with_the_client_store_resumes_from_its_checkpoint_bitwise(tmp_path, cache):
    """A run stopped after round 2 and resumed from its checkpoint ends with the records, weights and client
    states of the uninterrupted run, its clients' states read from the checkpoint's files."""
    overrides = ["train.rounds=4", "train.client_fraction=0.5", "train.head=hyper", "runtime.torch_threads=1"]
    if cache < 6:
        overrides.append(f"runtime.client_cache={cache}")
    full, part = RunStorage(str(tmp_path / "full")), RunStorage(str(tmp_path / "part"))
    records = run_local(config_from_dict(BASE, overrides), full, log=lambda s: None)
    run_local(config_from_dict(BASE, [*overrides, "train.rounds=2"]), part, log=lambda s: None)
    resumed = run_local(config_from_dict(BASE, overrides), part, load_checkpoint(part), log=lambda s: None)
    assert _records(resumed) == _records(records)
    a, b = load_checkpoint(full), load_checkpoint(part)
    assert _same(a.global_shared, b.global_shared)
    _same_clients(a.clients, b.clients)


def test_each_state_is_written_once_by_the_client_store_or_by_a_checkpoint(tmp_path):
    """With a cache of two states and three clients a round, one of a round's states goes to the store's files
    as the round commits and the others into the round's checkpoint (no evaluation reads the clients in
    between), which the store then reads from: no version of a client's state is ever in two files."""
    storage = RunStorage(str(tmp_path))
    fed = make_federation("train.rounds=4", "train.client_fraction=0.5", "runtime.client_cache=2",
                          "eval.eval_every=2")
    run = Run(fed, storage)
    for _ in range(4):
        run.round()
        run.saves.wait()
        files = [_file_clients(storage, name) for name in storage.list_files("checkpoints/clients")]
        assert len(files) > 1
        for cid in fed.clients:
            # Its versions are its rounds trained (superseded ones stay while a kept checkpoint names them).
            assert sum(cid in held for held in files) <= fed.clients.rounds_trained(cid), cid
    run.finish()


def _file_clients(storage: RunStorage, name: str) -> set[int]:
    with safe_open(storage.path("checkpoints/clients", name), framework="pt") as f:
        return {int(k.split("/")[0]) for k in f.keys()}  # noqa: SIM118 - safe_open is no dict
