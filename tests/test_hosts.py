"""Separate hosts on one machine (tests/hosts.py): each party sees only its own data, links carry a rate, a
delay, go down and come back, and nothing of a harness outlives it, also when its process is interrupted; then a
Ray cluster started across them as a real one is (tests/hosts_ray.py) trains at the sites bitwise as the same
federation in one process (which tests/test_sites.py shows equal to the run on ``ray.cluster_utils``)."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO
from hosts import SERVER_ADDR, Hosts, is_root, leftovers
from safetensors.torch import load_file

pytestmark = pytest.mark.skipif(not is_root(), reason="the hosts harness needs root: network and mount "
                                                      "namespaces, veth pairs, tc (CI runs as root)")


@pytest.fixture
def dirs(tmp_path) -> dict[str, Path]:
    root = tmp_path / "data"
    for name in ("server", "a", "b"):
        (root / name).mkdir(parents=True)
        (root / name / f"{name}.txt").write_text(name)
    return {"root": root, "server": root / "server", "a": root / "a", "b": root / "b"}


def parties(dirs) -> dict[str, list[Path]]:
    return {name: [dirs[name]] for name in ("server", "a", "b")}


CONNECT = ("import socket,sys,time;t=time.monotonic();socket.create_connection((sys.argv[1],int(sys.argv[2])),"
           "timeout=float(sys.argv[3])).close();print(time.monotonic()-t)")
LISTEN = ("import socket\ns=socket.socket();s.bind(('{}',{}));s.listen();print('up',flush=True);c=s.accept()[0]\n"
          "while c.recv(1 << 16): pass")  # one connection, read to its end


def listen(hosts: Hosts, party: str, port: int) -> subprocess.Popen:
    proc = hosts.popen(party, [sys.executable, "-c", LISTEN.format(hosts.addr[party], port)], stdout=subprocess.PIPE,
                       text=True)
    assert proc.stdout.readline() == "up\n"
    return proc


def test_each_party_sees_only_its_own_data_and_the_links_work(dirs, shared_data_dir):
    with Hosts(parties(dirs), hide=[dirs["root"], shared_data_dir]) as hosts:
        for name in ("server", "a", "b"):
            seen = hosts.exec(name, "find", str(dirs["root"]), "-type", "f").stdout.split()
            assert seen == [str(dirs[name] / f"{name}.txt")], (name, seen)
            assert hosts.exec(name, "ls", "-A", str(shared_data_dir)).stdout == "", name
        # The sites reach the server, and each other through it, on the harness's addresses only.
        server = listen(hosts, "server", 7000)
        assert hosts.exec("a", sys.executable, "-c", CONNECT, SERVER_ADDR, "7000", "5").returncode == 0
        server.wait(10)
        b = listen(hosts, "b", 7001)
        assert hosts.exec("a", sys.executable, "-c", CONNECT, hosts.addr["b"], "7001", "5").returncode == 0
        b.wait(10)
        routes = hosts.exec("a", "ip", "-j", "route").stdout
        assert "default" not in routes, routes

        # A rate limit on both ends of a's link; its counters count what crossed.
        hosts.rate("a", "10mbit")
        for party, dev in (("server", "l1"), ("a", "eth0")):
            qdisc = hosts.exec(party, "tc", "qdisc", "show", "dev", dev).stdout
            assert "tbf" in qdisc and "rate 10Mbit" in qdisc, qdisc
        before = hosts.bytes("a")
        server = listen(hosts, "server", 7002)
        send = f"import socket;socket.create_connection(('{SERVER_ADDR}',7002)).sendall(b'x'*300000)"
        hosts.exec("a", sys.executable, "-c", send)
        server.wait(10)
        assert hosts.bytes("a")["tx"] - before["tx"] >= 300000
        hosts.rate("a", None)

        # Down: a's connection attempt fails; up again: it succeeds.
        server = listen(hosts, "server", 7003)
        hosts.link("a", up=False)
        assert hosts.exec("a", sys.executable, "-c", CONNECT, SERVER_ADDR, "7003", "1", check=False).returncode != 0
        hosts.link("a", up=True)
        assert hosts.exec("a", sys.executable, "-c", CONNECT, SERVER_ADDR, "7003", "5").returncode == 0
        server.wait(10)
        tag = hosts.tag
    assert leftovers(tag) == []


def test_a_delayed_link_takes_at_least_its_round_trip(dirs):
    """With a one-way delay of 50 ms (a TUN pair and the harness's relay), a TCP connect (one round trip)
    takes at least 100 ms; nothing is left of the relay afterwards."""
    with Hosts(parties(dirs), hide=[dirs["root"]], delay_ms=50) as hosts:
        server = listen(hosts, "server", 7000)
        took = float(hosts.exec("a", sys.executable, "-c", CONNECT, SERVER_ADDR, "7000", "5").stdout)
        server.wait(10)
        assert took >= 0.1, took
        tag = hosts.tag
    assert leftovers(tag) == []


OPEN_AND_WAIT = """
import sys, time
sys.path.insert(0, {tests!r})
from hosts import Hosts
with Hosts({parties!r}, hide=[{root!r}], delay_ms={delay}) as hosts:
    hosts.popen("a", ["sleep", "600"])
    print(hosts.tag, flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize(("sig", "delay"), [(signal.SIGTERM, 0), (signal.SIGINT, 5)])
def test_an_interrupted_harness_leaves_nothing(dirs, sig, delay):
    """A process holding a harness (a process running in a party's namespace, and with a delay its relays)
    is sent SIGTERM or SIGINT: it tears everything down before it ends."""
    script = OPEN_AND_WAIT.format(tests=str(REPO / "tests"), parties={k: [str(p) for p in v] for k, v in
                                                                       parties(dirs).items()},
                                  root=str(dirs["root"]), delay=delay)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tag = proc.stdout.readline().strip()
    assert tag and leftovers(tag), proc.stderr.read()
    proc.send_signal(sig)
    proc.wait(60)
    assert leftovers(tag) == []


def test_a_harness_that_fails_to_start_leaves_nothing(dirs):
    hosts = Hosts(parties(dirs), hide=[Path("/tmp/fh-not-allowed")])
    with pytest.raises(ValueError, match="under the harness's own directory"), hosts:
        pass
    assert leftovers(hosts.tag) == []


# --- Ray across the hosts -----------------------------------------------------------------------------------

KEYS = ("round", "clients", "clients_done", "clients_failed", "train_loss", "personal_loss", "gfl_gm")
PFL = ("pfl_gm", "pfl_pm", "pfl_pm_global")


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def ray_hosts(tmp_path_factory, shared_data_dir):
    """Two sites of real MNIST clients (tests/sites_data.py), each in its own namespaces with only its own data
    directory; the server's with its test set and its run directory; a Ray cluster across them."""
    from hosts_ray import ray_env, start_head, start_site, wait_nodes
    from sites_data import make_sites

    root = tmp_path_factory.mktemp("hosts") / "data"
    paths = make_sites(root, shared_data_dir)
    (root / "runs").mkdir()
    keep = {"server": [paths["server"], root / "runs"], "a": [paths["a"]], "b": [paths["b"]]}
    env = ray_env()
    with Hosts(keep, hide=[root, shared_data_dir]) as hosts:
        start_head(hosts, env)
        for name in ("a", "b"):
            start_site(hosts, name, env)
        wait_nodes(hosts, env, ["a", "b"])
        yield hosts, env, paths, root
        tag = hosts.tag
    assert leftovers(tag) == []


@pytest.mark.slow
@pytest.mark.parametrize("head", ["hyper", "ditto"])
def test_ray_job_at_sites_across_hosts_equals_the_run_in_one_process(ray_hosts, head, tmp_path, one_torch_thread):
    """``ray job submit`` from the server's namespaces of a run at the two sites: the same final weights and
    records as the federation in one process over the same clients (tests/test_sites.py's comparison, which
    also holds the run on ``ray.cluster_utils`` to these very weights), the P-FL means to 1e-12 (sums from the
    sites); the server's namespace never held a training file."""
    from sites_data import memory_config, sites_config

    from fedrod_ray.config import config_from_dict
    from fedrod_ray.drivers.runner import run_local
    from fedrod_ray.outputs.storage import RunStorage
    from hosts_ray import submit

    hosts, env, paths, root = ray_hosts
    run = root / "runs" / head
    cfg_file = root / "runs" / f"{head}.json"
    cfg_file.write_text(json.dumps(sites_config(paths, head)))
    submit(hosts, env, ["python", "-m", "fedrod_ray.cli", "train", "--config", str(cfg_file), "--run-dir", str(run)])
    memory = tmp_path / "memory"
    run_local(config_from_dict(memory_config(paths, head)), RunStorage(str(memory)), log=lambda s: None)

    a, b = load_file(memory / "final" / "model.safetensors"), load_file(run / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for m, s in zip(records(memory), records(run), strict=True):
        assert {k: m.get(k) for k in KEYS} == {k: s.get(k) for k in KEYS}
        for k in PFL:
            assert (math.isnan(m[k]) and math.isnan(s[k])) or abs(m[k] - s[k]) < 1e-12, (k, m, s)
        assert s["gfl_at"] == "server: its test set"
    seen = hosts.exec("server", "find", str(root), str(paths["server"].parent), "-path", "*/clients/*").stdout
    assert seen == "", seen
