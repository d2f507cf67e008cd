"""pFedHN (Shamsian, Navon, Fetaya & Chechik, ICML 2021): a server hypernetwork generates each client's model.

The server holds a hypernetwork H(v; phi), an MLP from a client embedding v to every weight of the client's
model (one linear output head per weight tensor), and one learnable embedding v_m per training client. Per
round each sampled client m receives w_m = H(v_m; phi), runs E epochs of SGD from it and returns its model
w~_m; the server takes Delta_m = w_m - w~_m and, one returned client after another in increasing id, steps
phi and the embeddings along the vector-Jacobian products (dw_m/dphi)^T Delta_m and (dw_m/dv_m)^T Delta_m
(at the current phi, the gradients' total norm clipped to 50) with SGD at ``server_lr`` (momentum 0.9,
weight decay 1e-3, the official code's). PM = H(v_m; phi); there is no global model: the global weights
the server keeps are the GM, the mean over the training clients of their PMs.

A client that never trained receives phi and the mean of the training clients' embeddings: its zero-shot
model is H at that mean; its adaptation learns its own embedding v_new from there, phi frozen, by E epochs
of SGD on the cross-entropy of H(v_new; phi) on its training data (the fine-tuning rows' epochs and
learning rate).
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from ..client_update.local import derived_seed
from ..server_math.aggregate import StateDict
from ..specs.methods import PFedHNParams
from .base import Personalization, mean_state
from .registry import register
from .sgd import check_finite, client_batches, optimizer, result, sgd_epochs, start

INIT_TAG = 15  # seeds the hypernetwork's and the embeddings' initial values
FIT_TAG = 18  # a new client's batch order while it learns its embedding
HIDDEN_LAYERS = 3  # the official code's n_hidden: the MLP is Linear, then 3 x (ReLU, Linear)
MOMENTUM = 0.9  # the official code's server SGD
WEIGHT_DECAY = 1e-3
CLIP_NORM = 50.0  # the official code clips the server gradients' total norm

EMBEDDINGS = "embeddings"  # server state: (M, embed_dim), row m is v_m
MEAN_EMBEDDING = "mean_embedding"  # a new client's message: where its embedding starts
NET = "hnet/"  # server state: the hypernetwork's parameters by name
MOMENTUM_BUFFER = "momentum/"  # server state: SGD's momentum buffer of each of the above, by its key


class HyperNetwork(nn.Module):
    """H(v; phi): an MLP (``layers`` ReLU-separated linear layers of width ``hidden``) from an embedding to
    features, then one linear head per weight tensor of the target model, reshaped to it."""

    def __init__(self, embed_dim: int, hidden: int, shapes: dict[str, torch.Size], layers: int = HIDDEN_LAYERS):
        super().__init__()
        mlp: list[nn.Module] = [nn.Linear(embed_dim, hidden)]
        for _ in range(layers):
            mlp += [nn.ReLU(), nn.Linear(hidden, hidden)]
        self.mlp = nn.Sequential(*mlp)
        self.keys = list(shapes)
        self.shapes = [torch.Size(s) for s in shapes.values()]
        self.heads = nn.ModuleList(nn.Linear(hidden, math.prod(s)) for s in self.shapes)

    def forward(self, v: torch.Tensor) -> dict[str, torch.Tensor]:
        features = self.mlp(v)
        return {k: head(features).view(shape) for k, head, shape in zip(self.keys, self.heads, self.shapes)}


def hypernetwork_for(phi: StateDict, model: nn.Module) -> HyperNetwork:
    """The structure of the hypernetwork whose parameters are ``phi`` (server-state keys), generating
    ``model``'s weights: what a client that receives phi computes with."""
    first = phi[NET + "mlp.0.weight"]
    return HyperNetwork(first.shape[1], first.shape[0], {k: v.shape for k, v in model.state_dict().items()})


def embed_dim(params: PFedHNParams, num_clients: int) -> int:
    """The embeddings' size: as set, else the official code's 1 + M / 4 (rounded down)."""
    return params.embed_dim if params.embed_dim is not None else int(1 + num_clients / 4)


def generate(net: HyperNetwork, state: StateDict, v: torch.Tensor) -> dict[str, torch.Tensor]:
    """H(v; phi) with phi the server state's hypernetwork."""
    return functional_call(net, {k[len(NET):]: t for k, t in state.items() if k.startswith(NET)}, (v,))


def hyper_vjp(net: HyperNetwork, state: StateDict, v: torch.Tensor,
              cotangent: StateDict) -> tuple[StateDict, torch.Tensor]:
    """The vector-Jacobian products of w = H(v; phi) with ``cotangent`` (a tensor per weight of w):
    ((dw/dphi)^T c for each of phi's tensors, by the server state's keys, and (dw/dv)^T c)."""
    phi = {k: t.detach().requires_grad_() for k, t in state.items() if k.startswith(NET)}
    v = v.detach().requires_grad_()
    w = generate(net, phi, v)
    *grads, grad_v = torch.autograd.grad(list(w.values()), [*phi.values(), v],
                                         grad_outputs=[cotangent[k] for k in w])
    return dict(zip(phi, grads)), grad_v


def hyper_grads(net: HyperNetwork, state: StateDict, client: int, delta: StateDict) -> StateDict:
    """The vector-Jacobian products of w_m = H(v_m; phi) with Delta_m: (dw_m/dphi)^T Delta_m for each of phi's
    tensors and (dw_m/dV)^T Delta_m for the embedding table V (zero but for row m), by the server state's
    keys."""
    grads, grad_v = hyper_vjp(net, state, state[EMBEDDINGS][client], delta)
    table = torch.zeros_like(state[EMBEDDINGS])
    table[client] = grad_v
    return {EMBEDDINGS: table, **grads}


def clip_total_norm(grads: StateDict, max_norm: float) -> StateDict:
    """The gradients scaled by min(1, max_norm / (||g|| + 1e-6)), ||g|| their total L2 norm (as
    ``torch.nn.utils.clip_grad_norm_``)."""
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return {k: g * scale for k, g in grads.items()}


def sgd_momentum_step(param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, lr: float, momentum: float,
                      weight_decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of torch.optim.SGD (no dampening, no Nesterov) as new tensors: d = g + wd p;
    buf <- momentum buf + d (a zero buffer: torch's first step); p <- p - lr buf."""
    new_buf = buf * momentum + (grad + param * weight_decay)
    return param - lr * new_buf, new_buf


def server_step(net: HyperNetwork, state: StateDict, client: int, delta: StateDict, lr: float) -> StateDict:
    """The server state after client ``client``'s step: phi and the embeddings along the clipped
    vector-Jacobian products of its Delta_m, by SGD with momentum and weight decay."""
    grads = clip_total_norm(hyper_grads(net, state, client, delta), CLIP_NORM)
    out = dict(state)
    for k, g in grads.items():
        out[k], out[MOMENTUM_BUFFER + k] = sgd_momentum_step(state[k], g, state[MOMENTUM_BUFFER + k], lr, MOMENTUM,
                                                             WEIGHT_DECAY)
    return out


def init_state(params: PFedHNParams, num_clients: int, shapes: dict[str, torch.Size],
               seed: int) -> tuple[HyperNetwork, StateDict]:
    """The hypernetwork (PyTorch's default initialisation) and the embeddings (N(0, 1), as nn.Embedding's),
    drawn from the run's seed, and zero momentum buffers: (the module, the server state)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derived_seed(seed, INIT_TAG))
        net = HyperNetwork(embed_dim(params, num_clients), params.hidden, shapes)
        state = {EMBEDDINGS: torch.randn(num_clients, embed_dim(params, num_clients)),
                 **{NET + k: p.detach().clone() for k, p in net.named_parameters()}}
    return net, {**state, **{MOMENTUM_BUFFER + k: torch.zeros_like(t) for k, t in state.items()}}


@register
class PFedHN(Personalization):
    name = "pfedhn"
    Params = PFedHNParams
    global_reading = None
    pm_from_global = True
    server_reads_clients = True
    new_client_needs = "none"
    zero_shot_is_reading = False

    def __init__(self, params=None):
        super().__init__(params)
        self._net: HyperNetwork | None = None  # the hypernetwork's structure; its weights are the server state's

    @property
    def net(self) -> HyperNetwork:
        if self._net is None:
            raise RuntimeError("pfedhn: the server's hypernetwork is built by init_server_state")
        return self._net

    def init_server_state(self, ctx):
        shapes = {k: v.shape for k, v in ctx.initial.items()}
        self._net, state = init_state(self.params, ctx.num_clients, shapes, ctx.seed)
        return state

    @torch.no_grad()
    def model_of(self, server_state: StateDict, client_id: int) -> StateDict:
        """Client ``client_id``'s model H(v_m; phi): its PM, and what it trains from."""
        return generate(self.net, server_state, server_state[EMBEDDINGS][client_id])

    def messages(self, server_state, ids, uploads, round_idx, seed, ask):
        return {cid: self.model_of(server_state, cid) for cid in ids}

    def train(self, model, message, data, personal, local_model, rule_state, objectives, momentum, ctx):
        t0 = time.perf_counter()
        start(model, message.per_client[ctx.client_id], ctx)
        loss, steps = sgd_epochs(model, optimizer(model.parameters(), ctx), client_batches(data, ctx))
        return result(model, num_samples=len(data), loss=loss, steps=steps, t0=t0), None, {}

    def server_update(self, averaged, results, uploads, server_state, initial, num_clients, ask):
        """Each returned client's step in increasing id, its Delta_m taken from the model it was sent; the
        new global weights are the mean of every training client's PM."""
        deltas = {cid: client_delta(self.model_of(server_state, cid), results[cid].shared) for cid in sorted(results)}
        state = server_state
        for cid, delta in deltas.items():
            state = server_step(self.net, state, cid, delta, self.params.server_lr)
        gm = mean_state({k: w[k] for k in averaged} for w in (self.model_of(state, m) for m in range(num_clients)))
        return gm, state

    def pm_job(self, state, global_shared, rounds_done, server_state, client_id):
        return dataclasses.replace(state, personal=None, local_model=self.model_of(server_state, client_id),
                                   rounds_trained=rounds_done)

    # --- a client that never trained ---------------------------------------------------------------------

    def new_client_message(self, server_state, global_shared):
        """phi and the mean of the training clients' embeddings."""
        return {**{k: t for k, t in server_state.items() if k.startswith(NET)},
                MEAN_EMBEDDING: server_state[EMBEDDINGS].mean(0)}

    def client_net(self, received: StateDict, model) -> HyperNetwork:
        if self._net is None:
            self._net = hypernetwork_for(received, model)
        return self._net

    def new_client_model(self, model, message, data, ctx):
        """H at the mean of the training clients' embeddings."""
        received = message.per_client[ctx.client_id]
        with torch.no_grad():
            model.load_partial(generate(self.client_net(received, model), received, received[MEAN_EMBEDDING]))
        return model

    def adapt(self, model, message, data, personal, epochs, ctx):
        """H(v_new; phi) after E epochs of SGD on v_new alone, from the mean embedding."""
        received = message.per_client.get(ctx.client_id)
        if received is None:
            raise ValueError("pfedhn adapts only a client that never trained (its PM is H(v_m; phi))")
        net = self.client_net(received, model).to(ctx.device)
        phi = {k: t.to(ctx.device) for k, t in received.items() if k.startswith(NET)}
        v = fit_embedding(net, phi, model, received[MEAN_EMBEDDING].to(ctx.device),
                          client_batches(data, ctx, FIT_TAG, epochs=epochs), ctx)
        with torch.no_grad():
            model.load_partial(generate(net, phi, v))
        return model


def fit_embedding(net: HyperNetwork, phi: StateDict, model, v0: torch.Tensor, batches, ctx) -> torch.Tensor:
    """An embedding learned from ``v0`` by SGD (the round's learning rate, the config's momentum and weight
    decay) on the cross-entropy of the model H(v; phi) generates, phi fixed: the new client's own v."""
    v = v0.detach().clone().requires_grad_()
    opt = optimizer([v], ctx)
    loss_sum = torch.zeros(())
    for epoch, batch_list in enumerate(batches):
        for xb, yb in batch_list:
            loss = F.cross_entropy(functional_call(model, generate(net, phi, v), (xb,)), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum = loss_sum + loss.detach().cpu()
        check_finite(loss_sum, epoch)
    return v.detach()


def client_delta(sent: StateDict, trained: StateDict) -> StateDict:
    """Delta_m = w_m - w~_m: the model the client was sent less the one it returned."""
    return {k: w - trained[k] for k, w in sent.items()}
