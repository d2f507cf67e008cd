"""The one place that maps a config to its runtime: where its clients live, what the server holds before the
first round, and how the executor is started.

``runtime_of(cfg)`` is what the CLI, the coordinator and the drivers ask; an engine outside the library (Flower's
ServerApp, ``fedrod_ray_flower``) registers its own runtime with ``register`` and asks for it by name. A new
runtime is an ``Executor`` (``executors.base``) and one ``Runtime`` here (docs/extending.md, "Add a runtime").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..config import ExperimentConfig
from ..federation_state.setup import Setup, make_host, prepare, prepare_server
from .base import Executor


@dataclass(frozen=True)
class Runtime:
    """A runtime: ``on_ray``, its federation lives in a coordinator actor on a Ray cluster (``fedrod-ray train``
    then runs the Ray driver); ``prepare``, what the server holds before the first round (at sites: its test set
    only); ``start(setup, **env)``, the federation's whole setup and the executor, given what the driver
    provides (``env``: the Ray runtime's arrays in the object store, Flower's grid)."""

    name: str
    on_ray: bool
    prepare: Callable[[ExperimentConfig], Setup]
    start: Callable[..., tuple[Setup, Executor]]


def _in_process(setup: Setup, **env) -> tuple[Setup, Executor]:
    from .batched import BatchedExecutor
    from .in_process import InProcessExecutor

    host, batched = make_host(setup, setup.cfg.runtime.device), setup.cfg.runtime.batched_clients
    return setup, BatchedExecutor(host, batched) if batched else InProcessExecutor(host)


def _ray(setup: Setup, shared=None, **env) -> tuple[Setup, Executor]:
    import ray

    from .ray import RayExecutor, plan_layout

    layout = plan_layout(setup.cfg.runtime, len(setup.all_client_ids), ray.cluster_resources())
    return setup, RayExecutor(setup, layout, shared=shared)


def _sites(setup: Setup, log: Callable[[str], None] = print, **env) -> tuple[Setup, Executor]:
    from .sites import SitesExecutor

    executor = SitesExecutor(setup, log=log)  # the sites' actors report their clients: the whole setup
    return executor.setup, executor


RUNTIMES: dict[str, Runtime] = {
    "in_process": Runtime("in_process", False, prepare, _in_process),
    "ray": Runtime("ray", True, prepare, _ray),
    "sites": Runtime("sites", True, prepare_server, _sites),
}


def register(runtime: Runtime) -> None:
    """Add a runtime that an engine outside the library provides (Flower's); a name is registered once."""
    if RUNTIMES.get(runtime.name, runtime) is not runtime:
        raise ValueError(f"a runtime named {runtime.name!r} is registered already")
    RUNTIMES[runtime.name] = runtime


def runtime_of(cfg: ExperimentConfig, on_ray: bool | None = None) -> Runtime:
    """The runtime ``cfg`` runs on: at its sites (``data.dataset: sites``), on Ray actors (``runtime.mode:
    ray``), else in this process (one client at a time, or ``runtime.batched_clients`` at once). ``on_ray``:
    where a driver that has already chosen hosts the federation (the Ray driver and its coordinator: True; the
    in-process driver: False), whatever ``runtime.mode`` says."""
    if cfg.sites:
        return RUNTIMES["sites"]
    return RUNTIMES["ray" if (cfg.runtime.mode == "ray" if on_ray is None else on_ray) else "in_process"]
