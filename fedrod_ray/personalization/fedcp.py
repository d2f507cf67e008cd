"""FedCP (Zhang et al., KDD 2023): a shared Conditional Policy Network (CPN) splits each sample's feature z
into a personal part, for the client's head h^p, and a global part, for the global head h^g (the model's
generic head), which the client never trains (``models.readouts.FedCPReadout``).

The client loads theta_bar, h^g_bar and CPN_bar with its own h^p and context c (a client that never trained:
the initial head, c drawn U[0, 1) from the run's seed and its id), keeps a frozen copy theta^fr of theta_bar
and trains theta, h^p and the CPN for E epochs of SGD on

    CE(h^p(z * s) + h^g(z * s'), y) + lam MMD^2(z, theta^fr(x)),

MMD^2 the mean over the B x B entries of K_zz + K_z'z' - 2 K_zz' with the kernel sum_a exp(-||u - v||^2 / 2a),
a in {10, 15, 20, 50}. It uploads theta, the CPN and h^ = (h^p + h^g) / 2 as the generic head, then sets
c <- 1^T W^p. The server averages them. GM: h^g_bar(theta_bar(x)); PM: the masked forward with the latest
global theta, h^g and CPN and the client's h^p and c. The Gumbel noise is seeded (run, round, client, purpose),
also at evaluation. docs/method.md says where this departs from the official code.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.func import functional_call

from ..client_update.local import derived_seed
from ..models import GENERIC_HEAD, READOUT
from ..specs.methods import FedCPParams
from .base import Personalization, on_latest_global
from .finetune import FINETUNE_TAG
from .registry import register
from .sgd import client_batches, cpu_state, frozen, optimizer, result, sgd_epochs, start

BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)  # the official kernel's
NOISE_TAG = 21  # seeds the Gumbel noise of a client's training
EVAL_NOISE_TAG = 22  # seeds the Gumbel noise of its PM's evaluation
CONTEXT_TAG = 23  # seeds a client's first context c
HEAD, CONTEXT = f"{READOUT}head.weight", f"{READOUT}context"


def mmd2(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """MMD^2 of two batches (B x d) under the multi-bandwidth RBF kernel, as the official code computes it:
    the mean of K_xx + K_yy - 2 K_xy over the B x B entries."""
    xx, yy, xy = x @ x.T, y @ y.T, x @ y.T
    rx, ry = xx.diag().unsqueeze(0).expand_as(xx), yy.diag().unsqueeze(0).expand_as(yy)
    dxx, dyy, dxy = rx.T + rx - 2 * xx, ry.T + ry - 2 * yy, rx.T + ry - 2 * xy
    k = sum(torch.exp(-0.5 * dxx / a) + torch.exp(-0.5 * dyy / a) - 2 * torch.exp(-0.5 * dxy / a)
            for a in BANDWIDTHS)
    return k.mean()


def noise(ctx, tag: int, round_idx: int | None = None) -> torch.Generator:
    """The Gumbel noise's generator of client ``ctx.client_id`` in round ``round_idx`` (default its round)."""
    r = ctx.round_idx if round_idx is None else round_idx
    return torch.Generator().manual_seed(derived_seed(ctx.seed, r, ctx.client_id, tag))


def first_state(ctx) -> dict[str, torch.Tensor]:
    """A client's h^p and c before its first round: the initial head, c ~ U[0, 1) drawn for this client."""
    head = ctx.initial[f"{GENERIC_HEAD}weight"]
    gen = torch.Generator().manual_seed(derived_seed(ctx.seed, ctx.client_id, CONTEXT_TAG))
    return {HEAD: head, CONTEXT: torch.rand(head.shape[1], generator=gen)}


def fedcp_loss(model, xb: torch.Tensor, yb: torch.Tensor, theta_fr: dict, lam: float) -> torch.Tensor:
    """CE of the masked forward plus lam MMD^2 between z and the frozen received extractor's features."""
    z = model.features(xb)
    loss = F.cross_entropy(model.readout.personal_logits(model, z), yb)
    if lam == 0:
        return loss
    with torch.no_grad():
        z_fr = functional_call(model.body, theta_fr, (xb,))
    return loss + lam * mmd2(z, z_fr)


def context_of(personal_head: torch.Tensor) -> torch.Tensor:
    """c = 1^T W^p: the personal head's weight summed over the classes."""
    return personal_head.detach().sum(0)


def upload_head(personal_head: torch.Tensor, global_head: torch.Tensor) -> torch.Tensor:
    """h^ = (h^p + h^g) / 2, what a client sends for the global head."""
    return 0.5 * (personal_head + global_head)


@register
class FedCP(Personalization):
    name = "fedcp"
    Params = FedCPParams
    readout = "fedcp"
    global_reading = None  # the PM reads masked features, which no head on the GM's features gives
    pm_from_global = True

    def personal_keys(self, model):
        return model.readout_personal_keys()

    def train(self, model, message, data, personal, local_model, rule_state, objectives, momentum, ctx):
        t0 = time.perf_counter()
        loss, steps = self.fit(model, {**message.weights, **(personal or first_state(ctx))}, data, ctx,
                               ctx.cfg.local_epochs)
        r, key = model.readout, f"{GENERIC_HEAD}weight"
        shared = cpu_state(model, model.shared_keys())
        shared[key] = upload_head(r.head.weight.detach().cpu(), shared[key])
        return (result(model, num_samples=len(data), loss=loss, steps=steps, t0=t0, shared=shared),
                cpu_state(model, model.personal_keys()), {})

    def fit(self, model, weights, data, ctx, epochs: int, tag: int = 0) -> tuple[float, int]:
        """``epochs`` epochs of SGD on theta, h^p and the CPN from ``weights`` (h^g frozen), batches drawn with
        ``tag``; then c <- 1^T W^p. Leaves the PM's noise unseeded."""
        start(model, weights, ctx)
        r = model.readout
        theta_fr = {k: v.detach().clone() for k, v in model.body.state_dict().items()}
        r.noise = noise(ctx, NOISE_TAG if tag == 0 else derived_seed(NOISE_TAG, tag))
        params = [*model.body.parameters(), *r.head.parameters(), *r.cpn.parameters()]
        try:
            with frozen(model.generic_head.parameters()):
                loss, steps = sgd_epochs(model, optimizer(params, ctx), client_batches(data, ctx, tag, epochs),
                                         loss_fn=lambda m, xb, yb: fedcp_loss(m, xb, yb, theta_fr, self.params.lam))
        finally:
            r.noise = None
        with torch.no_grad():
            r.context.copy_(context_of(r.head.weight))
        return loss, steps

    def pm_job(self, state, global_shared, rounds_done, server_state, client_id):
        """The latest global theta, h^g and CPN with the client's h^p and c (a client that never trained: none,
        its PM is the GM)."""
        return on_latest_global(state, global_shared, rounds_done)

    def load_pm(self, model, state, data, ctx):
        super().load_pm(model, state, data, ctx)
        model.readout.noise = noise(ctx, EVAL_NOISE_TAG)

    def adapt(self, model, message, data, personal, epochs, ctx):
        """``epochs`` epochs of the client's update from the global weights and its h^p and c (a new client: the
        initial head, c from that head), its noise seeded for scoring."""
        if personal is None:
            head = ctx.initial[f"{GENERIC_HEAD}weight"]
            personal = {HEAD: head, CONTEXT: context_of(head)}
        self.fit(model, {**message.weights, **personal}, data, ctx, epochs, FINETUNE_TAG)
        model.readout.noise = noise(ctx, EVAL_NOISE_TAG)
        return model
