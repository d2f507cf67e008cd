"""MTL (Smith et al., 2017, MOCHA's objective) with the task relationship fixed to Omega = I - 11^T / M, its
mean-regularised case: each client keeps its model w_m (the initial weights the first time).

The server sends the mean of all M clients' current models, w_bar_all; the client runs E epochs of SGD on
l_CE(w_m) + (lam / 2) ||w_m - w_bar_all||^2 from its w_m and uploads it; the server's new w_bar_all is the
plain mean over all M clients (those that never trained count with the initial weights). No global model:
the GM is w_bar_all, the mean of the PMs; the PM is w_m.
"""

from __future__ import annotations

import time

from ..specs.methods import MTLParams
from .base import Personalization, mean_state
from .ditto import prox_fit
from .registry import register
from .sgd import result, start


class OwnModels(Personalization):
    """A method whose clients each keep a whole model (their last upload) and start from it."""

    global_reading = None
    starts_from_local_model = True
    server_reads_clients = True

    def start(self, model, local_model, ctx) -> None:
        """Its own model, or (a client that never trained) the initial weights."""
        start(model, ctx.initial if local_model is None else local_model, ctx)

    def server_update(self, averaged, results, uploads, server_state, initial, num_clients, ask):
        """The global weights become the plain mean of every training client's current model, each read once."""
        models = (initial if (m := uploads.get(cid)) is None else m for cid in range(num_clients))
        return mean_state({k: m[k] for k in averaged} for m in models), server_state

    def load_pm(self, model, state, data, ctx):
        model.load_partial(state.local_model)


@register
class MTL(OwnModels):
    name = "mtl"
    Params = MTLParams

    def train(self, model, message, data, personal, local_model, rule_state, objectives, momentum, ctx):
        t0 = time.perf_counter()
        self.start(model, local_model, ctx)
        loss, steps = prox_fit(model, data, ctx, message.weights, self.params.lam)
        return result(model, num_samples=len(data), loss=loss, steps=steps, t0=t0), None, {}
