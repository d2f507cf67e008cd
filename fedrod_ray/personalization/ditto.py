"""Ditto (Li et al., 2021; the paper's "FMTL"): a FedAvg model and a personal model v_m per client.

Per round the client (1) runs the FedAvg update: w <- w_bar, E epochs of SGD on cross-entropy, returning
w*_m; (2) trains its personal model v_m (the initial weights the first time) for E epochs of SGD on
l_CE(v_m) + (lam / 2) ||v_m - w_bar||^2, w_bar the round's global model, fixed. The server averages w*_m by
sample count. GM = w_bar, PM = v_m.
"""

from __future__ import annotations

import time

from ..specs.methods import DittoParams
from .base import Personalization
from .registry import register
from .sgd import client_batches, cpu_state, optimizer, prox_grad_, result, sgd_epochs, start

PERSONAL_TAG = 11  # the personal pass draws its own batch order


def prox_fit(model, data, ctx, anchor, lam: float, tag: int = 0) -> tuple[float, int]:
    """E epochs of SGD on l_CE + (lam / 2) ||w - anchor||^2 over the model's parameters."""
    params = dict(model.named_parameters())
    anchor = {k: anchor[k].to(ctx.device) for k in params}
    return sgd_epochs(model, optimizer(params.values(), ctx), client_batches(data, ctx, tag),
                      lambda: prox_grad_(params, anchor, lam))


@register
class Ditto(Personalization):
    name = "ditto"
    Params = DittoParams
    global_reading = None

    def train(self, model, message, data, personal, local_model, rule_state, objectives, momentum, ctx):
        t0 = time.perf_counter()
        start(model, message.weights, ctx)
        loss, steps = sgd_epochs(model, optimizer(model.parameters(), ctx), client_batches(data, ctx))
        out = result(model, num_samples=len(data), loss=loss, steps=steps, t0=t0)
        model.load_partial(ctx.initial if personal is None else personal)
        prox_fit(model, data, ctx, message.weights, self.params.lam, PERSONAL_TAG)
        return out, cpu_state(model), {}

    def load_pm(self, model, state, data, ctx):
        model.load_partial(state.personal)
