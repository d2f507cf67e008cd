"""Code the user brings: entry points that installed packages register (``fedrod_ray.datasets``,
``fedrod_ray.models``) and ``package.module:factory`` import paths, loaded with errors that name the
config field that asked for them."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from .values import ConfigError, plugin_names

__all__ = ["import_object", "load_plugin", "plugin_names", "plugin_sources"]


def load_plugin(group: str, name: str, field: str, kind: str) -> Callable[..., Any]:
    """The object an installed package registers as ``name`` under the entry-point group ``group``.

    Args:
        group: ``fedrod_ray.datasets`` (a callable ``(cfg: DataConfig, seed: int) -> ImageDataset``) or
            ``fedrod_ray.models`` (a factory ``(C, H, W) -> nn.Module`` mapping N x C x H x W to N x d).
        name: the name the config gives (``data.dataset``, ``model.arch``).
        field: the config field to name in an error.
        kind: what the error calls the plug-in ("dataset", "arch").

    Returns:
        The loaded object.

    Raises:
        ConfigError: naming ``field`` when no package registers ``name`` or its import fails.
    """
    found = [ep for ep in entry_points(group=group) if ep.name == name]
    if not found:
        raise ConfigError(f"{field}: unknown {kind} {name!r}: not built in, and no installed package registers it "
                          f"under the entry-point group {group}")
    try:
        return found[0].load()
    except Exception as e:  # whatever the plug-in's import raises, the user needs its name
        raise ConfigError(f"{field}: the plug-in {name!r} ({found[0].value}) does not load: "
                          f"{type(e).__name__}: {e}") from e


def import_object(path: str, field: str) -> Callable[..., Any]:
    """The callable a ``package.module:attr`` import path names (``model.arch: mypackage.nets:mynet``).

    Args:
        path: ``package.module:attr``, ``attr`` possibly dotted.
        field: the config field to name in an error.

    Returns:
        The callable.

    Raises:
        ConfigError: naming ``field`` and what failed: the import, a missing attribute, not callable.
    """
    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # a missing module and a module that raises both stop here
        raise ConfigError(f"{field}: cannot import {module_name} for {path!r}: {type(e).__name__}: {e} "
                          "(put its folder on PYTHONPATH; on a cluster, ship it with the job's runtime_env working_dir or "
                          "py_modules)") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{field}: {module_name} has no attribute {attr!r} (from {path!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{field}: {path!r} is not callable")
    return obj


def plugin_sources(group: str) -> dict[str, str]:
    """What ``fedrod-ray list`` shows of a group's plug-ins.

    Args:
        group: an entry-point group (``fedrod_ray.datasets``, ``fedrod_ray.models``).

    Returns:
        Each entry point's name and the ``module:attr`` it loads, sorted by name.
    """
    return {ep.name: ep.value for ep in sorted(entry_points(group=group), key=lambda ep: ep.name)}
