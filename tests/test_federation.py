"""The in-process round loop: sampling, aggregation, evaluation, the PM cache, client failures."""

from __future__ import annotations

import json

import pytest
import torch

from fedrod_ray.aggregate import weighted_average
from fedrod_ray.client import ClientState
from fedrod_ray.config import config_from_dict
from fedrod_ray.federation import Federation, InProcessExecutor, RoundFailedError, make_host, prepare
from fedrod_ray.server import sample_clients
from fedrod_ray.storage import RunStorage

BASE = {
    "seed": 3,
    "data": {"dataset": "synthetic", "num_clients": 6, "new_clients": 2, "alpha": 0.3,
             "synthetic_train_per_class": 24, "synthetic_test_per_class": 10, "min_per_client": 4},
    "train": {"rounds": 2, "client_fraction": 0.5, "local_epochs": 1, "batch_size": 16},
}


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_federation(tmp_path, *overrides, log=None):
    cfg = config_from_dict(BASE, list(overrides))
    setup = prepare(cfg)
    executor = InProcessExecutor(make_host(setup, setup.all_client_ids))
    return Federation(setup, executor, RunStorage(str(tmp_path)), log=log or (lambda s: None))


def test_round_is_the_weighted_average_of_the_sampled_clients(tmp_path):
    fed = make_federation(tmp_path)
    start = {k: v.clone() for k, v in fed.global_shared.items()}
    ids = sample_clients(3, 0, fed.setup.num_clients, 0.5)

    # The same client updates, done by hand on a second host, then averaged by sample count.
    ref = make_federation(tmp_path / "ref")
    results = [ref.executor.host.train(cid, start, 0) for cid in ids]
    expected = weighted_average([r.shared for r in results], [r.num_samples for r in results])

    record = fed.run_round(0)
    assert record["clients"] == len(ids) == record["clients_done"]
    assert record["clients_failed"] == 0
    for k, v in expected.items():
        assert torch.equal(fed.global_shared[k], v), k
    # The linear P-head never leaves the client.
    assert not any(k.startswith("personal_head") for k in fed.global_shared)


def test_evaluation_reports_train_and_new_clients(tmp_path):
    fed = make_federation(tmp_path)
    fed.run_round(0)
    metrics = fed.evaluate()
    for key in ("gfl_gm", "pfl_gm", "pfl_pm", "pfl_gm_new", "pfl_pm_new"):
        assert 0.0 <= metrics[key] <= 1.0, key
    # A new client never trains; with a zero-initialised linear head its PM is exactly the GM.
    assert metrics["pfl_pm_new"] == pytest.approx(metrics["pfl_gm_new"])


def test_pm_cache_matches_a_fresh_evaluation(tmp_path):
    fed = make_federation(tmp_path, "train.variant=hyper")
    fed.run_round(0)
    host = fed.executor.host
    ids = fed.setup.all_client_ids
    host.evaluate(ids, fed.global_shared)
    fed.run_round(1)
    cached = host.evaluate(ids, fed.global_shared)

    fresh_fed = make_federation(tmp_path / "fresh", "train.variant=hyper")
    fresh_fed.executor.set_states(host.get_states())  # no cache entries
    fresh = fresh_fed.executor.host.evaluate(ids, fed.global_shared)
    for cid in ids:
        assert torch.equal(cached.correct[cid], fresh.correct[cid]), cid
        assert torch.equal(cached.total[cid], fresh.total[cid]), cid
    # Only trained clients are cached (a never-trained hyper client's zero-shot head follows the global
    # hypernetwork), and a client that trained again was re-evaluated.
    trained = {c for c, s in host.get_states().items() if s.local_model is not None}
    assert set(host._pm_cache) == trained
    assert all(host._pm_cache[c][0] == host.get_states()[c].rounds_trained for c in trained)


def test_failed_client_is_reported_and_skipped(tmp_path):
    logs: list[str] = []
    fed = make_federation(tmp_path, "runtime.max_failed_fraction=0.5", log=logs.append)
    bad = sample_clients(3, 0, fed.setup.num_clients, 0.5)[0]
    fed.executor.set_states({bad: ClientState(personal={"personal_head.weight": torch.zeros(1, 1)})})
    record = fed.run_round(0)
    assert record["clients_failed"] == 1 and record["failed_ids"] == [bad]
    assert record["clients_done"] == record["clients"] - 1
    assert any(f"client {bad} failed" in line and "Traceback" in line for line in logs)
    # Its broken state cannot be evaluated either: reported and left out, the others still count.
    assert record["pm_eval_failed"] == 1 and 0 <= record["pfl_pm"] <= 1
    assert any(f"client {bad}: personalized model not evaluated" in line for line in logs)
    saved = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert saved["failed_ids"] == [bad]


def test_too_many_failures_stop_the_run_with_a_clear_message(tmp_path):
    fed = make_federation(tmp_path, "runtime.max_failed_fraction=0.0")
    bad = sample_clients(3, 0, fed.setup.num_clients, 0.5)[0]
    fed.executor.set_states({bad: ClientState(personal={"personal_head.weight": torch.zeros(1, 1)})})
    with pytest.raises(RoundFailedError, match=rf"clients {bad}\b.*max_failed_fraction=0.0"):
        fed.run_round(0)
    # Nothing was checkpointed for the failed round.
    assert not (tmp_path / "checkpoints").exists()


def test_run_writes_every_result_file(tmp_path):
    fed = make_federation(tmp_path, "train.algorithm=fedavg")
    last = fed.run()
    assert last["round"] == 1 and "gfl_gm" in last
    for name in ("config.yaml", "metrics.jsonl", "metrics.csv", "curves.png", "checkpoints/latest",
                 "final/model.safetensors", "final/meta.json"):
        assert (tmp_path / name).is_file(), name
    meta = json.loads((tmp_path / "final/meta.json").read_text())
    assert meta["variant"] is None and meta["algorithm"] == "fedavg" and meta["num_classes"] == 10
