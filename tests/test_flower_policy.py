"""A SuperNode's own policy (``fedrod_ray_flower.policy``), enforced on the node, from the attacker's side: a
server that asks a secure-only node for an evaluation or a method's answer, one that lists a SecAgg+ peer as
both active and dropped (Flower's own ``secaggplus_mod`` would reveal both its secrets) or runs SecAgg+ over
fewer nodes than the node's minimum, a run that reaches for another run's client states, a server of another
fedrod-ray version. Each message goes through the real ClientApp (its mods and handlers) or Flower's real
``secaggplus_mod``, as a SuperNode's ClientApp process receives it; no Flower process is started."""

from __future__ import annotations

import pytest
import torch
from flower_federation import require_flower

require_flower()

from fedrod_ray_flower import client_app, wire
from fedrod_ray_flower.node import NodeData, node_paths, run_key
from fedrod_ray_flower.policy import NodePolicy, PolicyRefusal, check_secagg_stage
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.compat.common import recorddict_compat as compat
from flwr.supercore.task_identity import TaskIdentity

from fedrod_ray import __version__
from fedrod_ray.client_update.local import RoundInput
from fedrod_ray.config import config_from_dict, dump_config
from fedrod_ray.federation_state.setup import prepare
from fedrod_ray.specs.methods import HEADS
from fedrod_ray.specs.rules import RULES


@pytest.fixture(autouse=True)
def clientapp_process(monkeypatch):
    """The task identity a SuperNode's ClientApp process has (Flower's ``Message`` reads it)."""
    for name in ("run_id", "node_id", "task_id"):
        monkeypatch.setattr(TaskIdentity, f"_{name}", 1)


def parse(**config) -> NodePolicy:
    return NodePolicy.from_node_config(config, HEADS, RULES)


# --- the policy, read from the node config --------------------------------------------------------------------

def test_a_node_without_policy_keys_answers_as_before_and_a_secure_one_keeps_everything_in_sums():
    assert parse() == NodePolicy(False, None, None, 2, "clients", True)
    assert parse(**{"secure-aggregation": True}) == NodePolicy(True, None, None, 2, "none", False)
    got = parse(**{"allowed-methods": "hyper, ditto,fedavg", "min-nodes": 4, "evaluate": "none"})
    assert (got.heads, got.rules, got.min_nodes, got.evaluate) == ({"hyper", "ditto"}, {"fedavg"}, 4, "none")
    got.check_method("ditto", "fedavg")
    with pytest.raises(PolicyRefusal, match="train.head 'pfedhn' is not in node config allowed-methods"):
        got.check_method("pfedhn", "fedavg")
    with pytest.raises(PolicyRefusal, match="train.generic_rule 'scaffold'"):
        got.check_method("hyper", "scaffold")
    parse(**{"allowed-methods": "scaffold"}).check_method("pefll", "scaffold")  # names no head: any head


@pytest.mark.parametrize(("config", "key"), [
    ({"secure-aggregation": "yes"}, "secure-aggregation"),
    ({"allowed-methods": "hyper,nonesuch"}, "allowed-methods"),
    ({"allowed-methods": "hyper,,ditto"}, "allowed-methods"),
    ({"allowed-methods": 3}, "allowed-methods"),
    ({"min-nodes": 1}, "min-nodes"),
    ({"min-nodes": 2.5}, "min-nodes"),
    ({"min-nodes": True}, "min-nodes"),
    ({"evaluate": "sometimes"}, "evaluate"),
    ({"secure-aggregation": True, "evaluate": "clients"}, "evaluate"),
    ({"answer-asks": 1}, "answer-asks"),
    ({"secure-aggregation": True, "answer-asks": True}, "answer-asks"),
    ({"min-node": 3}, "min-node"),  # a typo would leave the node unprotected: refused
])
def test_an_invalid_policy_is_an_error_naming_the_key(config, key):
    with pytest.raises((ValueError, TypeError), match=f"node config {key}:"):
        parse(**config)


def test_a_node_config_with_data_path_but_no_state_path_names_the_key(tmp_path):
    with pytest.raises(ValueError, match="names a data-path but no state-path"):
        node_paths({"data-path": str(tmp_path)}, {}, in_simulation=False)


# --- the ClientApp, on a node with data -----------------------------------------------------------------------

CFG = {"data": {"dataset": "synthetic", "num_clients": 6, "new_clients": 0, "synthetic_train_per_class": 6,
                "synthetic_test_per_class": 2},
       "train": {"rounds": 3, "head": "none", "local_epochs": 1, "batch_size": 20}, "run_dir": "/srv/runs/a"}


@pytest.fixture(scope="module")
def setup():
    return prepare(config_from_dict(CFG))


@pytest.fixture
def node(tmp_path, setup):
    NodeData.from_setup(setup, [0, 3]).save(tmp_path / "data")
    return {"data-path": str(tmp_path / "data"), "state-path": str(tmp_path / "states")}


def config(**changes) -> dict:
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in CFG.items()}
    for key, value in changes.items():
        section, name = key.split("__") if "__" in key else (None, key)
        (out[section] if section else out)[name] = value
    return out


def send(node_config: dict, kind: str, content: RecordDict) -> Message:
    context = Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config={})
    return client_app.app(Message(content, dst_node_id=1, message_type=kind), context)


def train(node_config: dict, cfg: dict, round_idx: int, setup) -> Message:
    content = RecordDict()
    wire.put_header(content, config=dump_config(config_from_dict(cfg)), round=round_idx, clients=[0],
                    clip_norm=None)
    wire.put_round_input(content, RoundInput(setup.build_model().state_dict()), [0])
    return send(node_config, MessageType.TRAIN, content)


def ask_or_evaluate(node_config: dict, action: str, setup) -> Message:
    content = RecordDict()
    header = {"phase": "descriptor", "round_idx": 0} if action == "ask" else {"estimate": False}
    wire.put_header(content, config=dump_config(config_from_dict(CFG)), clients=[0], rounds_done=1,
                    action=action, **header)
    wire.put_round_input(content, RoundInput(setup.build_model().state_dict()), [0])
    return send(node_config, MessageType.EVALUATE, content)


def test_a_secure_only_node_refuses_a_servers_evaluation_and_ask(node, setup, tmp_path):
    # A node without a policy answers each of its clients' test counts: what a server gets in the clear.
    train(node, CFG, 0, setup)
    counts = wire.counts(ask_or_evaluate(node, "evaluate", setup).content)
    assert list(counts.total) == [0] and not counts.failed
    secure = {**node, "secure-aggregation": True}
    for action in ("evaluate", "finetune", "zero_shot", "ask"):
        with pytest.raises(PolicyRefusal, match="refused by this SuperNode's policy: node config") as refused:
            ask_or_evaluate(secure, action, setup)
        assert "secure-aggregation=true" in str(refused.value)
    with pytest.raises(PolicyRefusal, match="answer-asks=false"):
        ask_or_evaluate({**node, "answer-asks": False}, "ask", setup)
    with pytest.raises(PolicyRefusal, match="evaluate=none"):
        ask_or_evaluate({**node, "evaluate": "none"}, "evaluate", setup)


def test_a_node_refuses_a_run_of_a_method_it_does_not_allow_and_an_invalid_policy(node, setup, tmp_path):
    with pytest.raises(PolicyRefusal, match="train.head 'none' is not in node config allowed-methods"):
        train({**node, "allowed-methods": "hyper,ditto"}, CFG, 0, setup)
    with pytest.raises(ValueError, match="node config min-nodes:"):
        train({**node, "min-nodes": 0}, CFG, 0, setup)
    assert not (tmp_path / "states").exists()  # nothing trained, nothing kept


def test_a_node_refuses_a_server_of_another_fedrod_ray_version_naming_both(node):
    content = RecordDict()
    wire.put_header(content)
    assert wire.header(send(node, MessageType.QUERY, content).content)["clients"] == [0, 3]
    content["header"] = ConfigRecord({**content["header"], wire.VERSION: "0.0.1"})
    with pytest.raises(wire.VersionMismatch, match=f"fedrod-ray 0.0.1, this SuperNode {__version__}"):
        send(node, MessageType.QUERY, content)
    del content["header"][wire.VERSION]
    with pytest.raises(wire.VersionMismatch, match="a version that sends none"):
        send(node, MessageType.QUERY, content)


def saved(node_config: dict) -> dict[str, bytes]:
    states = node_paths(node_config, {}, in_simulation=False)[1]
    return {str(p.relative_to(states)): p.read_bytes() for p in sorted(states.rglob("*.safetensors"))}


def kept_rounds(node_config: dict, cfg: dict, round_idx: int) -> int:
    from fedrod_ray_flower.node import NodeStates

    root = node_paths(node_config, {}, in_simulation=False)[1] / run_key(config_from_dict(cfg))
    return NodeStates(root).load(0, round_idx + 1).rounds_trained


def test_run_b_cannot_read_or_delete_run_as_client_states(node, setup):
    train(node, CFG, 0, setup)
    train(node, CFG, 1, setup)
    a = saved(node)
    assert len(a) == 2 and kept_rounds(node, CFG, 1) == 2
    # Run B: another config (or another run directory) on the same node. Its round 5 starts from its own
    # (empty) state, not from run A's newest; its round 0, which drops every state of B from round 0 on, and
    # its pruning of old rounds leave run A's states as they were.
    for other in (config(seed=7), config(run_dir="/srv/runs/b")):
        train(node, other, 5, setup)
        assert kept_rounds(node, other, 5) == 1
        train(node, other, 0, setup)
        assert {k: v for k, v in saved(node).items() if k in a} == a
    # Run A resumed (a config whose only change a resumed run may make: more rounds) finds its own states.
    resumed = config(train__rounds=5)
    assert run_key(config_from_dict(resumed)) == run_key(config_from_dict(CFG))
    train(node, resumed, 2, setup)
    assert kept_rounds(node, resumed, 2) == 3


# --- SecAgg+'s stages, through Flower's real secaggplus_mod -----------------------------------------------------

def stage(context: Context, node_id: int, configs: dict, policy_check: bool = True) -> dict:
    """One SecAgg+ stage's message to node ``node_id``, through this node's mod (or Flower's alone): its reply's
    config record. The masked-vector stage's training returns a fixed vector (what is under test is the mod)."""
    content = RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(configs)})
    msg = Message(content, dst_node_id=node_id, message_type=MessageType.TRAIN)

    def trained(m: Message, _ctx: Context) -> Message:
        res = FitRes(Status(Code.OK, "ok"), ndarrays_to_parameters([torch.ones(4).double().numpy()]), 1, {})
        return Message(compat.fitres_to_recorddict(res, keep_input=True), reply_to=m)

    mod = client_app.secagg_where_asked if policy_check else secaggplus_mod
    return dict(mod(msg, context, trained).content.config_records[RECORD_KEY_CONFIGS])


def three_nodes_until_unmask(min_nodes: int = 2) -> dict[int, Context]:
    """Three nodes through SecAgg+'s first three stages, as Flower's workflow routes their messages."""
    ids = (11, 22, 33)
    contexts = {n: Context(run_id=1, node_id=n, node_config={"min-nodes": min_nodes}, state=RecordDict(),
                           run_config={}) for n in ids}
    setup_configs = {Key.STAGE: Stage.SETUP, Key.SAMPLE_NUMBER: 3, Key.SHARE_NUMBER: 3, Key.THRESHOLD: 2,
                     Key.CLIPPING_RANGE: 4.0, Key.TARGET_RANGE: 2**20, Key.MOD_RANGE: 2**32, Key.MAX_WEIGHT: 1.0}
    keys = {n: stage(contexts[n], n, dict(setup_configs)) for n in ids}
    public = {str(n): [keys[n][Key.PUBLIC_KEY_1], keys[n][Key.PUBLIC_KEY_2]] for n in ids}
    shared = {n: stage(contexts[n], n, {Key.STAGE: Stage.SHARE_KEYS, **public}) for n in ids}
    for n in ids:
        srcs = [m for m in ids if m != n]
        ctxts = [shared[m][Key.CIPHERTEXT_LIST][shared[m][Key.DESTINATION_LIST].index(n)] for m in srcs]
        stage(contexts[n], n, {Key.STAGE: Stage.COLLECT_MASKED_VECTORS, Key.CIPHERTEXT_LIST: ctxts,
                               Key.SOURCE_LIST: srcs})
    return contexts


def unmask(active: list[int], dead: list[int]) -> dict:
    return {Key.STAGE: Stage.UNMASK, Key.ACTIVE_NODE_ID_LIST: active, Key.DEAD_NODE_ID_LIST: dead}


def test_an_unmask_request_listing_a_peer_as_active_and_dead_is_refused():
    import copy

    contexts = three_nodes_until_unmask()
    victim = contexts[11]
    # What Flower's secaggplus_mod alone answers (on a copy of node 11's state): both of node 22's secrets, the
    # share of its private mask and of the key of its pairwise masks, which unmask its vector in the clear.
    alone = copy.deepcopy(victim)
    leaked = stage(alone, 11, unmask([11, 22, 33], [22]), policy_check=False)
    assert leaked[Key.NODE_ID_LIST].count(22) == 2
    with pytest.raises(PolicyRefusal, match=r"lists nodes \[22\] as both active and dropped"):
        stage(victim, 11, unmask([11, 22, 33], [22]))
    with pytest.raises(PolicyRefusal, match=r"names nodes \[44\], which are not this node's neighbours"):
        stage(victim, 11, unmask([11, 22], [44]))
    # An honest unmask request (node 33 dropped) goes through.
    honest = stage(victim, 11, unmask([11, 22], [33]))
    assert honest[Key.NODE_ID_LIST] == [11, 22, 33] and len(honest[Key.SHARE_LIST]) == 3


def test_secagg_over_fewer_nodes_than_the_nodes_minimum_is_refused_before_it_sends_anything():
    context = Context(run_id=1, node_id=5, node_config={"min-nodes": 3}, state=RecordDict(), run_config={})
    setup_configs = {Key.STAGE: Stage.SETUP, Key.SAMPLE_NUMBER: 2, Key.SHARE_NUMBER: 2, Key.THRESHOLD: 2,
                     Key.CLIPPING_RANGE: 4.0, Key.TARGET_RANGE: 2**20, Key.MOD_RANGE: 2**32, Key.MAX_WEIGHT: 1.0}
    with pytest.raises(PolicyRefusal, match="aggregates 2 nodes, fewer than node config min-nodes=3"):
        stage(context, 5, setup_configs)
    assert not context.state.config_records  # no keys made, nothing kept
    # Three nodes with a minimum of three: an unmask stage with one of them dropped is refused.
    contexts = three_nodes_until_unmask(min_nodes=3)
    with pytest.raises(PolicyRefusal, match="2 active neighbours .* fewer than node config min-nodes=3"):
        stage(contexts[11], 11, unmask([11, 22], [33]))


def test_check_secagg_stage_counts_what_the_node_sees():
    check_secagg_stage(Stage.SETUP, {Key.SAMPLE_NUMBER: 3}, 3, 0, [])
    # Neighbourhoods of share_num nodes, which the server stated: the node asks for min(min-nodes, share_num).
    check_secagg_stage(Stage.SHARE_KEYS, {Key.STAGE: Stage.SHARE_KEYS, "1": [b"a", b"b"], "2": [b"c", b"d"],
                                          "3": [b"e", b"f"]}, 5, 3, [])
    with pytest.raises(PolicyRefusal, match="gave this node 2 neighbours"):
        check_secagg_stage(Stage.SHARE_KEYS, {Key.STAGE: Stage.SHARE_KEYS, "1": [b"a", b"b"], "2": [b"c", b"d"]},
                           5, 3, [])
