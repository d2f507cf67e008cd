"""Fine-tuning (docs/method.md, "Baselines": FT, and "Evaluation": new clients): E epochs of plain SGD on a
client's own training data from given weights, the default way a client adapts a model it received
(``Personalization.adapt``) and FedBABU's PM.

One head (FedAvg and its kin): the whole model, with ERM (cross-entropy). Fed-RoD (linear): its own local
objective from the global theta and psi and the client's head phi_m. Plain SGD (no generic rule's term, no
momentum kept) at the round's learning rate, with its own seeded batch order (``FINETUNE_TAG``).
"""

from __future__ import annotations

import dataclasses

from ..algorithms import build_rule
from ..client_update.local import ClientData, ClientStart, RoundInput, derived_seed, local_update
from ..models import FedModel
from ..objectives import get_objective
from ..server_math.aggregate import StateDict

FINETUNE_TAG = 2  # seeds fine-tuning's data order apart from every training round's


def fine_tune(model: FedModel, start: StateDict, data: ClientData, personal: StateDict | None, epochs: int,
              ctx) -> None:
    """Fine-tune ``model`` in place for ``epochs`` epochs on ``data`` from the weights ``start`` (those the
    model has) and, for a linear personalized head, the head ``personal`` (None: zeros), at round
    ``ctx.round_idx``'s learning rate."""
    t = ctx.cfg
    objective = get_objective(t.balanced_loss)
    loss = t.balanced_loss if objective is None else objective.fallback_loss
    variant = model.variant
    # Tuned as the one-head model (ERM) or as Fed-RoD's linear head, with plain SGD.
    cfg = dataclasses.replace(t, head="none" if variant is None else "linear", head_params={},
                              local_epochs=epochs, momentum_buffers="reset", generic_rule="fedavg", rule_params={},
                              balanced_loss="ce" if variant is None else loss)
    own = model.state_dict()
    tuning = dataclasses.replace(ctx, cfg=cfg, rule=build_rule("fedavg"), seed=derived_seed(ctx.seed, FINETUNE_TAG),
                                 meta_set=None)
    local_update(model, RoundInput({k: v for k, v in start.items() if k in own}), data, tuning,
                 ClientStart(personal=personal))
