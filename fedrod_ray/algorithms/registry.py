"""The registry of generic-FL rules by name: each rule module registers its class here on import."""

from __future__ import annotations

from ..specs.rules import RULES as SPECS
from .base import GenericRule

RULES: dict[str, type[GenericRule]] = {}


def register(cls: type[GenericRule]) -> type[GenericRule]:
    """Class decorator: make a rule available as ``train.generic_rule: <cls.name>``.

    Args:
        cls: a ``GenericRule`` subclass with a unique ``name`` and the ``Params`` that
            its spec (``fedrod_ray.specs.rules.RULES``) declares.

    Returns:
        ``cls``, registered.
    """
    if not cls.name or cls.name in RULES:
        raise ValueError(f"rule {cls.__name__} needs a unique name, got {cls.name!r}")
    spec = SPECS.get(cls.name)
    if spec is None or spec.params is not cls.Params:
        raise ValueError(f"rule {cls.__name__}: fedrod_ray.specs.rules.RULES must map {cls.name!r} to its Params")
    RULES[cls.name] = cls
    return cls
