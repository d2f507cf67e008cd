"""Balanced losses and local objectives (``train.balanced_loss``): a loss function of
``fedrod_ray.client_update.losses``, or a local objective of ``fedrod_ray.objectives`` with state and a config
section of its own; what each one needs and rules out."""

from __future__ import annotations

import dataclasses

from pydantic.dataclasses import dataclass

from ..config.values import CLOSED, PositiveFloat, PositiveInt

# gamma's value where a loss has one and train.gamma leaves it out (Meta-BSM: gamma_m's initial value).
DEFAULT_GAMMA = 1.0


@dataclass(config=CLOSED)
class MetaBSMConfig:
    """Fed-RoD (Meta-BSM), ``train.balanced_loss: meta_bsm`` only (fedrod_ray.objectives.meta_bsm)."""

    meta_lr: PositiveFloat = 0.001  # SGD step size of the Meta-Weight-Net on the meta loss, per batch
    gamma_lr: PositiveFloat = 0.1  # SGD step size of gamma_m on the meta loss, per batch
    meta_per_class: PositiveInt = 10  # the server's balanced meta set: examples per class taken out of training
    hidden: PositiveInt = 100  # Meta-Weight-Net width: loss -> hidden -> weight (Shu et al., 2019)


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """``gamma``: the loss has an exponent or margin gamma (``train.gamma``); ``objective``: a local objective
    (``fedrod_ray.objectives``, with its section ``train.<name>``), else a batch mean of per-example terms
    (``fedrod_ray.client_update.losses``), the only kind the batched local update and ``train.step: compiled``
    support; ``meta_set``: it takes a balanced meta set out of the clients' examples."""

    gamma: bool = False
    objective: bool = False
    meta_set: bool = False


LOSSES: dict[str, LossSpec] = {
    "ce": LossSpec(), "bsm": LossSpec(gamma=True), "reweight": LossSpec(), "ldam": LossSpec(gamma=True),
    "cdt": LossSpec(gamma=True), "meta_bsm": LossSpec(gamma=True, objective=True, meta_set=True),
}
