"""Generic-FL rules, registered by name (``train.generic_rule``); one file per rule.

A new rule is one module here defining a ``GenericRule`` subclass decorated with ``@register``, plus
its import below: the round loop, the client, the checkpoint and the config need no change. Its
hyperparameters are a dataclass (``Params``) filled from ``train.rule_params``.
"""

from __future__ import annotations

import difflib
from typing import Any

from .base import GenericRule, LocalCorrection, NoParams
from .registry import RULES, register


def get_rule_class(name: str) -> type[GenericRule]:
    try:
        return RULES[name]
    except KeyError:
        close = difflib.get_close_matches(name, sorted(RULES), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(f"unknown generic rule {name!r}; expected one of {sorted(RULES)}{hint}") from None


def build_rule(name: str, params: dict[str, Any] | None = None) -> GenericRule:
    """The rule ``name`` with its ``Params`` built from a plain mapping (``train.rule_params``).

    Raises ``ConfigError`` naming ``train.rule_params.<field>`` for an unknown, mistyped or
    out-of-range parameter, including any parameter given to a rule that takes none.
    """
    from ..config import ConfigError, build_dataclass

    try:
        cls = get_rule_class(name)
    except ValueError as e:
        raise ConfigError(f"train.generic_rule: {e}") from None
    try:
        return cls(build_dataclass(cls.Params, params or {}, "train.rule_params."))
    except ConfigError as e:
        raise ConfigError(f"{e} (train.generic_rule={name})") from None
    except ValueError as e:  # a Params range check: "<field>: must be ..."
        raise ConfigError(f"train.rule_params.{e} (train.generic_rule={name})") from None


# Importing the rule modules registers them.
from . import fedavg, feddyn, fedprox, local_only, scaffold  # noqa: F401

__all__ = ["RULES", "GenericRule", "LocalCorrection", "NoParams", "build_rule", "get_rule_class", "register"]
