"""The ClientApp each SuperNode runs: fedrod-ray's ``ClientHost`` over the node's own clients.

Its node config (set by the organization that runs the node, never by the server) names ``data-path`` (what
``split`` wrote: this participant's clients and the test set) and ``state-path`` (where their state stays,
``NodeStates``, in one folder per run: ``node.run_key``), and states the node's own policy (``policy``):
``secure-aggregation=true`` (its clients' updates leave it only within SecAgg+), ``allowed-methods``,
``min-nodes``, ``evaluate``, ``answer-asks``. Every message is checked against the policy and the server's
fedrod-ray version before the node answers; each SecAgg+ stage's inputs too (``secagg_where_asked``). On
Flower's simulation engine the run config places each simulated node instead (``node_paths``). The server's
messages carry the run's config, the round and the clients to train or evaluate; the replies carry what
``ClientHost.train`` gives the server (under SecAgg+: the node's sums, masked) and nothing the client keeps."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from flwr.app import Context, Message, MessageType, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState
from flwr.clientapp import ClientApp
from flwr.common import Code, FitRes, ndarrays_to_parameters
from flwr.common import Status as FlowerStatus
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, RECORD_KEY_STATE, Key
from flwr.compat.common import recorddict_compat as compat

from fedrod_ray.clients.client import ClientFailure, ClientHost, ClientState
from fedrod_ray.config import config_from_dict
from fedrod_ray.specs.methods import HEADS
from fedrod_ray.specs.rules import RULES

from . import distributed, secure, wire
from .node import NodeData, NodeStates, node_paths, run_key, simulated
from .policy import NodePolicy, check_secagg_stage


def policy(context: Context) -> NodePolicy:
    """This node's policy, from its node config (an error naming a key whose value is not valid)."""
    return NodePolicy.from_node_config(context.node_config, HEADS, RULES)


def secagg_where_asked(msg: Message, context: Context, call_next):
    """Flower's ``secaggplus_mod`` on the messages of a SecAgg+ round (its four stages), once this node has
    checked the stage's inputs against its policy (``policy.check_secagg_stage``: the aggregate's size, and at
    unmask, active and dropped neighbours disjoint); none on the rest."""
    if RECORD_KEY_CONFIGS not in msg.content.config_records:
        return call_next(msg, context)
    if msg.metadata.message_type == MessageType.TRAIN:
        configs = msg.content.config_records[RECORD_KEY_CONFIGS]
        # What secaggplus_mod kept from this node's earlier stages: the share number, its neighbours' keys.
        kept = SecAggPlusState(**context.state.config_records.get(RECORD_KEY_STATE, {}))
        check_secagg_stage(str(configs.get(Key.STAGE, "")), configs, policy(context).min_nodes, kept.share_num,
                           getattr(kept, "public_keys_dict", {}))  # set from its share_keys stage on
    return secaggplus_mod(msg, context, call_next)


app = ClientApp(mods=[secagg_where_asked])


def _paths(context: Context) -> tuple[Path, Path]:
    """This node's data folder and its clients' states folder (``node.node_paths``)."""
    return node_paths(context.node_config, context.run_config, simulated())


def _node(context: Context, head: dict) -> tuple[NodeData, NodeStates, ClientHost]:
    """This node's data, its clients' states in the run whose config the server's message ``head`` carries
    (``node.run_key``) and fedrod-ray's client host over its clients, once the node's policy allows the run's
    method and rule."""
    cfg = config_from_dict(yaml.safe_load(head["config"]))
    policy(context).check_method(cfg.train.head, cfg.train.generic_rule)
    data_path, state_path = _paths(context)
    data, states = NodeData.load(data_path), NodeStates(state_path / run_key(cfg))
    import torch

    torch.set_num_threads(cfg.runtime.torch_threads or 1)
    return data, states, data.host(cfg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """The clients this node hosts, to a server of this node's fedrod-ray version whose policy is valid."""
    wire.check_version(msg.content["header"])
    policy(context)
    data = NodeData.load(_paths(context)[0])
    reply = RecordDict()
    wire.put_header(reply, clients=data.client_ids)
    return Message(reply, reply_to=msg)


def _train_clients(head: dict, data: NodeData, states: NodeStates, host: ClientHost, message) -> dict:
    """Round ``head["round"]``'s local updates of this node's clients ``head["clients"]``, each from its own
    state on this disk; the new states stay here. Each client's result or failure, by id."""
    r, ids = head["round"], head["clients"]
    states.start_round(data.client_ids, r, 2 * host.cfg.runtime.checkpoint_every + 1)
    out = {}
    for cid in ids:
        out[cid] = host.train(cid, states.load(cid, r), message, r)
        if not isinstance(out[cid], ClientFailure):
            result, state = out[cid]
            states.save(cid, r, state)
            out[cid] = result
    return out


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round's local updates of this node's sampled clients: their results (under SecAgg+, its stage that
    collects the masked vectors: the node's sums, which ``secaggplus_mod`` masks)."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return Message(_train_secure(msg.content, context), reply_to=msg)
    wire.check_version(msg.content["header"])
    policy(context).check_plain_train()
    head = wire.header(msg.content)
    data, states, host = _node(context, head)
    results = _train_clients(head, data, states, host, wire.round_input(msg.content, head["clients"],
                                                                         head["clip_norm"]))
    reply = RecordDict()
    for cid, out in results.items():
        wire.put_result(reply, cid, out)
    return Message(reply, reply_to=msg)


def _train_secure(content: RecordDict, context: Context) -> RecordDict:
    """SecAgg+'s instructions to this node (``wire.fit_ins``): its clients trained, their sums as one vector
    (``secure.node_vector``), and in the clear only which clients took part or failed."""
    ins = compat.recorddict_to_fitins(content, keep_input=True)
    wire.check_version(ins.config)
    head, message = wire.from_fit_ins(ins)
    data, states, host = _node(context, head)
    results = _train_clients(head, data, states, host, message)
    done = {cid: res for cid, res in results.items() if not isinstance(res, ClientFailure)}
    layout = secure.Layout.from_json(head["layout"])
    if "distributed" in head:  # distributed DP: the node noises its share (``distributed``)
        vector = distributed.node_vector_for(head, list(done.values()), message.weights, layout.keys("clipped"),
                                             min(head["clients"] or data.client_ids))
    else:
        vector = secure.node_vector(list(done.values()), message.weights, layout, secure.Scales(*head["scales"]),
                                    host.rule.aggregation_weight, head["clipping_range"])
    report = {"done": sorted(done), "failed": {str(c): f.error for c, f in results.items() if c not in done},
              "personal": any(res.personal_loss is not None for res in done.values())}
    # num_examples 1 = SecAgg+'s max_weight: the vector goes in unweighted (``FlowerExecutor.train_sums``).
    return compat.fitres_to_recorddict(FitRes(FlowerStatus(Code.OK, "ok"), ndarrays_to_parameters([vector]), 1,
                                              {"json": json.dumps(report)}), keep_input=True)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """The answers of this node's clients to the method's question (``ClientHost.answer``), or test counts of
    their personalized models (``ClientHost.evaluate``), after their
    adaptation (``ClientHost.finetune``) or of the zero-shot models of those that never trained
    (``ClientHost.zero_shot``), each from its own state after the server's rounds so far."""
    wire.check_version(msg.content["header"])
    head = wire.header(msg.content)
    rules, action = policy(context), head["action"]
    if action == "ask":
        rules.check_ask()
    else:
        rules.check_evaluate(action)
    _, states, host = _node(context, head)
    done, ids = head["rounds_done"], head["clients"]
    message = wire.round_input(msg.content, ids, None)
    if action == "ask":
        reply = RecordDict()
        for cid in ids:
            wire.put_answer(reply, cid, host.answer(cid, head["phase"], message.weights,
                                                    message.per_client.get(cid, {}), head["round_idx"]))
        return Message(reply, reply_to=msg)
    jobs = []
    for cid in ids:
        if host.method.pm_from_global and action == "evaluate":
            # The PM the server made (``Personalization.pm_job``) from its own state, which holds nothing personal.
            state = ClientState.from_tensors(message.per_client[cid], done)
        else:
            state = states.load(cid, done)
        jobs.append((cid, state))
    if action == "evaluate":
        counts = host.evaluate(jobs, head["estimate"])
    elif action == "finetune":
        counts = host.finetune([(cid, s.for_training()) for cid, s in jobs], message, head["epochs"],
                               head["round_idx"])
    else:
        counts = host.zero_shot(jobs, message, head["round_idx"])
    reply = RecordDict()
    wire.put_counts(reply, counts)
    return Message(reply, reply_to=msg)
