"""Generic-FL rules, registered by name (``train.generic_rule``); one file per rule.

A new rule is one module here defining a ``GenericRule`` subclass decorated with ``@register``, plus
its import below, and its spec in ``fedrod_ray.specs.rules.RULES`` with its hyperparameters (``Params``,
filled from ``train.rule_params``), where the config checks them without importing the rules (torch): the
round loop, the client and the checkpoint need no change.
"""

from __future__ import annotations

from typing import Any

from ..config import build_rule_params
from ..config.values import check_registry
from ..specs.rules import RULES as SPECS
from .base import GenericRule, LocalCorrection
from .registry import RULES, register


def build_rule(name: str, params: dict[str, Any] | None = None) -> GenericRule:
    """The rule ``name`` with its ``Params`` built from a plain mapping (``train.rule_params``).

    Raises ``ConfigError`` naming ``train.generic_rule`` for an unknown rule, ``train.rule_params.<field>``
    for an unknown, mistyped or out-of-range parameter, including any parameter given to a rule that takes none.
    """
    checked = build_rule_params(name, params)  # first: it names an unknown rule
    return RULES[name](checked)


# Importing the rule modules registers them.
from . import fedavg, feddyn, fedprox, local_only, scaffold  # noqa: F401

check_registry(RULES, tuple(SPECS), "train.generic_rule")

__all__ = ["RULES", "GenericRule", "LocalCorrection", "build_rule", "register"]
