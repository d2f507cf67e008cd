"""The in-process driver (``runtime.mode: local``): a ``run.Run`` of a federation whose clients train in
this process, a line printed per round."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..config import ExperimentConfig
from ..executors.runtimes import runtime_of
from ..federation_state.state import Snapshot
from ..lifecycle.run import Run
from ..outputs.storage import RunStorage
from ..round_loop.federation import Federation
from .console import format_model, format_record
from .threads import choose_threads


def run_local(cfg: ExperimentConfig, storage: RunStorage, snapshot: Snapshot | None = None,
              log: Callable[[str], None] = print,
              progress: Callable[[int, int, int], None] | None = None) -> list[dict]:
    """Train in this process, the clients one after another or, with ``runtime.batched_clients``, several
    at once in one batched pass; returns every round's record (earlier runs' too, when resumed).

    Args:
        snapshot: a checkpoint to resume from.
        log: prints a line (each round's, and the federation's own).
        progress: ``progress(round, clients finished, clients sampled)``, called as each client finishes.
    """
    threads, why = choose_threads(cfg.runtime.torch_threads)
    if threads is not None:
        torch.set_num_threads(threads)
    log(f"torch threads: {torch.get_num_threads()} ({why})")
    runtime = runtime_of(cfg, on_ray=False)
    setup = runtime.prepare(cfg)
    if (line := format_model(cfg.model.arch, setup.dataset.image_shape)) is not None:
        log(line)
    setup, executor = runtime.start(setup)
    run = Run(Federation(setup, executor, log, progress), storage, snapshot)
    return run.train(lambda record: log(format_record(record, run.rounds)))
