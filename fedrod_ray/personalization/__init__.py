"""Personalization methods, registered by name (``train.head``); one file per method.

A new method is one module here defining a ``Personalization`` subclass decorated with ``@register``, plus
its import below, and its spec in ``fedrod_ray.specs.methods.HEADS`` with its hyperparameters (``Params``, filled
from ``train.head_params``) and constraints (``HeadSpec``), which the config checks without importing torch:
the round loop, the clients, the evaluation and the checkpoint need no change.
"""

from __future__ import annotations

from typing import Any

from ..config import ExperimentConfig, build_head_params
from ..config.values import check_registry
from ..models import FedModel, build_model
from ..objectives import model_parts
from ..server_math.aggregate import StateDict
from ..specs.methods import HEADS
from .base import Ask, Personalization, ServerContext, UpdateContext, mean_state
from .registry import METHODS, register


def build_method(name: str, params: dict[str, Any] | None = None) -> Personalization:
    """The method ``name`` with its ``Params`` built from a plain mapping (``train.head_params``); a
    ``ConfigError`` names the field."""
    checked = build_head_params(name, params)  # first: it names an unknown method
    return METHODS[name](checked)


def method_model(cfg: ExperimentConfig, method: Personalization, num_classes: int,
                 image_shape: tuple[int, int, int]) -> FedModel:
    """The run's model (initial weights from ``cfg.seed``) with the method's personalized part and split."""
    model = build_model(cfg.model.arch, num_classes, image_shape, method.variant, cfg.hyper_hidden, cfg.seed,
                        model_parts(cfg.train), cfg.model.init, method.readout)
    model.keep(method.personal_keys(model))
    return model


def generic_weights(method: Personalization, personal_keys: list[str], global_shared: StateDict,
                    clients: dict, initial: StateDict, num_clients: int) -> StateDict:
    """The GM's weights (G-FL, P-FL (GM), ``final/``): the global ones, or, for a method without a global
    model, the mean of the training clients' PMs, each its last upload with its ``personal_keys`` (a client
    that never trained: the global weights with the initial personal part)."""

    def pm(state) -> StateDict:
        if state.local_model is None:
            return {**global_shared, **{k: initial[k] for k in personal_keys}}
        return {**state.local_model, **(state.personal or {k: initial[k] for k in personal_keys})}

    return method.generic_model(global_shared, lambda: (pm(clients[cid]) for cid in range(num_clients)))


# Importing the method modules registers them.
from . import (  # noqa: F401
    ditto,
    fedala,
    fedbabu,
    fedcp,
    feddbe,
    fedfomo,
    fedper,
    fedrep,
    fedrod,
    gpfl,
    lg_fedavg,
    mtl,
    pefll,
    perfedavg,
    pfedhn,
    pfedme,
)

check_registry(METHODS, tuple(HEADS), "train.head")

__all__ = ["METHODS", "Ask", "Personalization", "ServerContext", "UpdateContext", "build_method", "generic_weights", "mean_state", "method_model", "register"]
