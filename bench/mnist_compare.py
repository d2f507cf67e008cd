"""Fed-RoD (linear, hyper) vs FedAvg on MNIST, Dir(0.1), 100 clients, 20% per round, 5 local epochs.

Runs the three methods with the same seed as parallel in-process runs (one torch thread each), then
prints a table of the final G-FL (GM), P-FL (GM) and P-FL (PM). Run by hand:

    FEDROD_DATA_DIR=../shared/data python bench/mnist_compare.py --rounds 25 --out runs/mnist_compare
    python bench/mnist_compare.py --report-only --out runs/mnist_compare   # table of finished runs
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

METHODS = {
    "fedavg": ["train.algorithm=fedavg"],
    "fedrod_linear": ["train.algorithm=fedrod", "train.variant=linear"],
    "fedrod_hyper": ["train.algorithm=fedrod", "train.variant=hyper"],
}


def last_evaluated(run_dir: Path) -> dict | None:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    evaluated = [r for r in records if "gfl_gm" in r]
    return evaluated[-1] if evaluated else None


def report(out: Path) -> str:
    rows = ["| method | rounds | G-FL (GM) | P-FL (GM) | P-FL (PM) | train s/round |", "|---|---:|---:|---:|---:|---:|"]
    for name in METHODS:
        rec = last_evaluated(out / name)
        if rec is None:
            rows.append(f"| {name} | - | - | - | - | - |")
            continue
        records = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines() if line]
        per_round = sum(r["train_seconds"] for r in records) / len(records)
        rows.append(f"| {name} | {rec['round'] + 1} | {100 * rec['gfl_gm']:.2f} | {100 * rec['pfl_gm']:.2f} | "
                    f"{100 * rec['pfl_pm']:.2f} | {per_round:.1f} |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/mnist_compare")
    p.add_argument("--config", default="configs/mnist_paper.yaml")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args()
    out = Path(args.out)
    if not args.report_only:
        procs = []
        t0 = time.time()
        for name, sets in METHODS.items():
            run_dir = out / name
            cmd = [sys.executable, "-m", "fedrod_ray.cli", "train", "--config", args.config, "--run-dir", str(run_dir),
                   "--set", f"train.rounds={args.rounds}", "--set", f"eval.eval_every={args.eval_every}",
                   "--set", f"seed={args.seed}", "--set", "runtime.torch_threads=1", "--set", f"name={name}"]
            for s in sets:
                cmd += ["--set", s]
            out.mkdir(parents=True, exist_ok=True)
            with open(out / f"{name}.log", "w") as log:  # the child keeps its own copy of the descriptor
                procs.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)))
        codes = {name: proc.wait() for name, proc in procs}
        print(f"wall time {time.time() - t0:.0f}s, exit codes {codes}")
        if any(codes.values()):
            return 1
    print(report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
