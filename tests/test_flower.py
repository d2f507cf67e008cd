"""fedrod-ray on Flower's deployment engine, with Flower's real processes on loopback: a SuperLink, three
SuperNodes each holding a third of the clients of a small MNIST set, and ``flwr run`` of flower/app
(tests/flower_federation.py).

A run there must be the in-process run of the same config: the same clients sampled, trained from the same
state with the same seeds, averaged in the same order, so records and final weights are equal bitwise. What
each SuperNode keeps of its clients must never reach anything the server side writes.

What a test costs is Flower's processes (a ClientApp process per message, a ServerApp per run), not training:
the data is a slice of MNIST, the federation (over TLS) is started once for the module and serves every test,
Fed-RoD (hyper)'s one run is the killed and resumed one, and the runs that only need round 1 stop there."""

from __future__ import annotations

import json
import os
import signal
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml
from fedrod_ray_flower.node import NodeData
from fedrod_ray_flower.split import split
from flower_federation import FlowerFederation, kill_tree, require_flower, write_certificates
from safetensors.torch import load_file
from served import uvicorn_server

from fedrod_ray.config import config_from_dict, load_config
from fedrod_ray.data import load_dataset
from fedrod_ray.drivers.runner import run_local
from fedrod_ray.outputs.storage import RunStorage

pytestmark = pytest.mark.slow
require_flower()

TIMING = {"seconds", "train_seconds"}  # wall-clock keys, the only ones allowed to differ


MNIST_TRAIN, MNIST_TEST = 1800, 600  # the slice of MNIST the federation trains on and tests with


def mnist_subset(folder: Path, data_dir: Path) -> Path:
    """MNIST's first ``MNIST_TRAIN`` training and ``MNIST_TEST`` test images as a ``data.dataset: arrays`` file
    in ``folder`` (written once)."""
    path = folder / "mnist-subset.npz"
    if not path.is_file():
        ds = load_dataset(config_from_dict({"data": {"dataset": "mnist", "data_dir": str(data_dir),
                                                     "download": False}}).data)
        np.savez(path, x_train=ds.train_x[:MNIST_TRAIN].numpy(), y_train=ds.train_y[:MNIST_TRAIN].numpy(),
                 x_test=ds.test_x[:MNIST_TEST].numpy(), y_test=ds.test_y[:MNIST_TEST].numpy())
    return path


def write_config(folder: Path, data_dir: Path, name: str, evaluate: bool = True, **train) -> Path:
    """A slice of MNIST (``mnist_subset``) over 12 clients (Dir(0.3)) and 2 held-out new clients, 3 a round,
    3 rounds (``train`` overrides), evaluated after the last (the new clients' zero-shot models and their
    fine-tuning too) unless ``evaluate`` is False."""
    rounds = train.pop("rounds", 3)
    cfg = {"name": name, "seed": 0,
           "data": {"dataset": "arrays", "path": str(mnist_subset(folder, data_dir)), "num_clients": 12,
                    "new_clients": 2, "partition": "dirichlet", "alpha": 0.3, "min_per_client": 20},
           "train": {"rounds": rounds, "client_fraction": 0.25, "local_epochs": 1, "batch_size": 50, "lr": 0.01,
                     **train},
           "eval": {"eval_every": rounds, "finetune_epochs": 1} if evaluate else
                   {"eval_every": rounds + 1, "at_end": False},
           "runtime": {"torch_threads": 1, "max_failed_fraction": 0.7, "min_clients_per_round": 1}}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def configs(tmp_path_factory, shared_data_dir) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("flower-configs")
    return {"hyper": write_config(folder, shared_data_dir, "hyper", head="hyper"),
            "ditto": write_config(folder, shared_data_dir, "ditto", head="ditto", balanced_loss="ce"),
            "hyper-round1": write_config(folder, shared_data_dir, "hyper-round1", evaluate=False, head="hyper",
                                         rounds=1)}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, configs) -> list[Path]:
    return split(str(configs["hyper"]), tmp_path_factory.mktemp("flower-nodes"), 3)


@pytest.fixture(scope="module")
def federation(tmp_path_factory, nodes):
    """The module's SuperLink and SuperNodes, over TLS with generated certificates (as docs/flower.md deploys)."""
    root = tmp_path_factory.mktemp("flower")
    fed = FlowerFederation(root, nodes, tls=write_certificates(root / "certs"))
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


def _bytes_of(tensor) -> bytes:
    return tensor.contiguous().numpy().tobytes()


def distinctive(tensor, uploaded: bytes) -> bytes | None:
    """The bytes of the first 8 values of ``tensor`` (at a multiple of 8) that are not in ``uploaded``."""
    flat = tensor.flatten()
    for i in range(0, flat.numel() - 7, 8):
        if (window := _bytes_of(flat[i:i + 8])) not in uploaded:
            return window
    return None


def test_ditto_on_flower_equals_in_process_and_keeps_personal_state_home(federation, configs, in_process,
                                                                          tmp_path):
    run_dir = tmp_path / "run"
    federation.run(configs["ditto"], run_dir)
    assert_same_run(run_dir, in_process("ditto"))
    # What the server side wrote: the run directory and the SuperLink's database (every message it relayed).
    server_files = [p for p in run_dir.rglob("*") if p.is_file()] + [federation.database]
    written = b"".join(p.read_bytes() for p in server_files)
    # Each client's Ditto model v_m, its own on its SuperNode: not one of its tensors reached the server side.
    # Stretches of v_m equal to the client's own local models (what it uploaded) are left out of the search:
    # a unit that none of the client's examples activates moves alike in both, and says nothing more.
    personal = []
    for i in range(3):
        for client in {p.parent for p in federation.state_path(i).rglob("*.safetensors")}:
            states = [load_file(str(p)) for p in client.glob("*.safetensors")]
            uploaded = b"".join(_bytes_of(v) for s in states for k, v in s.items() if k.startswith("local_model/"))
            personal += [distinctive(v, uploaded) for s in states for k, v in s.items()
                         if k.startswith("personal/") and v.numel() >= 8]
    assert personal and all(personal), "the SuperNodes kept no personal state, or none of its own"
    for window in personal:
        assert window not in written
    # The search does find what the server side did write: the served global weights.
    final = load_file(str(run_dir / "final" / "model.safetensors"))
    assert all(_bytes_of(v.flatten()[:8]) in written for v in final.values() if v.numel() >= 8)


def test_a_killed_serverapp_resumes_from_its_checkpoint_over_tls_and_is_served(federation, configs, in_process,
                                                                             tmp_path):
    """Fed-RoD (hyper) over TLS: its ServerApp killed after round 1, the run started again resumes and ends
    bitwise as the in-process run, and is served."""
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
    # The SuperLink speaks only TLS, under the generated CA's certificate.
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://127.0.0.1:{federation.port}/", timeout=10)
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(f"https://127.0.0.1:{federation.port}/", timeout=10)
    try:
        urllib.request.urlopen(f"https://127.0.0.1:{federation.port}/", timeout=10,
                               context=ssl.create_default_context(cafile=str(federation.tls["ca"])))
    except urllib.error.HTTPError:
        pass  # an HTTP answer over the verified TLS connection, whatever its status
    federation.run(configs["hyper"], run_dir)
    assert_same_run(run_dir, in_process("hyper"))
    with uvicorn_server(run_dir) as (_, base, _lines), urllib.request.urlopen(f"{base}/v1/model",
                                                                              timeout=30) as response:
        info = json.load(response)
    assert info["round"] == 3 and info["head"] == "hyper", info


def test_a_supernode_killed_mid_round_fails_only_its_clients(federation, configs, in_process, tmp_path):
    run_dir = tmp_path / "run"
    logs = [federation.root / f"supernode{i}.log" for i in range(3)]
    before = [log.read_text(errors="replace").count("Receiving: train message") for log in logs]
    # Round 1 only (the same clients as round 1 of "hyper"): the round waits `timeout` for the lost node.
    proc = federation.run(configs["hyper-round1"], run_dir, node_timeout=45, wait=False)
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
    assert len(got) == 1  # the round completed from the other SuperNodes
    first = got[0]
    assert first["clients_failed"] >= 1 and set(first["failed_ids"]) <= hosted
    assert first["clients_done"] == want[0]["clients"] - first["clients_failed"]
    assert (run_dir / "final").is_dir()


def test_ditto_on_flowers_simulation_engine_equals_in_process(tmp_path, configs, nodes, in_process,
                                                              private_ray_env):
    """The same app on Flower's simulation engine (a SuperLink with ``--simulation``), whose simulated
    SuperNodes run the ClientApp in the actors of a private Ray of the project's version: the in-process run,
    bitwise, with each simulated node's clients' states in its own folder of run config sim-state-path."""
    sim = FlowerFederation(tmp_path, nodes, simulation=private_ray_env)
    try:
        run_dir = tmp_path / "run"
        sim.run(configs["ditto"], run_dir, timeout=600)
    finally:
        sim.close()
    assert_same_run(run_dir, in_process("ditto"))
    trained = set()
    for i, node in enumerate(nodes):
        states = sim.run_states(i, configs["ditto"], run_dir)  # the run's own folder of node i's states
        kept = {int(p.name.removeprefix("client_")) for p in states.iterdir()}
        assert kept <= set(NodeData.load(node).client_ids)  # node i kept only its own clients' states
        for path in sim.state_path(i).rglob("*.safetensors"):
            assert any(k.startswith("personal/") for k in load_file(str(path)))  # Ditto's v_m, on the node
        trained |= kept
    assert trained and not list(run_dir.rglob("client_*"))
