"""The ClientApp each SuperNode runs: fedrod-ray's ``ClientHost`` over the node's own clients.

Its node config names ``data-path`` (what ``split`` wrote: this participant's clients and the test set) and
``state-path`` (where their state stays, ``NodeStates``). The server's messages carry the run's config, the
round and the clients to train or evaluate; the replies carry what ``ClientHost.train`` gives the server and
nothing the client keeps."""

from __future__ import annotations

import yaml
from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedrod_ray.clients.client import ClientFailure, ClientHost, ClientState
from fedrod_ray.config import config_from_dict

from . import wire
from .node import NodeData, NodeStates

app = ClientApp()


def _node(context: Context, content: RecordDict) -> tuple[dict, NodeData, NodeStates, ClientHost | None]:
    head = wire.header(content)
    data = NodeData.load(context.node_config["data-path"])
    states = NodeStates(context.node_config["state-path"])
    host = None
    if "config" in head:
        cfg = config_from_dict(yaml.safe_load(head["config"]))
        import torch

        torch.set_num_threads(cfg.runtime.torch_threads or 1)
        host = data.host(cfg)
    return head, data, states, host


@app.query()
def query(msg: Message, context: Context) -> Message:
    """The clients this node hosts."""
    data = NodeData.load(context.node_config["data-path"])
    reply = RecordDict()
    wire.put_header(reply, clients=data.client_ids)
    return Message(reply, reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round's local updates of this node's sampled clients, each from its own state on this disk; the
    new states stay here."""
    head, data, states, host = _node(context, msg.content)
    r, ids = head["round"], head["clients"]
    states.start_round(data.client_ids, r, 2 * host.cfg.runtime.checkpoint_every + 1)
    message = wire.round_input(msg.content, ids, head["clip_norm"])
    reply = RecordDict()
    for cid in ids:
        out = host.train(cid, states.load(cid, r), message, r)
        if not isinstance(out, ClientFailure):
            result, state = out
            states.save(cid, r, state)
            out = result
        wire.put_result(reply, cid, out)
    return Message(reply, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """The answers of this node's clients to the method's question (``ClientHost.answer``), or test counts of
    their personalized models (``ClientHost.evaluate``), after their
    adaptation (``ClientHost.finetune``) or of the zero-shot models of those that never trained
    (``ClientHost.zero_shot``), each from its own state after the server's rounds so far."""
    head, _, states, host = _node(context, msg.content)
    done, ids, action = head["rounds_done"], head["clients"], head["action"]
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
