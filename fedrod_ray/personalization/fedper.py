"""FedPer (Arivazhagan et al., 2019): the feature extractor theta is shared, the classifier h_m personal.

The client starts from the global theta and its own h_m (a client that never trained: the initial head),
trains both for E epochs of SGD on cross-entropy, returns theta*_m and keeps h*_m. The server takes the
sample-weighted mean of theta. There is no global model: the GM is the mean of the clients' PMs
{theta*_m, h*_m}; the PM's global reading is {theta_bar, h_m}.
"""

from __future__ import annotations

import time

import torch

from ..models import GENERIC_HEAD
from .base import Personalization, mean_state
from .registry import register
from .sgd import client_batches, cpu_state, optimizer, result, sgd_epochs, start


class SplitModel(Personalization):
    """A method that keeps some of the model's parameters on each client and averages the rest."""

    reading_replaces_head = True

    def train(self, model, message, data, personal, local_model, rule_state, objectives, momentum, ctx):
        t0 = time.perf_counter()
        # The global shared weights and the client's personal ones (a new client: the initial ones).
        own = personal if personal is not None else {k: ctx.initial[k] for k in model.personal_keys()}
        start(model, {**message.weights, **own}, ctx)
        loss, steps = self.fit(model, data, ctx)
        return (result(model, num_samples=len(data), loss=loss, steps=steps, t0=t0),
                cpu_state(model, model.personal_keys()), {})

    def fit(self, model, data, ctx) -> tuple[float, int]:
        """E epochs of SGD on all of the model."""
        return sgd_epochs(model, optimizer(model.parameters(), ctx), client_batches(data, ctx))

    def generic_model(self, global_shared, pms):
        return mean_state(pms())


@register
class FedPer(SplitModel):
    name = "fedper"

    def personal_keys(self, model):
        return [k for k in model.state_dict() if k.startswith(GENERIC_HEAD)]

    def reading_heads(self, model, personal, class_dists, initial):
        key = f"{GENERIC_HEAD}weight"
        return torch.stack([(initial if p is None else p)[key] for p in personal])
