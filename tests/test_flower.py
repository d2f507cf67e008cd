"""fedrod-ray on Flower's deployment engine, with Flower's real processes on loopback: a SuperLink, three
SuperNodes each holding a third of MNIST's clients, and ``flwr run`` of flower/app (tests/flower_federation.py).

A run there must be the in-process run of the same config: the same clients sampled, trained from the same
state with the same seeds, averaged in the same order, so records and final weights are equal bitwise. What
each SuperNode keeps of its clients must never reach anything the server side writes."""

from __future__ import annotations

import json
import os
import signal
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from fedrod_ray_flower.node import NodeData
from fedrod_ray_flower.split import split
from flower_federation import FlowerFederation, kill_tree, require_flower, write_certificates
from safetensors.torch import load_file
from served import uvicorn_server

from fedrod_ray.config import load_config
from fedrod_ray.drivers.runner import run_local
from fedrod_ray.outputs.storage import RunStorage

pytestmark = pytest.mark.slow
require_flower()

TIMING = {"seconds", "train_seconds"}  # wall-clock keys, the only ones allowed to differ


def write_config(folder: Path, data_dir: Path, name: str, **train) -> Path:
    """MNIST over 60 clients (Dir(0.3)) and 2 held-out new clients, 3 a round, 3 rounds, evaluated after the
    last (the new clients' zero-shot models and their fine-tuning too)."""
    cfg = {"name": name, "seed": 0,
           "data": {"dataset": "mnist", "data_dir": str(data_dir), "num_clients": 60, "new_clients": 2,
                    "partition": "dirichlet", "alpha": 0.3},
           "train": {"rounds": 3, "client_fraction": 0.05, "local_epochs": 1, "batch_size": 50, "lr": 0.01,
                     **train},
           "eval": {"eval_every": 3, "finetune_epochs": 1},
           "runtime": {"torch_threads": 1, "max_failed_fraction": 0.7, "min_clients_per_round": 1}}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def configs(tmp_path_factory, shared_data_dir) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("flower-configs")
    return {"hyper": write_config(folder, shared_data_dir, "hyper", head="hyper"),
            "ditto": write_config(folder, shared_data_dir, "ditto", head="ditto", balanced_loss="ce")}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, configs) -> list[Path]:
    return split(str(configs["hyper"]), tmp_path_factory.mktemp("flower-nodes"), 3)


@pytest.fixture(scope="module")
def federation(tmp_path_factory, nodes):
    fed = FlowerFederation(tmp_path_factory.mktemp("flower"), nodes)
    try:
        yield fed
    finally:
        fed.close()


@pytest.fixture(scope="module")
def in_process(tmp_path_factory, configs):
    """The in-process run of each config, run once."""
    runs: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in runs:
            run_dir = tmp_path_factory.mktemp(f"local-{name}") / "run"
            run_local(load_config(configs[name]), RunStorage(str(run_dir)), log=lambda line: None)
            runs[name] = run_dir
        return runs[name]

    return get


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(flower_dir: Path, local_dir: Path) -> None:
    got, want = records(flower_dir), records(local_dir)
    assert len(got) == len(want) == 3, (flower_dir / "metrics.jsonl").read_text()
    for a, b in zip(got, want):
        assert {k: v for k, v in a.items() if k not in TIMING} == {k: v for k, v in b.items() if k not in TIMING}
    assert {"pfl_new_before", "pfl_new_after"} <= got[-1].keys()
    a, b = load_file(str(flower_dir / "final" / "model.safetensors")), load_file(str(local_dir / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].equal(b[k]), k


def test_fedrod_hyper_on_flower_equals_in_process_and_is_served(federation, configs, in_process, tmp_path):
    run_dir = tmp_path / "run"
    federation.run(configs["hyper"], run_dir)
    assert_same_run(run_dir, in_process("hyper"))
    with uvicorn_server(run_dir) as (_, base, _lines), urllib.request.urlopen(f"{base}/v1/model",
                                                                              timeout=30) as response:
        info = json.load(response)
    assert info["round"] == 3 and info["head"] == "hyper", info


def _bytes_of(tensor) -> bytes:
    return tensor.contiguous().numpy().tobytes()


def test_ditto_on_flower_equals_in_process_and_keeps_personal_state_home(federation, configs, in_process,
                                                                          tmp_path):
    run_dir = tmp_path / "run"
    federation.run(configs["ditto"], run_dir)
    assert_same_run(run_dir, in_process("ditto"))
    # What the server side wrote: the run directory and the SuperLink's database (every message it relayed).
    server_files = [p for p in run_dir.rglob("*") if p.is_file()] + [federation.database]
    written = b"".join(p.read_bytes() for p in server_files)
    # Each client's Ditto model v_m, its own on its SuperNode: not one of its tensors reached the server side.
    personal = []
    for i in range(3):
        for state in federation.state_path(i).rglob("*.safetensors"):
            personal += [v for k, v in load_file(str(state)).items() if k.startswith("personal/") and v.numel() >= 8]
    assert personal, "the SuperNodes kept no personal state"
    for v in personal:
        assert _bytes_of(v.flatten()[:8]) not in written
    # The search does find what the server side did write: the served global weights.
    final = load_file(str(run_dir / "final" / "model.safetensors"))
    assert all(_bytes_of(v.flatten()[:8]) in written for v in final.values() if v.numel() >= 8)


def test_a_killed_serverapp_resumes_from_its_checkpoint(federation, configs, in_process, tmp_path):
    run_dir = tmp_path / "run"
    proc = federation.run(configs["hyper"], run_dir, wait=False)
    deadline = time.monotonic() + 600
    while not (run_dir / "metrics.jsonl").is_file() or len(records(run_dir)) < 1 \
            or not list((run_dir / "checkpoints").glob("round_*")):
        assert time.monotonic() < deadline and proc.poll() is None, "round 1 did not finish"
        time.sleep(0.5)
    serverapps = federation.serverapps()
    assert serverapps
    for pid in serverapps:
        os.kill(pid, signal.SIGKILL)
    kill_tree(proc)  # the `flwr run` that streamed its log
    assert len(records(run_dir)) < 3 and not (run_dir / "final").exists()
    federation.run(configs["hyper"], run_dir)
    assert_same_run(run_dir, in_process("hyper"))


def test_a_supernode_killed_mid_round_fails_only_its_clients(federation, configs, in_process, tmp_path):
    run_dir = tmp_path / "run"
    logs = [federation.root / f"supernode{i}.log" for i in range(3)]
    before = [log.read_text(errors="replace").count("Receiving: train message") for log in logs]
    proc = federation.run(configs["hyper"], run_dir, node_timeout=45, wait=False)
    victim, deadline = None, time.monotonic() + 600
    while victim is None:
        assert time.monotonic() < deadline and proc.poll() is None, "no SuperNode received round 1"
        for i, log in enumerate(logs):
            if log.read_text(errors="replace").count("Receiving: train message") > before[i]:
                victim = i
                break
        time.sleep(0.2)
    hosted = set(NodeData.load(federation.nodes[victim]).client_ids)
    federation.kill_node(victim)
    try:
        proc.wait(timeout=900)
    finally:
        federation.start_node(victim)
    got, want = records(run_dir), records(in_process("hyper"))
    assert len(got) == 3  # every round completed from the other SuperNodes
    first = got[0]
    assert first["clients_failed"] >= 1 and set(first["failed_ids"]) <= hosted
    assert first["clients_done"] == want[0]["clients"] - first["clients_failed"]


def test_tls_federation(tmp_path_factory, configs, nodes, in_process):
    root = tmp_path_factory.mktemp("flower-tls")
    fed = FlowerFederation(root, nodes, tls=write_certificates(root / "certs"))
    try:
        run_dir = root / "run"
        fed.run(configs["hyper"], run_dir)
        # The SuperLink speaks only TLS, under the generated CA's certificate.
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"http://127.0.0.1:{fed.port}/", timeout=10)
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(f"https://127.0.0.1:{fed.port}/", timeout=10)
        try:
            urllib.request.urlopen(f"https://127.0.0.1:{fed.port}/", timeout=10,
                                   context=ssl.create_default_context(cafile=str(fed.tls["ca"])))
        except urllib.error.HTTPError:
            pass  # an HTTP answer over the verified TLS connection, whatever its status
    finally:
        fed.close()
    assert_same_run(run_dir, in_process("hyper"))
