"""pFedMe (Dinh et al., 2020): personalized models by Moreau envelopes.

The client sets w_m <- w_bar; for each mini-batch b of E epochs it finds theta~ ~ argmin_theta l_CE(theta; b) +
(lam / 2) ||theta - w_m||^2 by K steps of SGD at the personal learning rate eta_p (from theta~'s last value;
the first time from w_m), then w_m <- w_m - eta lam (w_m - theta~), eta the round's learning rate. It
returns w_m and keeps theta~. The server's w_bar <- (1 - beta) w_bar + beta mean(w_m) with beta = 1: the
sample-weighted mean, as the official code weighs clients. GM = w_bar; PM = the client's last theta~.
"""

from __future__ import annotations

import time

import torch

from ..client_update.local import round_lr
from ..server_math.aggregate import StateDict
from ..specs.methods import PFedMeParams
from .base import Personalization
from .registry import register
from .sgd import ce_loss, check_finite, client_batches, cpu_state, result, start


# size: pFedMe's inner problem, each hyperparameter named as in the paper
def pfedme_batch(model, params: dict[str, torch.Tensor], w: StateDict, xb: torch.Tensor, yb: torch.Tensor, *,
                 lam: float, personal_lr: float, inner_steps: int, lr: float) -> torch.Tensor:
    """One mini-batch: ``inner_steps`` SGD steps of theta~ (the model's ``params``, in place) on
    l_CE(theta~; b) + (lam / 2) ||theta~ - w||^2, then w <- w - lr lam (w - theta~) (in place). Returns the
    last inner step's loss."""
    for _ in range(inner_steps):
        loss = ce_loss(model, xb, yb)
        grads = torch.autograd.grad(loss, list(params.values()))
        with torch.no_grad():
            for (k, p), g in zip(params.items(), grads):
                p.sub_(personal_lr * (g + lam * (p - w[k])))
    with torch.no_grad():
        for k, p in params.items():
            w[k].sub_(lr * lam * (w[k] - p))
    return loss.detach()


@register
class PFedMe(Personalization):
    name = "pfedme"
    Params = PFedMeParams
    global_reading = None

    def train(self, model, message, data, personal, local_model, rule_state, objectives, momentum, ctx):
        t0 = time.perf_counter()
        p = self.params
        start(model, message.weights, ctx)
        params = dict(model.named_parameters())
        w = {k: v.detach().clone() for k, v in params.items()}
        lr = round_lr(ctx.cfg, ctx.round_idx)
        loss_sum, steps = torch.zeros(()), 0
        for epoch, batches in enumerate(client_batches(data, ctx)):
            for xb, yb in batches:
                loss_sum += pfedme_batch(model, params, w, xb, yb, lam=p.lam, personal_lr=p.personal_lr,
                                         inner_steps=p.inner_steps, lr=lr).cpu()
                steps += 1
            check_finite(loss_sum, epoch)
        theta = cpu_state(model)
        shared = {k: w[k].to("cpu", copy=True) if k in w else v for k, v in theta.items()}
        out = result(model, num_samples=len(data), loss=(loss_sum / steps).item(), steps=steps, t0=t0,
                     shared={k: shared[k] for k in model.shared_keys()})
        return out, theta, {}

    def load_pm(self, model, state, data, ctx):
        model.load_partial(state.personal)
