"""One mini-batch of a client update (docs/method.md, "One round", step 2): the losses, one backward, the
generic rule's gradient term and the optimizer's step.

``make_train_step`` takes the mini-batch's losses as a function, so that a loss with a procedure of its
own (a local objective's, ``fedrod_ray.objectives``: Meta-BSM's meta step) plugs in where ``make_losses`` gives Fed-RoD's

    L = l_BR(h_G(z)) + l_CE(h_G(z).detach() + h_P(z.detach())).

``train.step`` chooses how those losses run:

- ``eager``: op by op, as PyTorch executes them;
- ``compiled``: ``torch.compile`` of the forward pass and both losses; AOTAutograd compiles the backward
  with them, so the whole step but the rule's term and the optimizer runs as two generated graphs.
  ``dynamic=False``: one graph for the batch size. A client's last, smaller batch (it has any number of
  examples) runs eagerly: a graph per remainder size would mean a compile for almost every new client.
  The compiled step equals the eager one up to float rounding (fused kernels sum in another order;
  tests/test_step.py bounds the difference). On CPU it is slower than eager (bench/local_throughput.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..algorithms import LocalCorrection
from ..config.sections import STEPS
from ..models import FedModel
from .losses import LossFn

# (mini-batch x, labels) -> (generic balanced loss, personalized loss or None), both with their graphs.
LossesFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
# (mini-batch x, labels) -> the same losses, detached, after the optimizer's step.
StepFn = LossesFn


def fedrod_losses(model: FedModel, br_loss: LossFn, gamma: float, xb: torch.Tensor, yb: torch.Tensor,
                  counts: torch.Tensor, dist: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """l_BR of the generic logits and (with a personalized head) l_CE of the personalized ones, which
    reach theta and psi through neither: they see z and h_G(z) detached."""
    z = model.features(xb)
    g = model.generic_head(z)
    loss_g = br_loss(g, yb, counts, gamma)
    if model.variant is None:
        return loss_g, None
    return loss_g, F.cross_entropy(model.personal_logits(z.detach(), g.detach(), dist), yb)


_compiled: Callable | None = None


def _compiled_losses() -> Callable:
    """``fedrod_losses`` compiled, made once per process: Dynamo caches its graphs by the model (one per
    host), the loss and gamma, so every later client update reuses them."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(fedrod_losses, dynamic=False)
    return _compiled


def make_losses(model: FedModel, br_loss: LossFn, gamma: float, counts: torch.Tensor, dist: torch.Tensor, *,
                batch_size: int, step: str = "eager") -> LossesFn:
    """One client's ``fedrod_losses``, run as ``train.step`` says (``STEPS``)."""
    if step not in STEPS:
        raise ValueError(f"unknown step {step!r}; expected one of {list(STEPS)}")
    compiled = _compiled_losses() if step == "compiled" else None

    def losses(xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        fn = compiled if compiled is not None and len(yb) == batch_size else fedrod_losses
        return fn(model, br_loss, gamma, xb, yb, counts, dist)

    return losses


def make_train_step(model: FedModel, optimizer: torch.optim.Optimizer, losses: LossesFn,
                    correction: LocalCorrection | None) -> StepFn:
    """A function that trains ``model`` on one mini-batch and returns its losses, detached."""
    params = dict(model.named_parameters())

    def step(xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        loss_g, loss_p = losses(xb, yb)
        loss = loss_g if loss_p is None else loss_g + loss_p
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if correction is not None:
            with torch.no_grad():
                correction.apply(params)
        optimizer.step()
        return loss_g.detach(), None if loss_p is None else loss_p.detach()

    return step
