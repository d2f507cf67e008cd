"""The driver of a Ray run: connect (or start local Ray), start the coordinator, print a line per round."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable

import ray
from ray.exceptions import RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .config import ExperimentConfig
from .coordinator import Coordinator
from .federation import RoundFailedError
from .runner import drive
from .setup import prepare
from .state import Snapshot
from .storage import RunStorage

PROGRESS_POLL_S = 1.0


def connect(cfg: ExperimentConfig) -> bool:
    """Join the cluster of ``runtime.address`` (``auto``: the one running on this machine) or, in a Ray
    job, the job's (``RAY_ADDRESS``); with no address, start a private local Ray. True if we started it.
    """
    if ray.is_initialized():
        return False
    # ray.init replaces the SIGTERM handler with a silent sys.exit; a handler the program installed (the
    # CLI's, which says how to resume) is put back.
    main_thread = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main_thread else None
    try:
        _init(cfg)
    finally:
        if callable(sigterm):
            signal.signal(signal.SIGTERM, sigterm)
    return True


def _init(cfg: ExperimentConfig) -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = cfg.runtime.address
    job = os.environ.get("RAY_ADDRESS", "")
    if address is None and job and not job.startswith(("http://", "https://")):
        ray.init(log_to_driver=True)
    elif address not in (None, "local"):
        ray.init(address=address, log_to_driver=True)
    else:
        # Nothing but this run connects to its private Ray, so it needs no token auth; and a token Ray
        # wrote to ~/.ray would switch auth on for the user's own `ray start` (deploy/README.md).
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", include_dashboard=False, log_to_driver=True)


def run_ray(cfg: ExperimentConfig, storage: RunStorage, snapshot: Snapshot | None = None,
            log: Callable[[str], None] = print,
            progress: Callable[[int, int, int], None] | None = None) -> list[dict]:
    # Prepared here, in the driver, so that a missing dataset fails with the CLI's own message; the
    # coordinator is handed the result.
    setup = prepare(cfg)
    started = connect(cfg)
    coordinator = None
    try:
        t0 = time.perf_counter()
        # The coordinator takes no CPU from the clients: it only averages and evaluates the GM. A second
        # thread answers progress() while step() runs. It lives on this (the driver's) node, so that the
        # run directory it checkpoints into need only be reachable from here, as the metrics are.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        coordinator = Coordinator.options(num_cpus=0, max_restarts=0, max_concurrency=2,
                                          scheduling_strategy=here).remote(setup, snapshot)
        info = ray.get(coordinator.info.remote())
        hosted = "any client" if info["clients_per_actor"] == 0 else f"{info['clients_per_actor']} client(s) each"
        log(f"ray: {info['num_actors']} client actor(s) ({hosted}), {info['max_in_flight']} training(s) at once; "
            f"ready in {time.perf_counter() - t0:.1f}s")

        def step(r: int) -> dict:
            ref = coordinator.step.remote(r)
            while progress is not None and not ray.wait([ref], timeout=PROGRESS_POLL_S)[0]:
                current = ray.get(coordinator.progress.remote())
                if current[0] == r + 1:  # not the previous round's last figures
                    progress(*current)
            try:
                return ray.get(ref)
            except RayTaskError as e:
                if isinstance(e.cause, RoundFailedError):
                    raise e.cause from None
                raise

        return drive(step, lambda: ray.get(coordinator.save_checkpoint.remote(storage.uri)),
                     lambda: ray.get(coordinator.wait_checkpoint.remote()),
                     lambda m: ray.get(coordinator.save_final.remote(storage.uri, m)),
                     cfg, storage, info["next_round"], info["rounds"], log)
    finally:
        if coordinator is not None:
            with contextlib.suppress(RayError):
                ray.get(coordinator.close.remote())
            ray.kill(coordinator)
        if started:
            ray.shutdown()
