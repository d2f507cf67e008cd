"""The driver of a Ray run: connect (or start local Ray), start the coordinator actor, which holds the run
(and start it again from the last checkpoint if it dies), and print a line per round."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..clients import faults
from ..config import ExperimentConfig
from ..executors.runtimes import runtime_of
from ..executors.shared_setup import share
from ..federation_state.checkpoint import latest_checkpoint_name, load_checkpoint
from ..federation_state.state import Snapshot
from ..lifecycle.coordinator import STARTUP_ERRORS, Coordinator
from ..lifecycle.run import RunLostError
from ..outputs.results import read_records
from ..outputs.storage import RunStorage
from ..round_loop.federation import RoundFailedError
from .console import format_model, format_record

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


def release_freed_memory() -> None:
    """Give the pages of what this process freed back to the system: glibc keeps large freed blocks in its heap
    (its mmap threshold rises with the first large free), so the dropped setup would stay in the driver's
    memory for the run's lifetime. Nothing where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.malloc_trim(0)


# size: the driver's one lifecycle (start, follow, restart a dead coordinator, stop) reads best in one place
def run_ray(cfg: ExperimentConfig, storage: RunStorage, snapshot: Snapshot | None = None,
            log: Callable[[str], None] = print,
            progress: Callable[[int, int, int], None] | None = None) -> list[dict]:
    """Train on Ray: the run lives in the coordinator actor, which writes the run directory; this driver
    prints its rounds. A coordinator that dies mid-run (killed, its process lost) is started again from the
    run's last checkpoint, up to ``runtime.coordinator_restarts`` times; then ``RunLostError``. Arguments and
    result as ``runner.run_local``'s."""
    # Prepared here, in the driver, so that a missing dataset fails with the CLI's own message. Its arrays go
    # into the object store, and the coordinator is handed their references: this driver keeps no copy.
    # At sites, the server's test set only: the sites report their clients to the coordinator.
    setup = runtime_of(cfg, on_ray=True).prepare(cfg)
    if (line := format_model(cfg.model.arch, setup.dataset.image_shape)) is not None:
        log(line)
    started = connect(cfg)
    coordinator = None
    try:
        t0 = time.perf_counter()
        shared = share(setup)
        del setup
        release_freed_memory()
        # The coordinator takes no CPU from the clients: it only averages and evaluates the GM. A second
        # thread answers the driver while the run trains. It lives on this (the driver's) node, so that the
        # run directory it writes need only be reachable from here. Its name (`ray list actors`) says which
        # run it holds; its own part keeps it from the name of the last one, which Ray frees in its own time.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        restart, rounds = None, cfg.train.rounds
        printed = [0]  # the last round whose line is out
        while True:
            name = f"fedrod-ray coordinator {uuid.uuid4().hex[:8]} of {storage.uri}"
            coordinator = Coordinator.options(
                name=name, num_cpus=0, max_restarts=0, max_concurrency=2, scheduling_strategy=here,
                runtime_env=faults.runtime_env()).remote(shared, storage.uri, snapshot, restart)
            try:
                info = ray.get(coordinator.info.remote())
                rounds = info["rounds"]
                if restart is None:
                    hosted = ("any client" if info["clients_per_actor"] == 0
                              else f"{info['clients_per_actor']} client(s) each")
                    log(f"ray: {info['num_actors']} client actor(s) ({hosted}), {info['max_in_flight']} "
                        f"training(s) at once; ready in {time.perf_counter() - t0:.1f}s")
                return follow(coordinator, info, log, progress, printed)
            except RayTaskError as e:  # the run could not start, and says why (the sites' data or stores)
                if isinstance(e.cause, STARTUP_ERRORS):
                    raise e.cause from None
                raise
            except RayActorError as e:
                # An error in the coordinator's setup is not a death.
                if e.actor_init_failed:
                    raise
                died = e
            ray.kill(coordinator)
            restarts = restart[0] if restart else 0
            recorded = read_records(storage)  # the rounds it finished: it died in the next (or in final/)
            died_in = min((recorded[-1]["round"] if recorded else 0) + 1, rounds)
            if restarts == cfg.runtime.coordinator_restarts:
                raise RunLostError(f"the coordinator actor died in round {died_in} " + (
                    f"after {restarts} restart(s) (runtime.coordinator_restarts)" if restarts
                    else "(runtime.coordinator_restarts is 0)")) from died
            if latest_checkpoint_name(storage) is not None:
                snapshot = load_checkpoint(storage)
            # The rounds the dead coordinator finished and saved but whose lines it had not sent yet: the new one
            # starts after them.
            for record in recorded:
                if printed[0] < record["round"] <= (snapshot.rounds_done if snapshot is not None else 0):
                    log(format_record(record, rounds))
                    printed[0] = record["round"]
            restart = (restarts + 1, died_in)
            log(f"ray: the coordinator actor died in round {died_in}; "
                f"{restarted(snapshot, *restart, cfg.runtime.coordinator_restarts)}")
    finally:
        if coordinator is not None:
            with contextlib.suppress(RayError):
                ray.get(coordinator.close.remote())
            ray.kill(coordinator)
        if started:
            ray.shutdown()


def restarted(snapshot: Snapshot | None, number: int, died_in: int, limit: int) -> str:
    """The console's word on the ``number``-th coordinator started again, from ``snapshot``, after the last
    died in round ``died_in``: from where, and which rounds it trains again."""
    done = snapshot.rounds_done if snapshot is not None else 0
    again = ("no round is trained again" if died_in <= done else f"round {died_in} is trained again"
             if died_in == done + 1 else f"rounds {done + 1}-{died_in} are trained again")
    start = f"the checkpoint after round {done}" if snapshot is not None else "the start"
    return f"started again from {start} (restart {number} of {limit}, runtime.coordinator_restarts): {again}"


def follow(coordinator, info: dict, log: Callable[[str], None],
           progress: Callable[[int, int, int], None] | None, printed: list[int] | None = None) -> list[dict]:
    """Start the coordinator's run and follow it to its end: each round's line as its record comes, and the
    progress of the round in hand, asked for every ``PROGRESS_POLL_S`` seconds. Returns every record.
    Stopped here (Ctrl-C, SIGTERM), it has the coordinator commit the save in flight first. ``printed[0]`` is
    kept at the last round whose line is out."""
    done = coordinator.train.remote()
    shown = info["records"]
    in_hand = info["next_round"] + 1

    def print_new_records() -> None:
        nonlocal shown, in_hand
        for record in ray.get(coordinator.records.remote(shown)):
            log(format_record(record, info["rounds"]))
            shown, in_hand = shown + 1, record["round"] + 1
            if printed is not None:
                printed[0] = record["round"]

    try:
        while not ray.wait([done], timeout=PROGRESS_POLL_S)[0]:
            print_new_records()
            if progress is not None:
                current = ray.get(coordinator.progress.remote())
                if current[0] == in_hand:  # not the figures of a round whose line is still to come
                    progress(*current)
        print_new_records()
        return ray.get(done)
    except RayTaskError as e:
        print_new_records()
        if isinstance(e.cause, RoundFailedError):
            raise e.cause from None
        raise
    except BaseException:
        with contextlib.suppress(RayError):
            ray.get(coordinator.stop.remote())
        raise
