"""The README's main job, whole, on an idle and a loaded machine: ``fedrod-ray train --config
configs/quickstart.yaml`` from the command's start to its end, with the machine as found and beside busy-loop
processes that this script starts itself.

This is the figure the "one-minute" quickstart promises: on a busy 2-core machine its time should stay within
2x its idle time (the runtime's automatic torch threads, ``fedrod_ray.drivers.threads``, are what keep it so;
``bench/threads.py`` compares the candidates round by round). Conditions are interleaved over ``--reps``
passes so that drift in other work on the machine falls on all of them; each loaded time is divided by the
as-found time of the same pass.

    FEDROD_DATA_DIR=../shared/data python bench/quickstart.py                  # 2 passes, 2 and 4 busy loops
    FEDROD_DATA_DIR=../shared/data python bench/quickstart.py --reps 1 --load 4
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from _common import machine_note, md_table
from threads import start_load, stop_load

REPO = Path(__file__).resolve().parents[1]
THREADS_LINE = re.compile(r"torch threads: .*")


def run_quickstart(extra: list[str]) -> tuple[float, str]:
    """Seconds the README's main job takes as a fresh command, and the line saying which threads it chose."""
    run_dir = tempfile.mkdtemp(prefix="quickstart-bench-")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    try:
        started = time.perf_counter()
        out = subprocess.run([shutil.which("fedrod-ray") or "fedrod-ray", "train", "--config",
                              "configs/quickstart.yaml", "--run-dir", run_dir, *extra],
                             cwd=REPO, env=env, capture_output=True, text=True, check=True)
        seconds = time.perf_counter() - started
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    threads = THREADS_LINE.search(out.stdout + out.stderr)
    return seconds, threads.group(0) if threads else "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=2, help="passes over every condition")
    p.add_argument("--load", type=int, nargs="+", default=[2, 4], help="busy-loop processes of the loaded conditions")
    p.add_argument("--set", nargs="*", default=[], dest="overrides", metavar="KEY=VALUE",
                   help="config overrides passed to the job (e.g. runtime.torch_threads=1)")
    args = p.parse_args()
    extra = [x for kv in args.overrides for x in ("--set", kv)]
    print(machine_note(), flush=True)
    conditions = [0] + args.load
    times: dict[int, list[float]] = {c: [] for c in conditions}
    chosen: dict[int, set[str]] = {c: set() for c in conditions}
    ratios: dict[int, list[float]] = {c: [] for c in args.load}
    for rep in range(args.reps):
        for busy in conditions:
            procs = start_load(busy)
            try:
                seconds, threads = run_quickstart(extra)
            finally:
                stop_load(procs)
            times[busy].append(seconds)
            chosen[busy].add(threads)
            print(f"pass {rep + 1}, {busy} busy loops: {seconds:.1f} s ({threads})", flush=True)
        for busy in args.load:
            ratios[busy].append(times[busy][-1] / times[0][-1])
    print(f"\n{args.reps} passes; the whole command's wall time (median over passes), x idle: median of the ratios "
          f"to the as-found time of the same pass\n")
    rows = []
    for busy in conditions:
        t = sorted(times[busy])[(len(times[busy]) - 1) // 2]
        r = "1.00" if busy == 0 else f"{sorted(ratios[busy])[(len(ratios[busy]) - 1) // 2]:.2f}"
        rows.append(["as found" if busy == 0 else f"+{busy} busy loops", f"{t:.1f} s", r, "; ".join(sorted(chosen[busy]))])
    print(md_table(["condition", "quickstart", "x as found", "threads chosen"], rows))


if __name__ == "__main__":
    main()
