"""The registry of local objectives by name: each objective module registers its class here on import."""

from __future__ import annotations

from .base import LocalObjective

OBJECTIVES: dict[str, type[LocalObjective]] = {}


def register(cls: type[LocalObjective]) -> type[LocalObjective]:
    if not cls.name or cls.name in OBJECTIVES:
        raise ValueError(f"objective {cls.__name__} needs a unique name, got {cls.name!r}")
    OBJECTIVES[cls.name] = cls
    return cls
