"""The registry of personalization methods by name: each method module registers its class here on import."""

from __future__ import annotations

from ..specs.methods import HEADS, NEW_CLIENT_NEEDS
from .base import Personalization

METHODS: dict[str, type[Personalization]] = {}


def register(cls: type[Personalization]) -> type[Personalization]:
    if not cls.name or cls.name in METHODS:
        raise ValueError(f"method {cls.__name__} needs a unique name, got {cls.name!r}")
    spec = HEADS.get(cls.name)
    if spec is None or spec.params is not cls.Params:
        raise ValueError(f"method {cls.__name__}: fedrod_ray.specs.methods.HEADS must map {cls.name!r} to its Params")
    if cls.new_client_needs not in NEW_CLIENT_NEEDS:
        raise ValueError(f"method {cls.__name__}: new_client_needs must be one of {NEW_CLIENT_NEEDS}")
    METHODS[cls.name] = cls
    return cls
