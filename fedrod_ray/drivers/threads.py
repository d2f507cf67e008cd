"""How many threads torch uses in an in-process run (``runtime.torch_threads``).

Torch's own default, a thread per core, makes an in-process run many times slower on a machine that other
work keeps busy: its threads wait, spinning, for cores they do not get. ``auto`` (``null``, the default)
takes the cores the load average leaves free when the run starts, at least one (measured against one
thread, torch's default and a passive OpenMP wait policy in docs/benchmarks.md, ``bench/threads.py``).
"""

from __future__ import annotations

import math
import os


def free_cores(cores: int, load: float) -> int:
    """The cores a 1-minute load average of ``load`` leaves free, to the nearest, at least one."""
    return max(1, min(cores, math.floor(cores - load + 0.5)))


def usable_cores() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def choose_threads(configured: int | None) -> tuple[int | None, str]:
    """The thread count for ``runtime.torch_threads`` = ``configured`` and the console's reason for it; None
    for 0, which leaves torch's default."""
    if configured is None:
        cores, load = usable_cores(), os.getloadavg()[0]
        return free_cores(cores, load), f"auto: {cores} cores, load average {load:.2f}"
    if configured == 0:
        return None, "runtime.torch_threads: 0, torch's default"
    return configured, "runtime.torch_threads"
