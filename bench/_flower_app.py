"""The Flower side of bench/flower_compare.py (imported as ``_flower_app`` by Flower 1.42's Python, in the
driver and in every client actor; not part of the library): the job as a Flower ServerApp and ClientApp.

The server runs Flower's FedAvg, except that each round's training goes to fedrod-ray's sampled clients
(``server_math.server.sample_clients``): each message tells its node which client to be. A client actor loads the dataset
and its partition once, with fedrod-ray's loader, and trains fedrod-ray's model with plain SGD on the
client's examples, as fedrod-ray's local update does for FedAvg.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from flower_compare import job_config
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.strategy_utils import sample_nodes

from fedrod_ray.client_update.local import round_lr
from fedrod_ray.data import load_dataset
from fedrod_ray.data.transforms import normalize
from fedrod_ray.federation_state.setup import partition_dataset
from fedrod_ray.personalization import build_method, method_model
from fedrod_ray.server_math.server import sample_clients

ROUNDS = 1  # set by flower_compare before the simulation starts
ROUND_ENDS: list[float] = []  # perf_counter() after the initial weights and after each round
CFG = job_config(ROUNDS)  # what the rounds do not change: data, model, local training
_data: dict = {}  # this process's dataset and partition, loaded by its first client


def build_model():
    return method_model(CFG, build_method(CFG.train.head, CFG.train.head_params), 10, (1, 28, 28))


class SameClients(FedAvg):
    """FedAvg whose round trains the clients fedrod-ray samples for it, one per sampled node."""

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        n = CFG.data.num_clients
        ids = sample_clients(CFG.seed, server_round - 1, n, CFG.train.client_fraction)
        nodes, _ = sample_nodes(grid, n, len(ids))
        lr = round_lr(CFG.train, server_round - 1)
        return [Message(RecordDict({"arrays": arrays, "config": ConfigRecord({"client": cid, "lr": lr})}),
                        message_type=MessageType.TRAIN, dst_node_id=node) for node, cid in zip(nodes, ids)]


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    strategy = SameClients(fraction_evaluate=0.0, min_available_nodes=CFG.data.num_clients)
    strategy.start(grid, ArrayRecord(build_model().state_dict()), num_rounds=ROUNDS,
                   evaluate_fn=lambda server_round, arrays: ROUND_ENDS.append(time.perf_counter()))


client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    torch.set_num_threads(1)
    if not _data:
        ds = load_dataset(CFG.data, seed=CFG.seed)
        _data.update(ds=ds, part=partition_dataset(CFG, ds))
    ds, t, config = _data["ds"], CFG.train, msg.content["config"]
    cid = int(config["client"])
    idx = torch.from_numpy(_data["part"].client_indices[cid])
    x, y = normalize(ds.train_x[idx], ds.mean, ds.std), ds.train_y[idx]
    model = build_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=float(config["lr"]), momentum=t.momentum,
                          weight_decay=t.weight_decay)
    gen = torch.Generator().manual_seed(CFG.seed * 100_003 + cid)
    for _ in range(t.local_epochs):
        for b in torch.randperm(len(y), generator=gen).split(t.batch_size):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[b].contiguous(memory_format=torch.channels_last)), y[b]).backward()
            opt.step()
    reply = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord({"num-examples": len(y)})})
    return Message(reply, reply_to=msg)
