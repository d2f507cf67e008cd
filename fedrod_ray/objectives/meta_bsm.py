"""Fed-RoD (Meta-BSM): balanced softmax with a meta-learned gamma_m and Meta-Weight-Net example weights.

FEDROD.md, "One round", paragraph Meta-BSM (the paper's appendix, "Extension with meta-learning for the
improved BSM loss"). ``train.balanced_loss: meta_bsm`` replaces step 2's l_BR; everything else in the
round (the personalized loss, the generic rule, the server's average) is as for the other losses.

The method
----------
The server holds D_meta: ``train.meta_bsm.meta_per_class`` (10) examples of every class, drawn (seeded)
from the training set before it is split, so no client holds them (``Partition.meta_indices``; every
host gets them, as it gets the clients' indices). Client m keeps gamma_m (``ClientState.objectives``'s
``meta_bsm``, starting at ``train.gamma``, default 1). The Meta-Weight-Net zeta (the model part ``mwn``,
``train.meta_bsm.hidden`` wide, Shu et al. 2019)
maps an example's loss value to a weight in (0, 1): Linear(1 -> hidden) -> ReLU -> Linear(hidden -> 1)
-> sigmoid. With w = (theta, psi), eta the round's learning rate, beta = ``train.meta_bsm.meta_lr`` and
beta_gamma = ``train.meta_bsm.gamma_lr``, per mini-batch B of D_m:

1. l_i = l^BSM_{gamma_m}(x_i, y_i; w) = -log( N_{m,y_i}^gamma_m e^{g_{y_i}} / sum_c N_{m,c}^gamma_m e^{g_c} ),
   g = h_G(f(x_i; theta); psi);  q_i = MWNet(l_i; zeta), the loss entering as a value.
2. Virtual step: w~(gamma_m, zeta) = w - eta * grad_w sum_i q_i l_i / sum_i q_i, its graph kept.
3. Meta loss: L_meta(gamma_m, zeta) = (1/|D_meta|) sum_{(x, y) in D_meta} l_CE(h_G(f(x; theta~); psi~), y);
   gamma_m <- max(0, gamma_m - beta_gamma dL_meta/dgamma_m),  zeta <- zeta - beta grad_zeta L_meta.
4. Real step: L = sum_i q'_i l'_i / sum_i q'_i + l_CE(h_G(z).detach() + h_P(z.detach()), y), with l'_i under
   the new gamma_m and q'_i = MWNet(l'_i; new zeta) as constants. One backward; then, as for every
   loss, the generic rule's correction and the optimizer's step (momentum, weight decay) on w and phi_m
   (or nu). The forward pass of step 1 serves steps 2 and 4: w has not changed in between.

After the local epochs the client returns theta*, psi*, (hyper) nu* and zeta*; the server averages zeta
by sample count, like nu; the client keeps gamma_m* (and phi*_m).

Choices where the paper leaves it open
--------------------------------------
- The meta loss is plain cross-entropy of the generic logits, unweighted. The paper writes it with the
  same example weights and gamma_m. BSM under gamma_m with the meta set's own class counts *is*
  cross-entropy: the counts are all equal, so N^gamma_m shifts every logit by the same amount, which
  cancels. With the client's counts N_m instead, the meta loss would score w~ on the client's skew, not
  on the balanced distribution the generic model is for, and would reward gamma_m directly rather than
  through w~. Weighting the meta examples by q would let zeta lower the meta loss by shrinking every
  weight, whatever w~ does.
- zeta is one network the server averages (by sample count, as nu): the meta set it learns from is the
  same for every client and the map from a loss value to a weight does not depend on the client (the
  loss value already carries gamma_m and the client's counts), so pooling every participant's meta
  gradients trains it on far more steps than one client's rounds give. gamma_m stays the client's: it
  is meant to fit the client's own label skew (the paper's subscript m; zeta has none).
- beta and beta_gamma are plain SGD step sizes (the brief's "one gradient step", which also keeps the
  update a pure function of the mini-batch), one for zeta and one for gamma_m, because their meta
  gradients differ in scale and in what a step does. zeta's is a dot product of two gradients over
  all of w, of order 1 for the paper's CNN even with the factor eta in it: at beta = 1 the MWN's output
  layer grew from norm 0.6 to 7 within 10 mini-batches on Fashion-MNIST and its weights spread over
  orders of magnitude (README, "Meta-BSM"); beta = 0.001 is Shu et al.'s step for it (with Adam). At
  that step gamma_m would not move (0.002 in two epochs of a skewed client); at beta_gamma = 0.1 it
  moves by ~0.2 in those epochs, steadily; at 1 it oscillates.
- Per Shu et al., q enters as the weight of a loss, not as a function of w: MWNet reads the loss value
  (detached), and the real step's weights are constants. The virtual step is plain SGD, without the
  optimizer's momentum and weight decay or the generic rule's correction, none of which depends on
  gamma_m or zeta.
- The weighted loss is the weighted mean sum_i q_i l_i / sum_i q_i (FEDROD.md writes the sum; Shu et al.'s
  code divides by the weights' sum), in the virtual and the real step, so that eta means what it means
  for the other losses and zeta decides only how a batch's step is shared among its examples, not how
  large it is. Unnormalised, every local step of a skewed client raises the balanced meta loss a little,
  so the meta gradient shrinks every weight: at Dir(0.3) the weights fell below 1e-6 after one round and
  froze the generic model (README, "Meta-BSM"). If every weight underflows to 0 the batch's step is 0.
- gamma_m is kept >= 0: N^gamma with gamma < 0 would give a class the client lacks infinite weight. At
  gamma_m = 0 the loss is plain cross-entropy, as ``train.gamma: 0`` is for ``bsm``.
- ``train_loss`` reports the weighted loss of step 4 (what the real step minimises).
- D_meta is used whole in every step, without augmentation: 10 examples per class, a few hundred rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from ..config import DEFAULT_GAMMA, TrainConfig
from ..losses import balanced_softmax
from .base import LocalObjective, MetaSet
from .registry import register

if TYPE_CHECKING:
    from ..aggregate import StateDict
    from ..models import FedModel
    from ..step import LossesFn

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
