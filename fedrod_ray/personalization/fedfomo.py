"""FedFOMO (Zhang et al., 2021): each client combines the models of the clients that help it most.

Each client keeps its whole model w_m (the initial weights the first time) and splits its training data
80/20 into train and validation (seeded, fixed). The server keeps every client's last upload and, for
each client, an affinity vector p_m (zeros at first). Per round client m receives n other clients' models,
chosen by epsilon-greedy on p_m among those the server has (each pick: with probability epsilon a random
one, else the highest affinity; epsilon decays by a fixed step per round, floor 0). On its validation split
it weighs each received w_n by u_n = (L_m(w_m) - L_m(w_n)) / ||w_n - w_m||_1, adds u_n to p_m[n] (returned
to the server), and moves w_m <- w_m + sum_n max(u_n, 0) (w_n - w_m) / sum_n max(u_n, 0) (unchanged if no
u_n is positive); then E epochs of SGD on its train split, and uploads w_m. No global model: the GM is the
mean of the clients' models; the PM is w_m.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from ..client_update.local import ClientData, derived_seed
from ..data.transforms import normalize
from ..server_math.aggregate import StateDict
from ..specs.methods import FedFomoParams
from .mtl import OwnModels
from .registry import register
from .sgd import client_batches, optimizer, result, sgd_epochs

SPLIT_TAG = 13  # the client's train / validation split
CHOICE_TAG = 14  # the server's epsilon-greedy draws

AFFINITY = "affinity"  # server state: (M, M) float64, row m is p_m
IDS = "ids"  # a message's and an upload's: the ids of the received models


def choose(affinity: torch.Tensor, candidates: list[int], n: int, epsilon: float,
           rng: np.random.Generator) -> list[int]:
    """Up to ``n`` distinct ``candidates``, each pick random with probability ``epsilon``, else the one with the
    highest ``affinity`` (the lowest id among equals)."""
    left, chosen = sorted(candidates), []
    while left and len(chosen) < n:
        if rng.random() < epsilon:
            pick = left[int(rng.integers(len(left)))]
        else:
            pick = max(left, key=lambda c: (float(affinity[c]), -c))
        chosen.append(pick)
        left.remove(pick)
    return chosen


def fomo_weights(own_loss: float, losses: list[float], distances: list[float]) -> list[float]:
    """u_n = (L(w_m) - L(w_n)) / ||w_n - w_m||_1 (0 for a model identical to w_m)."""
    return [(own_loss - loss) / dist if dist > 0 else 0.0 for loss, dist in zip(losses, distances)]


def fomo_mix(own: StateDict, models: list[StateDict], u: list[float]) -> StateDict:
    """w_m + sum_n max(u_n, 0) (w_n - w_m) / sum_n max(u_n, 0); ``own`` itself when no u_n is positive."""
    pos = [max(x, 0.0) for x in u]
    total = sum(pos)
    if total == 0:
        return own
    return {k: v + sum((wn * (m[k] - v) for wn, m in zip(pos, models) if wn > 0), torch.zeros_like(v)) / total
            if v.is_floating_point() else v for k, v in own.items()}


def l1_distance(a: StateDict, b: StateDict) -> float:
    return float(sum((a[k].double() - b[k].double()).abs().sum() for k in a if a[k].is_floating_point()))


def train_val_split(n: int, fraction: float, seed: int, client_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train rows, validation rows) of a client's n examples: a seeded permutation, its first
    round(fraction n) rows for validation (none when that would leave no training example)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(derived_seed(seed, client_id, SPLIT_TAG)))
    n_val = round(fraction * n)
    if n_val >= n:
        n_val = 0
    return order[n_val:], order[:n_val]


@register
class FedFomo(OwnModels):
    name = "fedfomo"
    Params = FedFomoParams

    def init_server_state(self, ctx):
        return {AFFINITY: torch.zeros(ctx.num_clients, ctx.num_clients, dtype=torch.float64)}

    def messages(self, server_state, ids, uploads, round_idx, seed, ask):
        p = self.params
        epsilon = max(0.0, p.epsilon - p.epsilon_decay * round_idx)
        affinity = server_state[AFFINITY]
        out = {}
        uploaded = [c for c, up in uploads.items() if up is not None]
        for cid in ids:
            have = [c for c in uploaded if c != cid]
            chosen = choose(affinity[cid], have, p.models, epsilon,
                            np.random.default_rng([seed, round_idx, cid, CHOICE_TAG]))
            msg = {IDS: torch.tensor(chosen, dtype=torch.long)}
            msg.update({f"{n}/{k}": v for n in chosen for k, v in uploads[n].items()})
            out[cid] = msg
        return out

    def server_update(self, averaged, results, uploads, server_state, initial, num_clients, ask):
        affinity = server_state[AFFINITY].clone()
        for cid, res in results.items():
            if res.method_upload:
                affinity[cid, res.method_upload[IDS]] += res.method_upload["u"]
        weights, _ = super().server_update(averaged, results, uploads, server_state, initial, num_clients, ask)
        return weights, {AFFINITY: affinity}

    def train(self, model, message, data, personal, local_model, rule_state, objectives, momentum, ctx):
        t0 = time.perf_counter()
        self.start(model, local_model, ctx)
        train_rows, val_rows = train_val_split(len(data), self.params.val_fraction, ctx.seed, ctx.client_id)
        inbox = message.per_client.get(ctx.client_id, {})
        ids = inbox.get(IDS, torch.zeros(0, dtype=torch.long))
        u: list[float] = []
        if len(ids) and len(val_rows):
            own = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            models = [{k[len(f"{n}/"):]: v for k, v in inbox.items() if k.startswith(f"{n}/")} for n in ids.tolist()]
            x = normalize(data.x[val_rows], ctx.mean, ctx.std).to(ctx.device)
            y = data.y[val_rows].to(ctx.device)
            own_loss = val_loss(model, x, y)
            losses = []
            for m in models:
                model.load_partial(m)
                losses.append(val_loss(model, x, y))
            u = fomo_weights(own_loss, losses, [l1_distance(m, own) for m in models])
            model.load_partial(fomo_mix(own, models, u))
        model.train()
        train = ClientData(data.x[train_rows], data.y[train_rows],
                           torch.bincount(data.y[train_rows], minlength=len(data.counts)))
        loss, steps = sgd_epochs(model, optimizer(model.parameters(), ctx), client_batches(train, ctx))
        upload = {IDS: ids, "u": torch.tensor(u, dtype=torch.float64)} if len(u) else {}
        return result(model, num_samples=len(train), loss=loss, steps=steps, t0=t0, upload=upload), None, {}


@torch.no_grad()
def val_loss(model, x: torch.Tensor, y: torch.Tensor, batch: int = 1000) -> float:
    """The mean cross-entropy of the model on (x, y)."""
    model.eval()
    total = sum(F.cross_entropy(model(x[i:i + batch].contiguous(memory_format=torch.channels_last)),
                                y[i:i + batch], reduction="sum").item() for i in range(0, len(y), batch))
    return total / len(y) if len(y) else math.nan
