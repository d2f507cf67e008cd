"""Local objectives, registered by name (``train.balanced_loss``); one file per objective.

A new objective is one module here defining a ``LocalObjective`` subclass decorated with ``@register``,
plus its import below and its spec in ``fedrod_ray.specs.losses`` (``objective=True``): the local update, the client, the model, the partition and the checkpoint take its
state, meta set and model parts from it. (Its config section ``train.<name>`` is declared in its spec module
and named in ``fedrod_ray.config.sections.TrainConfig``.)
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..config import TrainConfig
from ..config.values import check_registry
from ..specs.losses import LOSSES
from .base import LocalObjective, MetaSet
from .registry import OBJECTIVES, register


def get_objective(balanced_loss: str) -> type[LocalObjective] | None:
    """The objective ``train.balanced_loss`` names; None for a plain balanced loss (``losses``)."""
    return OBJECTIVES.get(balanced_loss)


def meta_per_class(cfg: TrainConfig) -> int:
    """Examples per class of the server's meta set (0: none, the training set is all the clients')."""
    objective = get_objective(cfg.balanced_loss)
    return 0 if objective is None else objective.meta_per_class(cfg)


def model_parts(cfg: TrainConfig) -> dict[str, Callable[[], nn.Module]]:
    """The model's extra modules (``FedModel``'s ``parts``) for this config."""
    objective = get_objective(cfg.balanced_loss)
    return {} if objective is None else objective.model_parts(cfg)


# Importing the objective modules registers them.
from . import meta_bsm  # noqa: F401

check_registry(OBJECTIVES, [n for n, s in LOSSES.items() if s.objective], "train.balanced_loss")

__all__ = ["OBJECTIVES", "LocalObjective", "MetaSet", "get_objective", "meta_per_class", "model_parts", "register"]
