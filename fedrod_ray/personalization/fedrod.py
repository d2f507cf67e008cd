"""Fed-RoD's own personalization (docs/method.md): one head (FedAvg and the generic-FL rows), a linear
personalized head phi_m kept by each client, or a hypernetwork H(a_m; nu) the server averages.

All three train by ``local.local_update``: the balanced loss of the generic head, and with a personalized
head the cross-entropy of the personalized logits on detached features; the generic rule and the local
objective act as they say. The PM is the client's last local model (with its phi_m); its global reading is
the global model with the client's head: phi_m, H(a_m; nu_bar), or none (the GM itself), which is also a new
client's zero-shot model (hyper: from its class counts alone). Fine-tuning (``adapt``) tunes the global model
with the client's head: phi_m (zeros for a client that never trained) or, for hyper, the zero-shot head
H(a_m; nu_bar), then tuned as a linear head.
"""

from __future__ import annotations

import torch

from ..client_update.local import ClientStart, load_client_weights, local_update
from ..models import FedModel, build_model
from .base import Personalization
from .finetune import fine_tune
from .registry import register


class _FedRoD(Personalization):
    def train(self, model, message, data, personal, local_model, rule_state, objectives, momentum, ctx):
        return local_update(model, message, data, ctx, ClientStart(
            personal, rule_state, local_model if ctx.rule.starts_from_local_model else None, objectives, momentum))

    def load_pm(self, model, state, data, ctx):
        load_client_weights(model, state.local_model, state.personal)


@register
class OneHead(_FedRoD):
    """The one-head model: FedAvg and the generic-FL rules, the PM is the client's local model w_m."""

    name = "none"


@register
class LinearHead(_FedRoD):
    name = "linear"
    variant = "linear"

    def adapt(self, model, message, data, personal, epochs, ctx):
        fine_tune(model, message.weights, data, personal, epochs, ctx)
        return model

    def reading_heads(self, model, personal, class_dists, initial):
        shape = model.personal_head.weight.shape
        return torch.stack([torch.zeros(shape) if p is None else p["personal_head.weight"] for p in personal])


@register
class HyperHead(_FedRoD):
    name = "hyper"
    variant = "hyper"
    new_client_needs = "class_counts"

    def __init__(self, params=None):
        super().__init__(params)
        self._tuner: FedModel | None = None

    def adapt(self, model, message, data, personal, epochs, ctx):
        """Fine-tuning from the zero-shot head H(a_m; nu_bar), tuned as a linear head (a tuned model has no
        hypernetwork): on a linear model of the same architecture, built once."""
        model.load_partial(message.weights)
        with torch.no_grad():
            head = {"personal_head.weight": model.personal_weight(data.class_dist.to(ctx.device))}
        if self._tuner is None:
            self._tuner = build_model(model.arch, model.num_classes, tuple(data.x.shape[1:]), "linear",
                                      seed=ctx.seed).to(ctx.device)
        fine_tune(self._tuner, message.weights, data, head, epochs, ctx)
        return self._tuner

    def reading_heads(self, model, personal, class_dists, initial):
        return model.personal_weight(class_dists)
