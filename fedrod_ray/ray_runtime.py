"""The driver of a Ray run: connect (or start local Ray), start the coordinator, print a line per round."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import ray
from ray.exceptions import RayTaskError

from .config import ExperimentConfig
from .coordinator import Coordinator
from .federation import RoundFailedError, format_record
from .storage import RunStorage


def connect(cfg: ExperimentConfig) -> bool:
    """Join ``runtime.address`` (``auto``: the running cluster), or start a local Ray; True if we started it.

    With no address, ``ray.init()`` joins a cluster already running on this machine, else starts one.
    """
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    kwargs = {"include_dashboard": False} if cfg.runtime.address in (None, "local") else {}
    ray.init(address=cfg.runtime.address, log_to_driver=True, **kwargs)
    return True


def run_ray(cfg: ExperimentConfig, storage: RunStorage, resume: bool = False,
            log: Callable[[str], None] = print) -> dict:
    started = connect(cfg)
    coordinator = None
    try:
        t0 = time.perf_counter()
        # The coordinator takes no CPU from the clients: it only averages and evaluates the GM.
        coordinator = Coordinator.options(num_cpus=0, max_restarts=0).remote(cfg.to_dict(), storage.uri, resume)
        info = ray.get(coordinator.info.remote())
        log(f"ray: {info['num_actors']} client actor(s) x {info['clients_per_actor']} client(s), "
            f"{info['max_in_flight']} training(s) at once; ready in {time.perf_counter() - t0:.1f}s")
        for r in range(info["next_round"], cfg.train.rounds):
            try:
                record = ray.get(coordinator.run_round.remote(r))
            except RayTaskError as e:
                if isinstance(e.cause, RoundFailedError):
                    raise e.cause from None
                raise
            log(format_record(record, cfg.train.rounds))
        return ray.get(coordinator.finish.remote())
    finally:
        if coordinator is not None:
            ray.kill(coordinator)
        if started:
            ray.shutdown()
