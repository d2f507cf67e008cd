"""FedBABU (Oh, Kim & Yun, ICLR 2022): a body trained for fine-tuning under a head that never trains.

The head h (the generic head, weight and bias) keeps its initial weights h_init for the whole federated
training. The client sets (theta, h) <- (theta_bar, h_init) and trains theta alone, E epochs of SGD on
cross-entropy with h frozen; the server averages theta by sample count and keeps h at h_init (pinned:
whatever the average or a privacy noise would make of it). GM = {theta_bar, h_init}. PM = the GM
fine-tuned, all of (theta, h), on the client's own training data for ``finetune_epochs`` epochs
(``finetune.fine_tune``), made at evaluation, nothing kept. A new client gets the GM, and its "after" is the
same fine-tuning (at ``eval.finetune_epochs``, as every method's).
"""

from __future__ import annotations

import dataclasses
import time

from ..models import GENERIC_HEAD
from ..specs.methods import FedBABUParams
from .base import Personalization
from .finetune import fine_tune
from .registry import register
from .sgd import client_batches, frozen, optimizer, result, sgd_epochs, start


def head_keys(keys) -> list[str]:
    """The head's parameters (the generic head), which FedBABU never trains during federated training."""
    return [k for k in keys if k.startswith(GENERIC_HEAD)]


@register
class FedBABU(Personalization):
    name = "fedbabu"
    Params = FedBABUParams
    global_reading = None
    pm_from_global = True

    def train(self, model, message, data, personal, local_model, rule_state, objectives, momentum, ctx):
        t0 = time.perf_counter()
        start(model, message.weights, ctx)
        head = set(head_keys(dict(model.named_parameters())))
        body = [p for k, p in model.named_parameters() if k not in head]
        with frozen(p for k, p in model.named_parameters() if k in head):
            loss, steps = sgd_epochs(model, optimizer(body, ctx), client_batches(data, ctx))
        return result(model, num_samples=len(data), loss=loss, steps=steps, t0=t0), None, {}

    def server_update(self, averaged, results, uploads, server_state, initial, num_clients, ask):
        """The averaged body with the head at h_init."""
        return {**averaged, **{k: initial[k] for k in head_keys(averaged)}}, server_state

    def pm_job(self, state, global_shared, rounds_done, server_state, client_id):
        return dataclasses.replace(state, personal=None, local_model=global_shared, rounds_trained=rounds_done)

    def load_pm(self, model, state, data, ctx):
        """The GM fine-tuned, body and head, for ``finetune_epochs`` epochs on the client's data."""
        fine_tune(model, state.local_model, data(), None, self.params.finetune_epochs, ctx)
