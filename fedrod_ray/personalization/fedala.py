"""FedALA (Zhang et al., AAAI 2023): adaptive local aggregation of the global model into the local one.

All of the model is shared and averaged (FedAvg's server). A client keeps theta^loc (its last upload), the
element-wise weights W_i of the top ``layer_idx`` parameter tensors (ones at first) and a flag ``start``.
Sent the global Theta, a client that trained before does not overwrite its model: the lower tensors take
Theta, the top ones theta^ = theta^loc + (Theta - theta^loc) * W_i, and W_i is learned on a contiguous random
slice of ``rand_percent`` % of its data: per batch W_i <- clip_[0, 1](W_i - eta grad_theta^ CE * (Theta -
theta^loc)). While ``start``, passes repeat until more than K last-batch losses are recorded and the last K's
standard deviation is below ``threshold``; then one pass per round. It trains all of theta^ for E epochs of
SGD on cross-entropy and uploads the result. A client that never trained starts from Theta. GM = Theta;
PM = the ALA output with the current Theta (made at evaluation on a copy, nothing kept).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..client_update.local import derived_seed
from ..config.values import ConfigError
from ..data.transforms import normalize
from ..server_math.aggregate import StateDict
from ..specs.methods import FedALAParams
from .base import Personalization
from .registry import register
from .sgd import check_finite, client_batches, optimizer, result, sgd_epochs, start

ALA_TAG = 18  # seeds the slice of a round's weight learning
PM_TAG = 19  # seeds the slice of the PM's weight learning at evaluation, apart from training's
WEIGHTS = "ala_w/"  # personal state: W_i of each top tensor, by its key
START = "ala_start"  # personal state: 1.0 while the start phase has not run, else 0.0
GLOBAL = "global/"  # the PM's job: the current global weights beside the client's theta^loc

Loss = Callable[[StateDict, torch.Tensor, torch.Tensor], torch.Tensor]


def top_keys(model, layer_idx: int) -> list[str]:
    """The last ``layer_idx`` parameter tensors' names, in the model's order (0: all of them)."""
    names = [k for k, _ in model.named_parameters()]
    if layer_idx > len(names):
        raise ConfigError(f"train.head_params.layer_idx: the model has {len(names)} parameter tensors, not "
                          f"{layer_idx}")
    return names[-layer_idx:] if layer_idx else names


def blend(local: StateDict, global_: StateDict, weights: StateDict) -> StateDict:
    """theta^ = theta^loc + (Theta - theta^loc) * W, key by key of ``weights``."""
    return {k: local[k] + (global_[k] - local[k]) * w for k, w in weights.items()}


def ala_step(grads: StateDict, local: StateDict, global_: StateDict, weights: StateDict,
             eta: float) -> tuple[StateDict, StateDict]:
    """One batch of weight learning from the gradients at theta^: (new W, new theta^), W <- clip_[0, 1](W -
    eta G * (Theta - theta^loc))."""
    new = {k: torch.clamp(w - eta * (grads[k] * (global_[k] - local[k])), 0, 1) for k, w in weights.items()}
    return new, blend(local, global_, new)


def learn_weights(loss: Loss, batches: list[tuple[torch.Tensor, torch.Tensor]], local: StateDict,
                  global_: StateDict, weights: StateDict, started: bool,
                  params: FedALAParams) -> tuple[StateDict, StateDict, bool]:
    """ALA's weight learning on ``batches`` (the slice, in order): passes until the start phase's stopping
    test (one pass once ``started``); returns (W, theta^, started). ``loss(theta^, x, y)`` is the model's loss
    with its top tensors at theta^. No batch: W and ``started`` stay as they are."""
    top = blend(local, global_, weights)
    if not batches:
        return weights, top, started
    losses: list[float] = []
    while True:
        for xb, yb in batches:
            leaves = {k: t.detach().requires_grad_() for k, t in top.items()}
            value = loss(leaves, xb, yb)
            grads = dict(zip(leaves, torch.autograd.grad(value, list(leaves.values()))))
            weights, top = ala_step(grads, local, global_, weights, params.eta)
        losses.append(value.item())
        check_finite(torch.tensor(losses[-1]), len(losses) - 1)
        if started:
            break
        k = params.num_pre_loss
        if len(losses) > k and statistics.pstdev(losses[-k:]) < params.threshold:
            break
    return weights, {k: t.detach() for k, t in top.items()}, True


def ala_slice(data, ctx, percent: float, tag: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """floor(percent / 100 n) of the client's examples from a uniform random offset (0 to n - that, both
    included), in order, in batches of ``train.batch_size``, the last partial one kept; normalised, not
    augmented."""
    n = len(data)
    size = int(percent / 100 * n)
    gen = torch.Generator().manual_seed(derived_seed(ctx.seed, ctx.round_idx, ctx.client_id, tag))
    offset = int(torch.randint(0, n - size + 1, (), generator=gen))
    x = normalize(data.x[offset:offset + size], ctx.mean, ctx.std).to(ctx.device)
    y = data.y[offset:offset + size].to(ctx.device)
    b = ctx.cfg.batch_size
    return [(x[i:i + b].contiguous(memory_format=torch.channels_last), y[i:i + b]) for i in range(0, size, b)]


@register
class FedALA(Personalization):
    name = "fedala"
    Params = FedALAParams
    global_reading = None
    pm_from_global = True
    starts_from_local_model = True

    def init_server_state(self, ctx):
        """None: the server is FedAvg's. ``layer_idx`` is checked against the model before round 1."""
        if self.params.layer_idx > len(ctx.initial):
            raise ConfigError(f"train.head_params.layer_idx: the model has {len(ctx.initial)} tensors, not "
                              f"{self.params.layer_idx}")
        return {}

    def aggregate_locally(self, model, global_: StateDict, local: StateDict, personal: StateDict | None, data,
                          ctx, tag: int) -> tuple[StateDict, StateDict]:
        """Step (2): load the lower tensors from Theta and the top ones from theta^ after weight learning;
        returns (the personal state after it, theta^)."""
        keys = top_keys(model, self.params.layer_idx)
        weights = {k: personal[WEIGHTS + k] for k in keys} if personal else {k: torch.ones_like(local[k]) for k in keys}
        started = bool(personal) and not bool(personal[START])
        start(model, global_, ctx)
        local_top = {k: local[k].to(ctx.device) for k in keys}
        global_top = {k: global_[k].to(ctx.device) for k in keys}
        weights = {k: w.to(ctx.device) for k, w in weights.items()}

        def loss(top: StateDict, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(torch.func.functional_call(model, top, (xb,), strict=False), yb)

        weights, top, started = learn_weights(loss, ala_slice(data, ctx, self.params.rand_percent, tag), local_top,
                                              global_top, weights, started, self.params)
        model.load_partial(top)
        return {**{WEIGHTS + k: w.cpu() for k, w in weights.items()}, START: torch.tensor(float(not started))}, top

    def train(self, model, message, data, personal, local_model, rule_state, objectives, momentum, ctx):
        t0 = time.perf_counter()
        if local_model is None:  # never trained: it starts from Theta, and W_i from ones
            start(model, message.weights, ctx)
            keys = top_keys(model, self.params.layer_idx)
            personal = {**{WEIGHTS + k: torch.ones_like(message.weights[k]) for k in keys}, START: torch.tensor(1.0)}
        else:
            personal, _ = self.aggregate_locally(model, message.weights, local_model, personal, data, ctx, ALA_TAG)
        loss, steps = sgd_epochs(model, optimizer(model.parameters(), ctx), client_batches(data, ctx))
        return result(model, num_samples=len(data), loss=loss, steps=steps, t0=t0), personal, {}

    def pm_job(self, state, global_shared, rounds_done, server_state, client_id):
        """Theta beside the client's own state: its PM is made from both where its data is (a client that
        never trained: none, its PM is the GM)."""
        if state.personal is None:
            return state
        return dataclasses.replace(state, rounds_trained=rounds_done,
                                   personal={**state.personal, **{GLOBAL + k: v for k, v in global_shared.items()}})

    def load_pm(self, model, state, data, ctx):
        """Step (2) with the current Theta, on the host's model: the client's kept state is not touched."""
        personal = {k: v for k, v in state.personal.items() if not k.startswith(GLOBAL)}
        global_ = {k[len(GLOBAL):]: v for k, v in state.personal.items() if k.startswith(GLOBAL)}
        self.aggregate_locally(model, global_, state.local_model, personal, data(), ctx, PM_TAG)
