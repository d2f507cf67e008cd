"""Who a Flower federation admits, with Flower's real processes (a SuperLink over TLS with
``--enable-supernode-auth`` and SuperNodes, tests/flower_federation.py): a SuperNode whose key the federation
never registered (``flwr supernode register``), or one with no key, is not admitted; and a registered node's
own policy refuses a run it does not allow, with the reason in the ServerApp's log."""

from __future__ import annotations

import time

import pytest
import yaml
from fedrod_ray_flower.split import split
from flower_federation import FlowerFederation, require_flower, write_certificates

pytestmark = pytest.mark.slow
require_flower()


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """One registered SuperNode holding a tiny synthetic federation's three clients, over TLS with node
    authentication, whose policy allows only Ditto; the config beside it."""
    root = tmp_path_factory.mktemp("flower-auth")
    config = root / "synthetic.yaml"
    config.write_text(yaml.safe_dump({
        "seed": 0, "data": {"dataset": "synthetic", "num_clients": 3, "new_clients": 0,
                            "synthetic_train_per_class": 4, "synthetic_test_per_class": 2},
        "train": {"rounds": 1, "head": "none", "client_fraction": 1.0, "batch_size": 20},
        "eval": {"eval_every": 2, "at_end": False},
        "runtime": {"torch_threads": 1, "max_failed_fraction": 1.0, "min_clients_per_round": 1}}))
    (node,) = split(str(config), root / "nodes", 1)
    fed = FlowerFederation(root, [node], tls=write_certificates(root / "certs"), auth=True,
                           node_config='allowed-methods="ditto"')
    fed.config = config
    try:
        yield fed
    finally:
        fed.close()


def wait_online(fed: FlowerFederation, count: int, timeout: float = 120) -> set[int]:
    deadline = time.monotonic() + timeout
    while len(online := fed.online()) < count:
        assert time.monotonic() < deadline, f"{len(online)} of {count} SuperNodes online"
        time.sleep(0.5)
    return online


def test_an_unregistered_supernode_is_not_admitted(federation):
    (registered,) = wait_online(federation, 1)
    # A node with a key of its own that no one registered, and a node with no key: each is refused at once
    # and stops (Flower's exit code 305: it could not activate, or could not register itself); the SuperLink
    # never lists either.
    for key in (federation.node_key("intruder"), None):
        i = federation.add_node(federation.nodes[0], key)
        try:
            assert federation.supernodes[i].wait(timeout=120) != 0
            assert "Failed to" in (federation.root / f"supernode{i}.log").read_text(errors="replace")
        finally:
            federation.kill_node(i)
            federation.nodes.pop()
            federation.supernodes.pop()
            (federation.root / f"supernode{i}.log").unlink()
    assert federation.online() == {registered}


def test_a_nodes_policy_refusal_reaches_the_serverapps_log(federation, tmp_path):
    """The node allows only Ditto: a run of head none trains nothing there, and the server's log says why."""
    wait_online(federation, 1)
    run_dir = tmp_path / "run"
    federation.run(federation.config, run_dir, timeout=600, node_timeout=120)
    log = (federation.root / f"flwr-run-{run_dir.name}.log").read_text(errors="replace")
    assert "refused by this SuperNode's policy: the run's train.head 'none' is not in node config " \
           "allowed-methods (ditto)" in log, log[-3000:]
    assert not federation.state_path(0).exists()  # nothing trained, nothing kept
