"""PeFLL (Scott, Zakerinia & Lampert, ICLR 2024): an embedding network describes a client's data, and a
hypernetwork makes the client's model from that description.

The server holds both: the embedding network E(x, y; psi) and the hypernetwork H(v; phi) (pFedHN's, from a
descriptor instead of a learned embedding). A round, with the two-way exchange of the paper's algorithm:

1. each sampled client, sent psi, answers with its descriptor v_m = the mean of E over one mini-batch of its
   own examples (a seeded draw of the round, as the official code's training draws one batch); the server
   sends it w_m = H(v_m; phi). ``descriptor_scaling`` rescales v_m before H: ``standardize`` by its own
   mean and standard deviation over its coordinates, on the client (FL-bench's PeFLL); ``official`` by the
   mean and standard deviation of the first descriptor of the run, fixed from then on, on the server (the
   official code's);
2. the client runs E epochs of SGD from w_m and returns w~_m;
3. the server takes c_m = Delta_m + lam_theta w_m (Delta_m = w_m - w~_m) and back-propagates it through H:
   g_phi += (dw_m/dphi)^T c_m, and each client is sent (dw_m/dv_m)^T c_m, from which it answers with
   (dv_m/dpsi)^T (dw_m/dv_m)^T c_m on the same batch;
4. the server averages both over the round's clients, adds lam_h phi and lam_v psi (the regularisers),
   clips their joint norm to 50 and takes one Adam step on (phi, psi) at ``server_lr`` (the official
   code's optimiser and clipping).

Then every training client is asked for its descriptor under the new psi: the PM of client m is
H(v_m; phi), and the global weights the server keeps are the GM, the mean of the PMs (no global model). A
client that never trained needs none: one pass of E over its whole training set (as the official code's
evaluation describes a client) and one of H give its model (it receives both networks, and the fixed
rescaling, and makes it itself: the same model as the exchange, v_m up and H(v_m) down); its adaptation
fine-tunes that model.
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
from ..config.values import ConfigError
from ..server_math.aggregate import StateDict
from ..specs.methods import PeFLLParams
from .base import Personalization, mean_state
from .finetune import fine_tune
from .pfedhn import (
    CLIP_NORM,
    NET,
    HyperNetwork,
    clip_total_norm,
    embed_dim,
    generate,
    hyper_vjp,
    hypernetwork_for,
)
from .registry import register
from .sgd import client_batches, optimizer, result, sgd_epochs, start

INIT_TAG = 16  # seeds the two networks' initial weights
DESCRIBE_TAG = 17  # the client's draw of the mini-batch its descriptor is the mean over
BETAS = (0.9, 0.999)  # Adam's (PyTorch's defaults, the official code's)
EPS = 1e-8

ENET = "enet/"  # server state: the embedding network's parameters by name
ADAM_AVG = "adam_avg/"  # Adam's first and second moments of each of phi's and psi's tensors, by its key
ADAM_SQ = "adam_sq/"
ADAM_STEP = "adam_step"  # the number of Adam steps taken (float64 scalar)
DESCRIPTORS = "descriptors"  # (M, embed_dim): each training client's last descriptor, its PM's input
# descriptor_scaling: official: (mean, std) of the run's first descriptor, NaN until it is taken (server state,
# and the round's messages and uploads, which carry it from the round that takes it to the server's update)
SCALE = "descriptor_scale"

DESCRIBE, BACKWARD = "describe", "backward"  # the questions the server asks its clients
DESCRIPTOR, GRAD, MODEL = "descriptor", "grad", "model/"


class EmbeddingNetwork(nn.Module):
    """E(x, y; psi): the official code's CNN embedding, the labels one-hot as extra image channels; an
    adaptive 4 x 4 pool before the first fully connected layer fits it to any image size (on 28 x 28 images
    the maps are 4 x 4 already and the pool does nothing: the official layers, fc1 taking 512 inputs where
    the official one, sized for 32 x 32 images, takes 800)."""

    def __init__(self, in_channels: int, num_classes: int, embed_dim: int, kernels: int = 16):
        super().__init__()
        self.num_classes = num_classes
        self.conv1 = nn.Conv2d(in_channels + num_classes, kernels, 5)
        self.conv2 = nn.Conv2d(kernels, 2 * kernels, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.fit = nn.AdaptiveAvgPool2d(4)
        self.fc1 = nn.Linear(2 * kernels * 16, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, embed_dim)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        labels = F.one_hot(y, self.num_classes).to(x.dtype)[:, :, None, None].expand(-1, -1, *x.shape[2:])
        h = self.pool(F.relu(self.conv1(torch.cat([x, labels], 1))))
        h = self.fit(self.pool(F.relu(self.conv2(h)))).flatten(1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(h)))))


def descriptor(enet: EmbeddingNetwork, psi: StateDict, x: torch.Tensor, y: torch.Tensor,
               standardize: bool = False) -> torch.Tensor:
    """v = the mean of E(x_i, y_i; psi) over the batch; ``standardize``: (v - mean v) / std v over its
    coordinates (a part of the map the backward pass differentiates)."""
    v = functional_call(enet, {k[len(ENET):]: t for k, t in psi.items()}, (x, y)).mean(0)
    return (v - v.mean()) / v.std() if standardize else v


def rescaled(v: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The official code's fixed rescaling, (v - m) / s with scale = (m, s); None: v (no fixed rescaling)."""
    return v if scale is None else (v - scale[0]) / scale[1]


def first_scale(v: torch.Tensor) -> torch.Tensor:
    """(m, s): the mean and standard deviation of ``v``'s coordinates, which rescale every later descriptor."""
    return torch.stack([v.mean(), v.std()])


def adam_step(param: torch.Tensor, grad: torch.Tensor, avg: torch.Tensor, sq: torch.Tensor, step: int,
              lr: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of torch.optim.Adam (no weight decay, no amsgrad) as new tensors, its ``step``-th (from 1):
    (param, first moment, second moment)."""
    avg = torch.lerp(avg, grad, 1 - BETAS[0])
    sq = torch.addcmul(sq * BETAS[1], grad, grad, value=1 - BETAS[1])
    denom = sq.sqrt() / math.sqrt(1 - BETAS[1] ** step) + EPS
    return torch.addcdiv(param, avg, denom, value=-lr / (1 - BETAS[0] ** step)), avg, sq


def init_state(params: PeFLLParams, num_clients: int, shapes: dict[str, torch.Size], in_channels: int,
               num_classes: int, seed: int) -> tuple[HyperNetwork, StateDict]:
    """The hypernetwork and the embedding network (PyTorch's default initialisation, from the run's seed),
    Adam's zero moments and step, and zero descriptors: (the hypernetwork's module, the server state)."""
    d = embed_dim(params, num_clients)
    if params.descriptor_scaling != "none" and d < 2:
        raise ConfigError(f"train.head_params.descriptor_scaling: a descriptor of {d} coordinate has no standard "
                          "deviation to rescale by; set train.head_params.embed_dim to 2 or more, or "
                          "descriptor_scaling to none")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derived_seed(seed, INIT_TAG))
        net = HyperNetwork(d, params.hidden, shapes)
        enet = EmbeddingNetwork(in_channels, num_classes, d)
    trained = {**{NET + k: p.detach().clone() for k, p in net.named_parameters()},
               **{ENET + k: p.detach().clone() for k, p in enet.named_parameters()}}
    return net, {**trained, **{ADAM_AVG + k: torch.zeros_like(t) for k, t in trained.items()},
                 **{ADAM_SQ + k: torch.zeros_like(t) for k, t in trained.items()},
                 ADAM_STEP: torch.zeros((), dtype=torch.float64), DESCRIPTORS: torch.zeros(num_clients, d),
                 **({SCALE: torch.full((2,), math.nan)} if params.descriptor_scaling == "official" else {})}


def psi(state: StateDict) -> StateDict:
    """The embedding network's parameters: what a client describes itself with."""
    return {k: t for k, t in state.items() if k.startswith(ENET)}


def server_step(state: StateDict, grads: StateDict, params: PeFLLParams) -> StateDict:
    """One Adam step on phi and psi along ``grads`` (the round's mean) plus the regularisers' lam_h phi and
    lam_v psi, their joint norm clipped to 50."""
    reg = {k: params.reg_hyper if k.startswith(NET) else params.reg_embed for k in grads}
    grads = clip_total_norm({k: g + reg[k] * state[k] for k, g in grads.items()}, CLIP_NORM)
    step = state[ADAM_STEP] + 1
    out = {**state, ADAM_STEP: step}
    for k, g in grads.items():
        out[k], out[ADAM_AVG + k], out[ADAM_SQ + k] = adam_step(state[k], g, state[ADAM_AVG + k],
                                                                 state[ADAM_SQ + k], int(step), params.server_lr)
    return out


@register
class PeFLL(Personalization):
    name = "pefll"
    Params = PeFLLParams
    global_reading = None
    pm_from_global = True
    server_reads_clients = True
    new_client_needs = "data"
    zero_shot_is_reading = False

    def __init__(self, params=None):
        super().__init__(params)
        self._net: HyperNetwork | None = None  # the server's hypernetwork's structure
        self._enet: EmbeddingNetwork | None = None  # a client's embedding network's structure

    @property
    def net(self) -> HyperNetwork:
        if self._net is None:
            raise RuntimeError("pefll: the server's hypernetwork is built by init_server_state")
        return self._net

    def init_server_state(self, ctx):
        shapes = {k: v.shape for k, v in ctx.initial.items()}
        self._net, state = init_state(self.params, ctx.num_clients, shapes, ctx.image_shape[0], ctx.num_classes,
                                      ctx.seed)
        return state

    # --- the client ------------------------------------------------------------------------------------------

    def embedding_network(self, psi_: StateDict, data) -> EmbeddingNetwork:
        if self._enet is None:
            d = psi_[ENET + "fc3.weight"].shape[0]
            self._enet = EmbeddingNetwork(data.x.shape[1], len(data.counts), d)
        return self._enet

    @property
    def standardize(self) -> bool:
        return self.params.descriptor_scaling == "standardize"

    def describe(self, psi_: StateDict, data, ctx, whole: bool = False) -> torch.Tensor:
        """The client's descriptor under ``psi_``: the mean of E over its seeded batch of the round (training,
        as the official code's); ``whole``: over its whole training set (evaluation, as the official code's)."""
        enet = self.embedding_network(psi_, data).to(ctx.device)
        batches = next(client_batches(data, ctx, DESCRIBE_TAG, epochs=1))
        xb, yb = (torch.cat(part) for part in zip(*batches)) if whole else batches[0]
        with torch.no_grad():
            return descriptor(enet, {k: t.to(ctx.device) for k, t in psi_.items()}, xb, yb, self.standardize)

    def answer(self, phase, model, common, question, data, ctx):
        """``describe``: the client's descriptor under psi (``common``); ``backward``: psi's gradient through
        that same descriptor from the gradient the server sent for it."""
        if phase == DESCRIBE:
            return {DESCRIPTOR: self.describe(common, data, ctx).cpu()}
        if phase != BACKWARD:
            return super().answer(phase, model, common, question, data, ctx)
        enet = self.embedding_network(common, data).to(ctx.device)
        xb, yb = next(client_batches(data, ctx, DESCRIBE_TAG, epochs=1))[0]
        psi_ = {k: t.to(ctx.device).detach().requires_grad_() for k, t in common.items()}
        grads = torch.autograd.grad(descriptor(enet, psi_, xb, yb, self.standardize), list(psi_.values()),
                                    grad_outputs=question[GRAD].to(ctx.device))
        return {k: g.cpu() for k, g in zip(psi_, grads)}

    def train(self, model, message, data, personal, local_model, rule_state, objectives, momentum, ctx):
        t0 = time.perf_counter()
        sent = message.per_client.get(ctx.client_id)
        if sent is None:
            raise RuntimeError(f"client {ctx.client_id} was sent no model: its descriptor did not reach the server")
        start(model, {k[len(MODEL):]: v for k, v in sent.items() if k.startswith(MODEL)}, ctx)
        loss, steps = sgd_epochs(model, optimizer(model.parameters(), ctx), client_batches(data, ctx))
        return (result(model, num_samples=len(data), loss=loss, steps=steps, t0=t0,
                       upload={k: sent[k] for k in (DESCRIPTOR, SCALE) if k in sent}), None, {})

    # --- the server ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def model_from(self, server_state: StateDict, v: torch.Tensor) -> StateDict:
        """H(v; phi)."""
        return generate(self.net, server_state, v)

    def messages(self, server_state, ids, uploads, round_idx, seed, ask):
        """Each described client's H(v_m), v_m rescaled (official: by the run's first descriptor, taken here
        from the round's lowest described id in the round that has none yet, and sent along to come back)."""
        described = ask(DESCRIBE, psi(server_state), {cid: {} for cid in ids})
        scale = server_state.get(SCALE)
        if scale is not None and scale.isnan().any() and described:
            scale = first_scale(described[min(described)][DESCRIPTOR])
        extra = {} if scale is None else {SCALE: scale}
        return {cid: {**{MODEL + k: w for k, w in self.model_from(server_state, rescaled(a[DESCRIPTOR], scale)).items()},
                      DESCRIPTOR: a[DESCRIPTOR], **extra} for cid, a in sorted(described.items())}

    def server_update(self, averaged, results, uploads, server_state, initial, num_clients, ask):
        """The round's backward pass (through H here, through E on each client), one Adam step on the mean of
        its gradients (phi's over the round's results, psi's over the clients that answered), then every
        training client's new descriptor: the PMs, whose mean is the new global weights."""
        if not results:  # every client of the round failed: nothing to step on
            return self.refresh(server_state, num_clients, ask)
        if SCALE in server_state and server_state[SCALE].isnan().any():  # the round that took the scale
            server_state = {**server_state, SCALE: results[min(results)].method_upload[SCALE]}
        scale = server_state.get(SCALE)
        lam = self.params.reg_model
        grads: StateDict = {}
        grad_v: dict[int, StateDict] = {}
        for cid in sorted(results):
            v = rescaled(results[cid].method_upload[DESCRIPTOR], scale)
            w = self.model_from(server_state, v)
            cotangent = {k: w[k] - results[cid].shared[k] + lam * w[k] for k in w}
            phi_grads, grad = hyper_vjp(self.net, server_state, v, cotangent)
            grads = {k: grads[k] + g if k in grads else g for k, g in phi_grads.items()}
            # through the fixed rescaling to the client's descriptor: d((v - m) / s)/dv = 1 / s
            grad_v[cid] = {GRAD: grad if scale is None else grad / scale[1]}
        grads = {k: g / len(results) for k, g in grads.items()}
        psi_ = psi(server_state)
        answers = ask(BACKWARD, psi_, grad_v)
        for k in psi_:  # the mean over the clients that answered; none: psi's gradient is its regulariser's
            grads[k] = sum((answers[c][k] for c in sorted(answers)), torch.zeros_like(psi_[k])) / max(len(answers), 1)
        state = server_step(server_state, grads, self.params)
        return self.refresh(state, num_clients, ask)

    def refresh(self, state: StateDict, num_clients: int, ask) -> tuple[StateDict, StateDict]:
        """Every training client's descriptor under the current psi (one that does not answer keeps its last),
        and the mean of their PMs: (the global weights, the server state)."""
        described = ask(DESCRIBE, psi(state), {m: {} for m in range(num_clients)})
        if SCALE in state and state[SCALE].isnan().any() and described:  # no round has trained yet
            state = {**state, SCALE: first_scale(described[min(described)][DESCRIPTOR])}
        table = state[DESCRIPTORS].clone()
        for m, a in described.items():
            table[m] = rescaled(a[DESCRIPTOR], state.get(SCALE))
        state = {**state, DESCRIPTORS: table}
        return mean_state(self.model_from(state, table[m]) for m in range(num_clients)), state

    def pm_job(self, state, global_shared, rounds_done, server_state, client_id):
        return dataclasses.replace(state, personal=None, rounds_trained=rounds_done,
                                   local_model=self.model_from(server_state, server_state[DESCRIPTORS][client_id]))

    # --- a client that never trained ---------------------------------------------------------------------

    def new_client_message(self, server_state, global_shared):
        """Both networks, phi and psi, and the fixed rescaling (official)."""
        return {k: t for k, t in server_state.items()
                if k.startswith((NET, ENET)) or (k == SCALE and not t.isnan().any())}

    @torch.no_grad()
    def zero_shot(self, model, received: StateDict, data, ctx) -> StateDict:
        """H(v; phi), v the client's descriptor: one pass of E over its whole training set, one of H."""
        if self._net is None:
            self._net = hypernetwork_for(received, model)
        phi = {k: t.to(ctx.device) for k, t in received.items() if k.startswith(NET)}
        v = rescaled(self.describe(psi(received), data, ctx, whole=True),
                     received[SCALE].to(ctx.device) if SCALE in received else None)
        return generate(self._net.to(ctx.device), phi, v)

    def new_client_model(self, model, message, data, ctx):
        model.load_partial(self.zero_shot(model, message.per_client[ctx.client_id], data, ctx))
        return model

    def adapt(self, model, message, data, personal, epochs, ctx):
        """The zero-shot model fine-tuned (``finetune.fine_tune``) on the client's own data."""
        received = message.per_client.get(ctx.client_id)
        if received is None:
            raise ValueError("pefll adapts only a client that never trained (its PM is H(v_m; phi))")
        fine_tune(model, self.zero_shot(model, received, data, ctx), data, None, epochs, ctx)
        return model
