"""The Flower runtime's parts without Flower's processes: a SuperNode's client states on its disk, its data
folder, what crosses the wire, and the configs the ServerApp refuses (tests/test_flower.py runs the whole)."""

from __future__ import annotations

import pytest
import torch
from fedrod_ray_flower.node import NodeData, NodeStates
from flower_federation import require_flower
from tiny import make_data

from fedrod_ray.client_update.local import LocalResult, RoundInput
from fedrod_ray.clients.client import ClientFailure, ClientState, EvalCounts
from fedrod_ray.config import ConfigError, config_from_dict
from fedrod_ray.federation_state.setup import prepare


def state(value: float, rounds: int) -> ClientState:
    return ClientState(personal={"w": torch.full((3,), value)}, local_model={"s": torch.full((2,), value)},
                       rule_state={"c": torch.full((2,), -value)}, rounds_trained=rounds,
                       momentum={"w": torch.full((3,), 2 * value)})


def test_a_round_reads_the_newest_state_from_before_it(tmp_path):
    states = NodeStates(tmp_path)
    assert states.load(4, 0).tensors() == {} and states.load(4, 5).rounds_trained == 0
    states.save(4, 1, state(1.0, 1))
    states.save(4, 3, state(3.0, 2))
    assert states.load(4, 1).rounds_trained == 0  # round 1's own update is not in the state it starts from
    assert states.load(4, 2).personal["w"].tolist() == [1.0] * 3
    got = states.load(4, 7)
    assert got.rounds_trained == 2 and got.momentum["w"].tolist() == [6.0] * 3
    assert got.rule_state["c"].tolist() == [-3.0] * 2 and got.local_model["s"].tolist() == [3.0] * 2


def test_a_resumed_servers_lost_rounds_are_dropped_and_old_ones_pruned(tmp_path):
    states = NodeStates(tmp_path)
    for r in (0, 2, 5, 6, 8):
        states.save(1, r, state(float(r), r))
    states.save(2, 1, state(1.0, 1))
    # The server resumed from its checkpoint after round 6: rounds 6 and 8 were the lost run's.
    states.start_round([1, 2], 6, keep_rounds=3)
    assert sorted(p.name for p in (tmp_path / "client_1").iterdir()) == ["r2.safetensors", "r5.safetensors"]
    assert states.load(1, 6).personal["w"][0] == 5.0 and states.load(1, 3).personal["w"][0] == 2.0
    assert states.load(2, 6).personal["w"][0] == 1.0  # its newest older state stays


def test_node_data_round_trips_and_hosts_only_its_clients(tmp_path):
    cfg = config_from_dict({"data": {"dataset": "synthetic", "num_clients": 6, "new_clients": 1,
                                     "synthetic_train_per_class": 20, "synthetic_test_per_class": 5},
                            "train": {"rounds": 1}})
    setup = prepare(cfg)
    data = NodeData.from_setup(setup, [1, 4, 6])
    data.save(tmp_path / "node")
    back = NodeData.load(tmp_path / "node")
    assert back.client_ids == [1, 4, 6] and back.offsets == data.offsets
    assert back.train_x.equal(data.train_x) and back.counts.equal(data.counts)
    host = back.host(cfg)
    for cid in (1, 4, 6):
        rows = torch.as_tensor(setup.partition.client_indices[cid], dtype=torch.long)
        assert host.data(cid).x.equal(setup.dataset.train_x[rows])
    with pytest.raises(KeyError, match="not hosted"):
        host.data(0)
    with pytest.raises(FileNotFoundError, match="data-path"):
        NodeData.load(tmp_path / "elsewhere")


def test_what_crosses_the_wire_is_exact_and_holds_nothing_the_client_keeps():
    require_flower()
    from fedrod_ray_flower import wire
    from flwr.app import RecordDict

    data = make_data()
    message = RoundInput({"a": torch.randn(4, 3, dtype=torch.float32)}, {"c": torch.randn(2)},
                         {3: {"m": torch.arange(5)}, 9: {"m": torch.zeros(1)}}, 0.5)
    content = RecordDict()
    wire.put_round_input(content, message, [3])
    got = wire.round_input(content, [3], 0.5)
    assert got.weights["a"].equal(message.weights["a"]) and got.broadcast["c"].equal(message.broadcast["c"])
    assert list(got.per_client) == [3] and got.clip_norm == 0.5  # client 9's message is not this node's

    result = LocalResult(shared={"a": torch.randn(4, 3)}, num_samples=len(data), loss=0.1 + 0.2,
                         personal_loss=None, steps=7, seconds=1.5, upload={"u": torch.randn(2, dtype=torch.float64)},
                         objectives={"meta_bsm": {"secret": torch.ones(1)}}, momentum={"a": torch.ones(4, 3)},
                         clipped=True)
    reply = RecordDict()
    wire.put_result(reply, 5, result)
    wire.put_result(reply, 6, ClientFailure(6, "ValueError: boom", "trace"))
    back = wire.result(reply, 5)
    assert back.shared["a"].equal(result.shared["a"]) and back.upload["u"].dtype == torch.float64
    assert (back.loss, back.personal_loss, back.steps, back.clipped) == (0.1 + 0.2, None, 7, True)
    assert back.objectives == {} and back.momentum == {}  # the client keeps them
    assert wire.result(reply, 6) == ClientFailure(6, "ValueError: boom", "trace")
    assert wire.result(reply, 7).error.startswith("MissingResult")

    reply = RecordDict()
    wire.put_answer(reply, 2, {"g": torch.arange(3.0)})
    wire.put_answer(reply, 3, ClientFailure(3, "KeyError: 3", "trace"))
    assert wire.answer(reply, 2)["g"].equal(torch.arange(3.0))
    assert wire.answer(reply, 3) == ClientFailure(3, "KeyError: 3", "trace")
    assert wire.answer(reply, 4).error.startswith("MissingResult")

    counts = EvalCounts({2: torch.tensor([1, 2])}, {2: torch.tensor([3, 4])}, {8: "KeyError: x"})
    reply = RecordDict()
    wire.put_counts(reply, counts)
    back = wire.counts(reply)
    assert back.correct[2].equal(counts.correct[2]) and back.total[2].equal(counts.total[2])
    assert list(back.correct) == [2] and back.failed == {8: "KeyError: x"}


@pytest.mark.parametrize(("changes", "field"), [
    ({"train": {"head": "linear"}}, "train.head"),
    ({"train": {"head": "fedper", "balanced_loss": "ce"}}, "train.head"),
    ({"train": {"head": "gpfl", "balanced_loss": "ce"}}, "train.head: gpfl's server side"),
    ({"train": {"head": "fedcp", "balanced_loss": "ce"}}, "train.head: fedcp's server side"),
    ({"train": {"head": "feddbe", "balanced_loss": "ce"}}, "train.head: feddbe's server side"),
    ({"train": {"head": "fedala", "balanced_loss": "ce"}}, "train.head: fedala's PM is made at evaluation"),
    ({"rounds": {"mode": "fedbuff"}}, "rounds.mode"),
])
def test_the_server_app_refuses_what_it_cannot_run_on_flower(changes, field):
    require_flower()
    from fedrod_ray_flower.server_app import check_flower

    data = {"data": {"dataset": "synthetic", "num_clients": 4}, "train": {"rounds": 1}}
    for section, values in changes.items():
        data.setdefault(section, {}).update(values)
    with pytest.raises(ConfigError, match=field):
        check_flower(prepare(config_from_dict(data)))


def test_the_server_app_runs_hyper_ditto_and_every_rule():
    require_flower()
    from fedrod_ray_flower.server_app import check_flower

    for train in ({"head": "hyper", "generic_rule": "scaffold"}, {"head": "ditto", "balanced_loss": "ce"},
                  {"head": "none", "generic_rule": "feddyn"}, {"head": "perfedavg", "balanced_loss": "ce", "momentum": 0, "weight_decay": 0}):
        check_flower(prepare(config_from_dict({"data": {"dataset": "synthetic", "num_clients": 4},
                                               "train": {"rounds": 1, **train}})))


def test_a_deployed_supernode_never_takes_its_paths_from_the_servers_run_config(tmp_path):
    require_flower()
    from fedrod_ray_flower.node import node_paths, simulated

    assert not simulated()  # no Ray actor here, whether or not this process drives a Ray (ray_session)
    # A server's run config naming folders of its choosing for the simulated SuperNodes' data and states.
    steer = {"sim-data-path": str(tmp_path / "theirs"), "sim-state-path": str(tmp_path / "theirs-states")}
    (tmp_path / "theirs" / "node0").mkdir(parents=True)
    own = {"data-path": str(tmp_path / "mine"), "state-path": str(tmp_path / "my-states")}
    assert node_paths(own, steer, in_simulation=False) == (tmp_path / "mine", tmp_path / "my-states")
    # A deployed SuperNode whose node config names no data-path (Flower's own examples give deployed nodes a
    # partition-id) refuses rather than read and write where the server says.
    for config in ({}, {"partition-id": 0, "num-partitions": 1}):
        with pytest.raises(ValueError, match="names no data-path"):
            node_paths(config, steer, in_simulation=False)
    # Simulated SuperNode i (Flower's simulation engine gives it only these two keys): node<i> of each folder.
    assert node_paths({"partition-id": 0, "num-partitions": 1}, steer, in_simulation=True) == (
        tmp_path / "theirs" / "node0", tmp_path / "theirs-states" / "node0")
    with pytest.raises(ValueError, match="holds 1 SuperNodes' data, the simulation has 3"):
        node_paths({"partition-id": 0, "num-partitions": 3}, steer, in_simulation=True)
    with pytest.raises(ValueError, match="sim-data-path and sim-state-path"):
        node_paths({"partition-id": 0, "num-partitions": 1}, {}, in_simulation=True)


def test_the_server_app_asks_for_the_simulation_paths_only_on_the_simulation_engine(tmp_path):
    require_flower()
    from fedrod_ray_flower.server_app import check_simulation

    run = {"run-dir": str(tmp_path / "run")}
    sim = {**run, "sim-data-path": str(tmp_path / "nodes"), "sim-state-path": str(tmp_path / "states")}
    check_simulation(sim, simulation=True)
    check_simulation({**run, "sim-data-path": "", "sim-state-path": ""}, simulation=False)
    with pytest.raises(ConfigError, match="run config sim-data-path: has no effect on Flower's deployment"):
        check_simulation(sim, simulation=False)
    with pytest.raises(ConfigError, match="run config sim-state-path: Flower's simulation engine needs"):
        check_simulation({**sim, "sim-state-path": ""}, simulation=True)
    # The run directory holds nothing personal: the simulated nodes' states may not go inside it.
    with pytest.raises(ConfigError, match="run config sim-state-path: must be outside run-dir"):
        check_simulation({**sim, "sim-state-path": str(tmp_path / "run" / "states")}, simulation=True)
