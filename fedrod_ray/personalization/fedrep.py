"""FedRep (Collins et al., 2021): FedPer's split, trained in two phases.

The client first trains its head h_m alone for E - 1 epochs with theta frozen at theta_bar, then theta alone
for 1 epoch with h_m frozen (the official code's order), each phase with an optimiser of its own and the
other part's gradients off; it returns theta*_m and keeps h*_m. Server, GM and PM as FedPer's.
"""

from __future__ import annotations

from .fedper import FedPer
from .registry import register
from .sgd import client_batches, frozen, optimizer, sgd_epochs


def split_epochs(batches, head_epochs: int):
    """(the first ``head_epochs`` epochs, the rest) of an epoch-by-epoch plan."""
    batches = list(batches)
    return batches[:head_epochs], batches[head_epochs:]


@register
class FedRep(FedPer):
    name = "fedrep"

    def fit(self, model, data, ctx):
        head_keys = set(self.personal_keys(model))
        head = [p for k, p in model.named_parameters() if k in head_keys]
        body = [p for k, p in model.named_parameters() if k not in head_keys]
        head_epochs, body_epochs = split_epochs(client_batches(data, ctx), ctx.cfg.local_epochs - 1)
        with frozen(body):
            loss_h, steps_h = sgd_epochs(model, optimizer(head, ctx), iter(head_epochs))
        with frozen(head):
            loss_b, steps_b = sgd_epochs(model, optimizer(body, ctx), iter(body_epochs))
        steps = steps_h + steps_b
        return (loss_h * steps_h + loss_b * steps_b) / steps, steps
