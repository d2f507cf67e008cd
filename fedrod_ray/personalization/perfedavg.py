"""Per-FedAvg (Fallah et al., 2020), first-order: a global model meant to be adapted by one step.

The client sets w <- w_bar; per step it takes two mini-batches b, b': w~ = w - alpha grad l_CE(w; b), then
w <- w - beta grad l_CE(w~; b') (the gradient at w~, applied to w); alpha is the round's learning rate. Its
E epochs of mini-batches are taken in consecutive pairs (an odd last one is left out; a client with a single
mini-batch pairs it with itself). The server averages w by sample count. GM = w_bar; PM = w_bar after one
SGD step at alpha on one mini-batch of the client's own training data, made at evaluation (nothing kept).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ..client_update.local import round_lr
from ..specs.methods import PerFedAvgParams
from .base import Personalization
from .registry import register
from .sgd import ce_loss, check_finite, client_batches, result, start

PM_TAG = 12  # the evaluation's adaptation batch is drawn apart from training's


def perfedavg_step(model, params: dict[str, torch.Tensor], b, b2, *, alpha: float, beta: float) -> torch.Tensor:
    """One first-order Per-FedAvg step on the model's ``params`` (in place); returns the loss at w~ on b2."""
    w = {k: p.detach().clone() for k, p in params.items()}
    grads = torch.autograd.grad(ce_loss(model, *b), list(params.values()))
    with torch.no_grad():
        for p, g in zip(params.values(), grads):
            p.sub_(alpha * g)
    loss = ce_loss(model, *b2)
    grads = torch.autograd.grad(loss, list(params.values()))
    with torch.no_grad():
        for (k, p), g in zip(params.items(), grads):
            p.copy_(w[k] - beta * g)
    return loss.detach()


def pairs(batches: list) -> list[tuple]:
    """Consecutive pairs of mini-batches; one mini-batch pairs with itself."""
    if len(batches) == 1:
        return [(batches[0], batches[0])]
    return list(zip(batches[0::2], batches[1::2]))


@register
class PerFedAvg(Personalization):
    name = "perfedavg"
    Params = PerFedAvgParams
    global_reading = None
    pm_from_global = True

    def train(self, model, message, data, personal, local_model, rule_state, objectives, momentum, ctx):
        t0 = time.perf_counter()
        start(model, message.weights, ctx)
        params = dict(model.named_parameters())
        alpha = round_lr(ctx.cfg, ctx.round_idx)
        batches = [b for epoch in client_batches(data, ctx) for b in epoch]
        loss_sum = torch.zeros(())
        steps = pairs(batches)
        for b, b2 in steps:
            loss_sum += perfedavg_step(model, params, b, b2, alpha=alpha, beta=self.params.beta).cpu()
        check_finite(loss_sum, ctx.cfg.local_epochs - 1)
        return result(model, num_samples=len(data), loss=(loss_sum / len(steps)).item(), steps=len(steps),
                      t0=t0), None, {}

    def pm_job(self, state, global_shared, rounds_done, server_state, client_id):
        return dataclasses.replace(state, personal=None, local_model=global_shared, rounds_trained=rounds_done)

    def load_pm(self, model, state, data, ctx):
        """w_bar after one SGD step at alpha on the first mini-batch of a seeded pass over the client's data."""
        model.load_partial(state.local_model)
        model.train()
        params = list(model.parameters())
        xb, yb = next(client_batches(data(), ctx, PM_TAG, epochs=1))[0]
        grads = torch.autograd.grad(ce_loss(model, xb, yb), params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(round_lr(ctx.cfg, ctx.round_idx) * g)
