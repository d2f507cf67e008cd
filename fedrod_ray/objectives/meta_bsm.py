"""Fed-RoD (Meta-BSM): balanced softmax with a meta-learned gamma_m and Meta-Weight-Net example weights.

docs/method.md, "Meta-BSM" (the paper's appendix, "Extension with meta-learning for the improved BSM loss").
``train.balanced_loss: meta_bsm`` replaces step 2's l_BR; the personalized loss, the generic rule and the
server's average stay as for the other losses. Per mini-batch: a virtual SGD step on the weighted BSM loss,
one SGD step of gamma_m and of the Meta-Weight-Net zeta on the meta set's cross-entropy through it, then the
real step. What the paper leaves open (the meta loss, the step sizes, the weights normalised per batch, zeta
shared by the server) is chosen as docs/design.md, "Meta-BSM: choices where the paper is silent" says, and why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from ..client_update.losses import balanced_softmax
from ..config import TrainConfig
from ..specs.losses import DEFAULT_GAMMA
from .base import LocalObjective, MetaSet
from .registry import register

if TYPE_CHECKING:
    from ..client_update.step import LossesFn
    from ..models import FedModel
    from ..server_math.aggregate import StateDict

GAMMA = "gamma"  # gamma_m's key in the client's state


class MetaWeightNet(nn.Module):
    """zeta: an example's loss value -> its weight in (0, 1), Linear(1 -> hidden) -> ReLU -> Linear(hidden -> 1)
    -> sigmoid. Learned against the server's meta set and averaged by the server like nu."""

    def __init__(self, hidden: int = 100):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, losses: torch.Tensor) -> torch.Tensor:
        """Per-example weights (B,) from per-example losses (B,)."""
        return torch.sigmoid(self.net(losses.unsqueeze(-1))).squeeze(-1)


def weighted_mean(losses: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """sum_i q_i l_i / sum_i q_i; 0 where every weight is 0."""
    return (q * losses).sum() / q.sum().clamp_min(torch.finfo(q.dtype).tiny)


# size: the math of one Meta-BSM batch (docs/design.md), each tensor named as in its equations
def meta_bsm_step(model: FedModel, gamma: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor, counts: torch.Tensor,
                  dist: torch.Tensor | None, meta_x: torch.Tensor, meta_y: torch.Tensor, lr: float,
                  meta_lr: float, gamma_lr: float) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Steps 1-3 of one Meta-BSM mini-batch, and the real step's losses (step 4) for the caller's backward.

    ``gamma`` (a 0-d leaf that requires grad) and ``model.mwn``'s parameters are updated in place by one SGD
    step (of ``gamma_lr`` and ``meta_lr``) on the meta loss over (``meta_x``, ``meta_y``) (normalised, on the model's device);
    ``lr`` is the virtual step's eta. Returns (weighted balanced loss, personalized loss or None for a
    one-head model, meta loss before the update, detached). No ``.grad`` is touched: backward of the sum
    of the first two gives the real step's gradients of w and phi_m (or nu), and none of gamma or zeta.
    """
    params = dict(model.named_parameters())
    w = {k: params[k] for k in model.generic_keys() if k in params}
    zeta = list(model.mwn.parameters())
    z = model.features(xb)
    g = model.generic_head(z)

    losses = balanced_softmax(g, yb, counts, gamma, reduction="none")
    grads = torch.autograd.grad(weighted_mean(losses, model.mwn(losses.detach())), list(w.values()),
                                create_graph=True)
    virtual = {k: p - lr * grad for (k, p), grad in zip(w.items(), grads, strict=True)}
    meta_loss = F.cross_entropy(functional_call(model, virtual, (meta_x,)), meta_y)
    # The forward graph of z and g is kept for the real step's backward.
    grad_gamma, *grad_zeta = torch.autograd.grad(meta_loss, [gamma, *zeta], retain_graph=True)
    with torch.no_grad():
        gamma.sub_(gamma_lr * grad_gamma).clamp_(min=0)
        for p, grad in zip(zeta, grad_zeta, strict=True):
            p.sub_(meta_lr * grad)

    losses = balanced_softmax(g, yb, counts, gamma.detach(), reduction="none")
    with torch.no_grad():
        q = model.mwn(losses)
    loss_g = weighted_mean(losses, q)
    loss_p = None
    if model.variant is not None:
        loss_p = F.cross_entropy(model.personal_logits(z.detach(), g.detach(), dist), yb)
    return loss_g, loss_p, meta_loss.detach()


@register
class MetaBSM(LocalObjective):
    """One client's Meta-BSM through one local update: its gamma_m and the server's meta set, on the device.
    ``state()`` is what the client keeps afterwards."""

    name = "meta_bsm"

    @classmethod
    def meta_per_class(cls, cfg: TrainConfig) -> int:
        return cfg.meta_bsm.meta_per_class

    @classmethod
    def model_parts(cls, cfg: TrainConfig) -> dict[str, Callable[[], nn.Module]]:
        return {"mwn": lambda: MetaWeightNet(cfg.meta_bsm.hidden)}

    def __init__(self, cfg: TrainConfig, meta: MetaSet, state: StateDict, device: torch.device):
        super().__init__(cfg, meta, state, device)
        if meta is None:
            raise ValueError("train.balanced_loss=meta_bsm needs the server's meta set, and this host has none")
        self.meta_x, self.meta_y = meta
        start = state[GAMMA] if state else torch.tensor(DEFAULT_GAMMA if cfg.gamma is None else cfg.gamma)
        self.gamma = start.to(device, torch.float32, copy=True).requires_grad_()
        self.meta_lr, self.gamma_lr = cfg.meta_bsm.meta_lr, cfg.meta_bsm.gamma_lr

    def losses(self, model: FedModel, counts: torch.Tensor, dist: torch.Tensor, lr: float) -> LossesFn:
        """``meta_bsm_step`` on each mini-batch: (weighted balanced loss, personalized loss or None)."""

        def losses(xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            loss_g, loss_p, _ = meta_bsm_step(model, self.gamma, xb, yb, counts, dist, self.meta_x, self.meta_y,
                                              lr, self.meta_lr, self.gamma_lr)
            return loss_g, loss_p

        return losses

    def state(self) -> StateDict:
        return {GAMMA: self.gamma.detach().to("cpu", copy=True)}
