"""Round modes on the virtual clock (``rounds``, docs/rounds.md): the clock's and FedBuff's pure math on tiny
hand-computed inputs, the event queue, the config's checks, and the round loop in each mode, resumed bitwise."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_federation import BASE, _same, make_federation

from fedrod_ray.client_update.local import RoundInput
from fedrod_ray.clients.client import ClientState
from fedrod_ray.config import ConfigError, config_from_dict
from fedrod_ray.executors.ray import RayExecutor, plan_layout
from fedrod_ray.federation_state.buffered_rounds import BufferedRounds
from fedrod_ray.federation_state.checkpoint import load_checkpoint, save_checkpoint
from fedrod_ray.federation_state.setup import prepare
from fedrod_ray.federation_state.state import Arrival
from fedrod_ray.outputs.storage import RunStorage
from fedrod_ray.round_loop.federation import Federation
from fedrod_ray.server_math.buffered import buffered_update, next_arrival, pick_client, staleness_weight
from fedrod_ray.server_math.server import clients_per_round, sample_clients, sample_count
from fedrod_ray.timing.clock import (
    client_speeds,
    communication_seconds,
    deadline_round,
    durations,
    over_selected,
    read_trace,
)

# --- the clock ----------------------------------------------------------------------------------------------


def test_speeds_by_distribution():
    assert client_speeds("constant", 3, 0, 50.0, 1.0, 1.5).tolist() == [50.0, 50.0, 50.0]
    # lognormal: the median is ``speed``; the same seed, the same speeds.
    lognormal = client_speeds("lognormal", 20001, 7, 100.0, 1.0, 1.5)
    assert np.median(lognormal) == pytest.approx(100.0, rel=0.05)
    assert np.array_equal(lognormal, client_speeds("lognormal", 20001, 7, 100.0, 1.0, 1.5))
    assert not np.array_equal(lognormal, client_speeds("lognormal", 20001, 8, 100.0, 1.0, 1.5))
    # pareto: ``speed`` is the fastest; P(slowdown > x) = x^-shape: a quarter are over twice as slow at shape 2.
    pareto = client_speeds("pareto", 20000, 7, 100.0, 1.0, 2.0)
    assert pareto.max() <= 100.0
    assert np.mean(100.0 / pareto > 2.0) == pytest.approx(0.25, abs=0.02)
    # trace: cycled over the clients.
    assert client_speeds("trace", 5, 0, 1.0, 1.0, 1.0, np.array([1.0, 2.0])).tolist() == [1.0, 2.0, 1.0, 2.0, 1.0]


def test_a_trace_file_is_one_speed_a_line(tmp_path):
    path = tmp_path / "speeds.txt"
    path.write_text("# device speeds\n12.5\n\n40\n")
    assert read_trace(str(path)).tolist() == [12.5, 40.0]
    path.write_text("12.5\n-1\n")
    with pytest.raises(ValueError, match="positive"):
        read_trace(str(path))


def test_durations_are_work_over_speed_plus_the_round_trip():
    # 4 MB at 2 MB/s each way: 4 s; 30 examples x 2 epochs at 20 examples/s: 3 s.
    comm = communication_seconds(4_000_000, 2.0)
    assert comm == 4.0 and communication_seconds(4_000_000, None) == 0.0
    assert durations(np.array([20.0, 60.0]), np.array([30, 30]), 2, comm).tolist() == [7.0, 5.0]


def test_over_selection_rounds_up_and_caps_at_every_client():
    assert over_selected(10, 0.3, 100) == 13  # not 14: 1.3 * 10 is 13.000000000000002 in floats
    assert over_selected(10, 0.25, 100) == 13
    assert over_selected(10, 0.0, 100) == 10
    assert over_selected(10, 1.0, 15) == 15


def test_deadline_keeps_the_clients_in_time():
    # Two miss it: the round closes at the deadline.
    assert deadline_round(np.array([3.0, 9.0, 5.0, 12.0]), 6.0, 1) == ([0, 2], 6.0)
    # All in time: it closes when the last arrives.
    assert deadline_round(np.array([3.0, 5.0]), 6.0, 1) == ([0, 1], 5.0)
    # Fewer than min_clients in time: the server waits for the fastest min_clients.
    assert deadline_round(np.array([3.0, 9.0, 7.0, 12.0]), 6.0, 3) == ([0, 1, 2], 9.0)
    assert deadline_round(np.array([8.0, 9.0]), 6.0, 5) == ([0, 1], 9.0)


def test_sampling_a_count_draws_what_sampling_a_fraction_does():
    assert sample_clients(3, 4, 50, 0.2) == sample_count(3, 4, 50, clients_per_round(50, 0.2))


# --- FedBuff's math -----------------------------------------------------------------------------------------


def test_staleness_weights():
    assert staleness_weight(0, "sqrt") == 1.0
    assert staleness_weight(3, "sqrt") == 0.5
    assert staleness_weight(8, "sqrt") == pytest.approx(1 / 3)
    assert staleness_weight(8, "constant") == 1.0


def test_the_buffered_server_step_by_hand():
    base = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(10)}
    deltas = [{"w": torch.tensor([2.0, 0.0]), "n": torch.tensor(3)},
              {"w": torch.tensor([4.0, -4.0]), "n": torch.tensor(3)}]
    # base + 0.5 * (1 * d1 + 0.5 * d2) / 2 = [1, 2] + 0.25 * ([2, 0] + [2, -2]) = [2, 1.5]
    out = buffered_update(base, deltas, [1.0, 0.5], server_lr=0.5)
    assert torch.equal(out["w"], torch.tensor([2.0, 1.5]))
    # The integer counter: 10 + 0.25 * (3 + 1.5) = 11.125, rounded, still an integer.
    assert out["n"].dtype == torch.int64 and out["n"].item() == 11
    assert torch.equal(base["w"], torch.tensor([1.0, 2.0]))  # the base is not written into


def test_picks_are_seeded_and_only_of_idle_clients():
    assert pick_client(3, 5, [0, 4, 7]) == pick_client(3, 5, [0, 4, 7])
    assert {pick_client(3, d, [4, 7]) for d in range(50)} == {4, 7}


def test_the_first_arrival_is_the_earliest_and_a_tie_goes_to_the_first_sent():
    assert next_arrival([(5.0, 0), (2.0, 1), (2.0, 3)]) == 1
    assert next_arrival([(2.0, 4), (2.0, 3)]) == 1


def _queue(times, concurrency, buffer_size, trained_versions):
    """A queue over clients of fixed ``times`` whose training records each call's version and ids."""

    def train(version, pending):
        trained_versions.append((version, [a.client_id for a in pending]))
        return [Arrival(a.client_id, a.dispatch, a.version, a.arrives, delta={}, state=ClientState()) for a in pending]

    return BufferedRounds(0, np.array(times), concurrency, buffer_size, train, lambda v, a, failed: None)


def test_the_queue_processes_arrivals_in_virtual_time_and_keeps_the_concurrency():
    calls = []
    q = _queue([1.0, 10.0, 2.5, 100.0], 2, 2, calls)
    buffer, failed, now = q.step(0, 0.0)
    # Two clients in flight; K = 2 arrivals fill the buffer; the first's replacement was sent model 0.
    assert not failed and len(buffer) == 2 and all(a.version == 0 for a in buffer)
    assert now == max(a.arrives for a in buffer)
    assert [a.arrives for a in buffer] == sorted(a.arrives for a in buffer)
    q.dispatch(1, now)
    assert len(q.in_flight) == 2 and q.dispatches == 4
    # Trained lazily, a batch per model, all before it changes.
    assert [v for v, _ in calls] == [0] * len(calls) and sum(len(ids) for _, ids in calls) == 3
    assert all(a.trained for a in q.in_flight if a.version == 0)
    assert not any(a.trained for a in q.in_flight if a.version == 1)


def test_a_fast_client_sent_out_again_can_arrive_twice_in_one_buffer():
    calls = []
    # One client in flight at a time: each arrival's replacement is the next, so the queue is a chain.
    times = [1.0, 10.0]
    q = _queue(times, 1, 3, calls)
    buffer, _, now = q.step(0, 0.0)
    expected, t = [], 0.0
    for d in range(3):
        cid = pick_client(0, d, [0, 1])
        t += times[cid]
        expected.append((cid, d, t))
    assert [(a.client_id, a.dispatch, a.arrives) for a in buffer] == expected and now == t
    # Each was trained when it arrived first, against model 0.
    assert calls == [(0, [cid]) for cid, _, _ in expected]


# --- the config ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("rounds", "extra", "message"), [
    ({"buffer_size": 5}, {}, r"rounds.buffer_size: has no effect with rounds.mode=sync"),
    ({"mode": "fedbuff", "deadline": 5.0}, {}, r"rounds.deadline: has no effect with rounds.mode=fedbuff"),
    ({"mode": "deadline"}, {}, r"rounds.deadline: rounds.mode=deadline needs it"),
    ({"speeds": "pareto", "sigma": 2.0}, {}, r"rounds.sigma: has no effect with rounds.speeds=pareto"),
    ({"speeds": "trace"}, {}, r"rounds.trace: rounds.speeds=trace needs it"),
    ({"speeds": "trace", "trace": "t.txt", "speed": 5.0}, {}, r"rounds.speed: has no effect with rounds.speeds=trace"),
    ({"mode": "fedbuff"}, {"train": {"generic_rule": "scaffold"}}, r"train.generic_rule: scaffold cannot be used"),
    ({"mode": "fedbuff"}, {"train": {"generic_rule": "feddyn"}}, r"train.generic_rule: feddyn cannot be used"),
    ({"mode": "fedbuff"}, {"train": {"head": "ditto", "balanced_loss": "ce"}}, r"train.head: ditto cannot be used"),
    ({"mode": "fedbuff", "concurrency": 101}, {}, r"rounds.concurrency: 101 clients in flight"),
    ({"mode": "fedbuff"}, {"runtime": {"min_clients_per_round": 2}}, r"runtime.min_clients_per_round: has no effect"),
    ({"mode": "deadline", "deadline": 5.0}, {"privacy": {"enabled": True, "noise_multiplier": 1.0}},
     r"rounds.mode: deadline cannot be used with privacy.enabled"),
])
def test_settings_of_another_mode_and_unsupported_combinations_are_refused(rounds, extra, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"rounds": rounds, **extra})


def test_a_missing_trace_file_names_the_setting(tmp_path):
    with pytest.raises(ConfigError, match="rounds.trace"):
        make_federation("rounds.speeds=trace", f"rounds.trace={tmp_path}/none.txt")


# --- the round loop -----------------------------------------------------------------------------------------

one_thread = pytest.mark.usefixtures("one_torch_thread")


@one_thread
def test_sync_rounds_last_as_long_as_their_slowest_client():
    fed = make_federation()
    ids = sample_clients(3, 0, fed.setup.num_clients, 0.5)
    record = fed.step(0)
    assert record["round_virtual_seconds"] == record["virtual_time"] == fed.durations[ids].max()
    assert "clients_dropped" not in record and "staleness" not in record


@one_thread
def test_a_deadline_round_trains_only_the_clients_in_time():
    fed = make_federation("rounds.mode=deadline", "rounds.deadline=0.4", "rounds.over_selection=0.5")
    before = dict(fed.clients)
    n = fed.setup.num_clients
    sampled = sample_count(3, 0, n, over_selected(clients_per_round(n, 0.5), 0.5, n))
    in_time = [c for c in sampled if fed.durations[c] <= 0.4]
    assert 0 < len(in_time) < len(sampled)
    record = fed.step(0)
    assert record["clients"] == len(sampled) and record["clients_done"] == len(in_time)
    assert record["clients_dropped"] == len(sampled) - len(in_time)
    assert record["round_virtual_seconds"] == 0.4
    for cid in range(n):
        assert (fed.clients[cid].rounds_trained == 1) == (cid in in_time)
        if cid not in in_time:
            assert fed.clients[cid] is before[cid]  # never reported: its state as it was


@one_thread
def test_a_fedbuff_step_is_the_mean_update_of_the_first_k_arrivals():
    # Every client in flight: the first two arrivals are the two fastest, as the fastest one, sent out again
    # when it arrives (the only idle client), arrives again only after the second.
    fed = make_federation("rounds.mode=fedbuff", "rounds.buffer_size=2", "rounds.concurrency=6",
                          "rounds.server_lr=0.5")
    start = {k: v.clone() for k, v in fed.global_shared.items()}
    fastest = [int(c) for c in np.argsort(fed.durations)[:2]]
    assert 2 * fed.durations[fastest[0]] > fed.durations[fastest[1]]
    ref = make_federation()
    deltas = []
    for cid in fastest:
        shared = ref.executor.host.train(cid, ClientState(), RoundInput(start), 0)[0].shared
        deltas.append({k: shared[k] - start[k] for k in start})
    record = fed.step(0)
    assert record["staleness"] == 0.0 and record["clients_done"] == 2
    assert record["virtual_time"] == fed.durations[fastest[1]]
    for k, w in start.items():
        expected = (w.double() + 0.5 * (deltas[0][k].double() + deltas[1][k].double()) / 2).to(w.dtype)
        assert torch.equal(fed.global_shared[k], expected), k
    # The two arrived; their replacements are in flight, with the old model and the new one.
    assert sorted(a.version for a in fed.buffered.in_flight) == [0, 0, 0, 0, 0, 1]


def _without_timings(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in ("seconds", "train_seconds")}


@one_thread
@pytest.mark.parametrize("overrides", [
    ("rounds.mode=deadline", "rounds.deadline=0.4", "train.head=linear"),
    ("rounds.mode=fedbuff", "rounds.buffer_size=2", "rounds.concurrency=4", "train.head=hyper"),
], ids=["deadline", "fedbuff"])
def test_a_run_resumed_from_its_checkpoint_continues_bitwise(tmp_path, overrides):
    """The checkpoint holds the clock, FedBuff's send-outs and clients in flight (trained or not): the resumed
    run matches the uninterrupted one. The snapshot is saved after the next step ran, as a background save
    would: that step must not have changed it."""
    a = make_federation(*overrides, "train.rounds=5")
    for r in range(2):
        a.step(r)
    snap = a.snapshot()
    uninterrupted = [_without_timings(a.step(r)) for r in range(2, 5)]
    storage = RunStorage(str(tmp_path))
    save_checkpoint(storage, snap)
    loaded = load_checkpoint(storage)
    assert loaded.virtual_time == snap.virtual_time > 0
    if "rounds.mode=fedbuff" in overrides:
        assert loaded.in_flight and any(x.trained for x in loaded.in_flight)
        assert any(not x.trained for x in loaded.in_flight)
    b = make_federation(*overrides, "train.rounds=5")
    b.restore(loaded)
    assert [_without_timings(b.step(r)) for r in range(2, 5)] == uninterrupted
    assert _same(a.global_shared, b.global_shared)
    for cid, st in a.clients.items():
        assert st.rounds_trained == b.clients[cid].rounds_trained
        assert _same(st.tensors(), b.clients[cid].tensors()), cid


def test_the_default_mode_is_sync():
    assert config_from_dict(BASE).rounds.mode == "sync"


@pytest.mark.slow
def test_fedbuff_on_ray_equals_in_process_and_resumes_from_its_checkpoint(ray_session, one_torch_thread, tmp_path):
    """The Ray executor trains FedBuff's lazy batches as the in-process one does, and a Ray run resumed from
    its checkpoint halfway (clients in flight, trained and not) finishes with the same records."""
    overrides = ("rounds.mode=fedbuff", "rounds.buffer_size=2", "rounds.concurrency=4", "train.head=hyper",
                 "train.rounds=4", "runtime.torch_threads=1")
    ref = make_federation(*overrides)
    expected = [_without_timings(ref.step(r)) for r in range(4)]
    setup = prepare(config_from_dict(BASE, list(overrides)))
    executor = RayExecutor(setup, plan_layout(setup.cfg.runtime, len(setup.all_client_ids),
                                              ray_session.cluster_resources()), lambda line: None)
    storage = RunStorage(str(tmp_path))
    try:
        fed = Federation(setup, executor, log=lambda line: None)
        records = [_without_timings(fed.step(r)) for r in range(2)]
        save_checkpoint(storage, fed.snapshot())
        resumed = Federation(setup, executor, log=lambda line: None)
        resumed.restore(load_checkpoint(storage))
        records += [_without_timings(resumed.step(r)) for r in range(2, 4)]
    finally:
        executor.close()
    # As JSON: a reading a method has not is NaN in both, which == would call different.
    assert json.dumps(records) == json.dumps(expected)
    assert _same(resumed.global_shared, ref.global_shared)
