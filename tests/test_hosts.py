"""Separate hosts on one machine (tests/hosts.py): each party sees only its own data, links carry a rate, a
delay, go down and come back, and nothing of a harness outlives it, also when its process is interrupted."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from hosts import SERVER_ADDR, Hosts, is_root, leftovers

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
