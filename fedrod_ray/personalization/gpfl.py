"""GPFL (Zhang et al., ICCV 2023): a Conditional Valve (CoV) makes a global and a personal route from one
feature z, the global one guided by shared Global Category Embeddings E (``models.readouts.GPFLReadout``).

The client loads theta_bar, E_bar and CoV_bar (and keeps a frozen copy E_fr of E_bar) with its own head h and
conditions g, p (zeros before its first round). Per batch, f_P = CoV(z, p), f_G = CoV(z, g) and

    loss = CE(h(f_P), y) + CE([cos(f_G, E_c)]_c, y) + lam ||f_G - E_fr[y]||_F

(one Frobenius norm over the batch), by SGD on theta and h, and SGD with weight decay mu on E and the CoV.
After training, g <- mean_c E_c and p <- sum_c alpha_c E_c from its trained E (alpha: its exact label
frequencies). The server averages theta, E and the CoV. GM: argmax_c cos(CoV(z, mean_c E_c), E_c); PM: h(CoV(z,
p)) with the latest global theta, E and CoV (made at evaluation). docs/method.md says where this departs from
the official code.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ..client_update.local import round_lr
from ..models import READOUT
from ..models.readouts import cosine_logits
from ..specs.methods import GPFLParams
from .base import Personalization, on_latest_global
from .finetune import FINETUNE_TAG
from .registry import register
from .sgd import client_batches, cpu_state, result, sgd_epochs, start


def conditions(embeddings: torch.Tensor, alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, p) = (mean_c E_c, sum_c alpha_c E_c), detached: the client's global and personal conditions."""
    e = embeddings.detach()
    return e.mean(0), alpha.to(e) @ e


def gpfl_loss(model, xb: torch.Tensor, yb: torch.Tensor, frozen_e: torch.Tensor, lam: float) -> torch.Tensor:
    """The client's loss on one batch: CE of the personal route, the cosine loss of the global one, and lam
    times the Frobenius norm of the global features' distance to their classes' frozen embeddings."""
    r = model.readout
    z = model.features(xb)
    f_p, f_g = r.cov(z, r.p), r.cov(z, r.g)
    return (F.cross_entropy(r.head(f_p), yb) + F.cross_entropy(cosine_logits(f_g, r.embedding.weight), yb)
            + lam * torch.linalg.norm(f_g - frozen_e[yb]))


@register
class GPFL(Personalization):
    name = "gpfl"
    Params = GPFLParams
    readout = "gpfl"
    global_reading = None  # the PM reads the personal route, which no head on the GM's features gives
    pm_from_global = True

    def personal_keys(self, model):
        return model.readout_personal_keys()

    def train(self, model, message, data, personal, local_model, rule_state, objectives, momentum, ctx):
        t0 = time.perf_counter()
        own = personal if personal is not None else {k: ctx.initial[k] for k in model.personal_keys()}
        loss, steps = self.fit(model, {**message.weights, **own}, data, ctx, ctx.cfg.local_epochs)
        return (result(model, num_samples=len(data), loss=loss, steps=steps, t0=t0),
                cpu_state(model, model.personal_keys()), {})

    def fit(self, model, weights, data, ctx, epochs: int, tag: int = 0) -> tuple[float, int]:
        """``epochs`` epochs of the client's loss from ``weights`` (batches drawn with ``tag``,
        ``sgd.client_batches``), then g and p from the trained E."""
        start(model, weights, ctx)
        r = model.readout
        frozen_e = r.embedding.weight.detach().clone()
        lr, t = round_lr(ctx.cfg, ctx.round_idx), ctx.cfg
        own = [*model.body.parameters(), *r.head.parameters()]
        shared = [*r.embedding.parameters(), *r.cov.parameters()]
        opt = torch.optim.SGD([{"params": own, "weight_decay": t.weight_decay},
                               {"params": shared, "weight_decay": self.params.mu}], lr=lr, momentum=t.momentum)
        batches = client_batches(data, ctx, tag, epochs)
        loss, steps = sgd_epochs(model, opt, batches,
                                 loss_fn=lambda m, xb, yb: gpfl_loss(m, xb, yb, frozen_e, self.params.lam))
        with torch.no_grad():
            g, p = conditions(r.embedding.weight, data.class_dist)
            r.g.copy_(g)
            r.p.copy_(p)
        return loss, steps

    def pm_job(self, state, global_shared, rounds_done, server_state, client_id):
        """The latest global theta, E and CoV with the client's h, g and p (a client that never trained: none,
        its PM is the GM)."""
        return on_latest_global(state, global_shared, rounds_done)

    def adapt(self, model, message, data, personal, epochs, ctx):
        """``epochs`` epochs of the client's loss from the global weights and its own h, g, p (a new client: the
        initial head, and g and p from the global E and its label frequencies)."""
        if personal is None:
            e = message.weights[f"{READOUT}embedding.weight"]
            g, p = conditions(e, data.class_dist)
            personal = {f"{READOUT}head.weight": ctx.initial[f"{READOUT}head.weight"], f"{READOUT}g": g,
                        f"{READOUT}p": p}
        self.fit(model, {**message.weights, **personal}, data, ctx, epochs, FINETUNE_TAG)
        return model
