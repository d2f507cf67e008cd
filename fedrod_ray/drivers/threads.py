"""How many threads torch uses in an in-process run (``runtime.torch_threads``), and how they wait.

Torch's own default, a thread per core whose idle threads spin, makes an in-process run many times slower
on a machine that other work keeps busy: its threads spin for cores they do not get. ``auto`` (``null``,
the default) reads the 1-minute load average when the run starts. Idle, it keeps torch's default. Busy, a
thread per core that sleeps when it waits (OpenMP's passive wait policy), when the command line could set
the policy before torch loaded (``passive_if_busy``), else the cores the load leaves free. The candidates'
measurements are in docs/benchmarks.md (``bench/threads.py``).
"""

from __future__ import annotations

import math
import os
import sys

WAIT_POLICY = "OMP_WAIT_POLICY"
_set_here: list[bool] = []  # whether passive_if_busy set the passive policy in this process


def free_cores(cores: int, load: float) -> int:
    """The cores a 1-minute load average of ``load`` leaves free, to the nearest, at least one."""
    return max(1, min(cores, math.floor(cores - load + 0.5)))


def usable_cores() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def passive_if_busy() -> None:
    """On a busy machine, OpenMP's passive wait policy for torch's threads: set in the environment before
    torch is imported (OpenMP reads it when torch loads), unless the user set a policy. The command line
    calls it first thing."""
    if "torch" in sys.modules or WAIT_POLICY in os.environ:
        return
    if free_cores(usable_cores(), os.getloadavg()[0]) < usable_cores():
        os.environ[WAIT_POLICY] = "PASSIVE"
        _set_here.append(True)


def choose_threads(configured: int | None) -> tuple[int | None, str]:
    """The thread count for ``runtime.torch_threads`` = ``configured`` (None: torch's default, kept) and the
    console's reason for it."""
    if configured == 0:
        return None, "runtime.torch_threads: 0, torch's default"
    if configured is not None:
        return configured, "runtime.torch_threads"
    cores, load = usable_cores(), os.getloadavg()[0]
    why = f"auto: {cores} cores, load average {load:.2f}"
    if _set_here:
        return cores, f"{why}: a thread per core, sleeping when it waits ({WAIT_POLICY}=PASSIVE)"
    if free_cores(cores, load) == cores:
        return cores, f"{why}: a thread per core"
    return free_cores(cores, load), f"{why}: the cores it leaves free"
