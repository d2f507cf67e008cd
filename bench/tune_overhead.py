"""Tune's overhead: a sweep of N identical trials against the same N federations trained one after
another with ``fedrod-ray train --mode ray``, in one run.

Each federation: ``configs/synthetic_tiny.yaml`` with ``--rounds`` rounds, one client slot (1 CPU). The
sweep runs them as N grid points of one value (``train.lr: {grid: [0.01] * N}``), without a scheduler,
``--cores`` trials at once at most (one coordinator bundle + one client slot each). The baseline runs
the N trainings back to back, each a fresh ``fedrod-ray train`` subprocess with a local Ray of the same
cores, evaluated every round like a trial. Printed: wall seconds of both, their ratio, and the seconds
from the ``fedrod-ray tune`` command to the first trial's first report.

    python bench/tune_overhead.py               # N = 6, 5 rounds (~3 minutes on 2 cores)
    python bench/tune_overhead.py --trials 4 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from _common import machine_note, md_table

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=6)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    print(machine_note())
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    work = Path(tempfile.mkdtemp(prefix="fedrod-tune-bench-"))
    base = str(REPO / "configs" / "synthetic_tiny.yaml")

    t0 = time.perf_counter()
    for i in range(args.trials):
        subprocess.run([sys.executable, "-m", "fedrod_ray.cli", "train", "--config", base, "--mode", "ray",
                        "--run-dir", str(work / f"train_{i}"), "--set", f"train.rounds={args.rounds}",
                        "--set", "eval.eval_every=1", "--set", "runtime.torch_threads=1"],
                       check=True, env=env, cwd=REPO, capture_output=True)
    sequential = time.perf_counter() - t0

    sweep = work / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({
        "name": "overhead", "base": base, "set": {"train.rounds": args.rounds, "runtime.torch_threads": 1},
        "search": {"train.lr": {"grid": [0.01] * args.trials}}, "scheduler": "none"}))
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "fedrod_ray.cli", "tune", "--config", str(sweep),
                             "--sweep-dir", str(work / "sweep")], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = None
    while proc.poll() is None:
        if first is None and any(p.stat().st_size for p in (work / "sweep").glob("trials/*/result.json")):
            first = time.perf_counter() - t0
        time.sleep(0.05)
    swept = time.perf_counter() - t0
    assert proc.returncode == 0, "the sweep failed"
    reports = sum(len(p.read_text().splitlines()) for p in (work / "sweep").glob("trials/*/result.json"))
    assert reports == args.trials * args.rounds, reports
    print(json.dumps({"sequential_s": sequential, "sweep_s": swept, "first_report_s": first}))
    print(f"\n{args.trials} federations of {args.rounds} rounds (synthetic_tiny, 1 client slot each):\n")
    print(md_table("run|seconds", [
        ["`fedrod-ray train --mode ray`, one after another", f"{sequential:.1f}"],
        ["`fedrod-ray tune`, the same as trials", f"{swept:.1f}"],
        ["ratio tune / sequential", f"**{swept / sequential:.2f}**"],
        ["command to the first trial's first report", f"{first:.1f}" if first else "-"],
    ]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
