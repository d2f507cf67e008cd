"""The registry of local objectives by name: each objective module registers its class here on import."""

from __future__ import annotations

from .base import LocalObjective

OBJECTIVES: dict[str, type[LocalObjective]] = {}


def register(cls: type[LocalObjective]) -> type[LocalObjective]:
    """Class decorator: make an objective available as ``train.balanced_loss: <cls.name>``.

    Args:
        cls: a ``LocalObjective`` subclass with a unique ``name``.

    Returns:
        ``cls``, registered.
    """
    if not cls.name or cls.name in OBJECTIVES:
        raise ValueError(f"objective {cls.__name__} needs a unique name, got {cls.name!r}")
    OBJECTIVES[cls.name] = cls
    return cls
