"""Methods side by side on real MNIST: one in-process run per method, same seed and partition, then a
table of the final G-FL (GM), P-FL (GM) and P-FL (PM).

Method sets (``--table``):
  rules    FedAvg, FedAvg with BSM, and Fed-RoD (linear) under each generic rule (fedavg, fedprox,
           feddyn, scaffold): the method seam's comparison (default: 20 clients, Dir(0.1), 40% per
           round, 5 local epochs, 10 rounds);
  heads    FedAvg, Fed-RoD (linear), Fed-RoD (hyper).
Runs go ``--jobs`` at a time, one torch thread each. Run by hand:

    FEDROD_DATA_DIR=../shared/data python bench/mnist_compare.py --table rules --out runs/compare_rules
    FEDROD_DATA_DIR=../shared/data python bench/mnist_compare.py --table heads --clients 100 --fraction 0.2 --rounds 25
    python bench/mnist_compare.py --table rules --out runs/compare_rules --report-only   # table of finished runs
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from _common import md_table

FEDAVG = ["train.head=none", "train.balanced_loss=ce"]
KEYS = ("gfl_gm", "pfl_gm", "pfl_pm")
TABLES = {
    "rules": {
        "FedAvg": FEDAVG,
        "FedAvg with BSM": ["train.head=none", "train.balanced_loss=bsm"],
        "Fed-RoD (linear), fedavg": ["train.head=linear", "train.generic_rule=fedavg"],
        "Fed-RoD (linear), fedprox": ["train.head=linear", "train.generic_rule=fedprox"],
        "Fed-RoD (linear), feddyn": ["train.head=linear", "train.generic_rule=feddyn"],
        "Fed-RoD (linear), scaffold": ["train.head=linear", "train.generic_rule=scaffold"],
    },
    "heads": {
        "FedAvg": FEDAVG,
        "Fed-RoD (linear)": ["train.head=linear"],
        "Fed-RoD (hyper)": ["train.head=hyper"],
    },
}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_").replace("__", "_")


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def report(out: Path, methods: dict[str, list[str]]) -> str:
    rows = []
    for name in methods:
        recs = records(out / slug(name))
        evaluated = [r for r in recs if "gfl_gm" in r]
        if not evaluated:
            rows.append([name, "-", "-", "-", "-", "-"])
            continue
        last, tail = evaluated[-1], evaluated[-3:]
        per_round = sum(r["train_seconds"] for r in recs) / len(recs)
        rows.append([name, last["round"], *(f"{100 * last[k]:.2f}" for k in KEYS),
                     " / ".join(f"{100 * sum(r[k] for r in tail) / len(tail):.2f}" for k in KEYS),
                     f"{per_round:.1f}"])
    return md_table(["method", "rounds", "G-FL (GM)", "P-FL (GM)", "P-FL (PM)",
                     "mean of the last 3 evaluations (G-FL / P-FL GM / P-FL PM)", "train s/round"], rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", choices=sorted(TABLES), default="rules")
    p.add_argument("--config", default="configs/mnist_paper.yaml")
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--fraction", type=float, default=0.4)
    p.add_argument("--alpha", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2, help="runs at once (one torch thread each)")
    p.add_argument("--out", default=None, help="default runs/compare_<table>")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args()
    methods = TABLES[args.table]
    out = Path(args.out or f"runs/compare_{args.table}")
    if not args.report_only:
        out.mkdir(parents=True, exist_ok=True)
        common = [f"data.num_clients={args.clients}", f"train.client_fraction={args.fraction}",
                  f"data.alpha={args.alpha}", f"train.local_epochs={args.epochs}", f"train.rounds={args.rounds}",
                  f"eval.eval_every={args.eval_every}", f"seed={args.seed}", "runtime.torch_threads=1"]
        queue = list(methods.items())
        running: list[tuple[str, subprocess.Popen, float]] = []
        codes: dict[str, int] = {}
        t0 = time.time()
        while queue or running:
            while queue and len(running) < args.jobs:
                name, sets = queue.pop(0)
                cmd = [sys.executable, "-m", "fedrod_ray.cli", "train", "--config", args.config,
                       "--run-dir", str(out / slug(name))]
                for s in [*common, f"name={slug(name)}", *sets]:
                    cmd += ["--set", s]
                with open(out / f"{slug(name)}.log", "w") as log:  # the child keeps its own descriptor
                    running.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), time.time()))
                print(f"started {name}", flush=True)
            time.sleep(1)
            for item in [r for r in running if r[1].poll() is not None]:
                running.remove(item)
                codes[item[0]] = item[1].returncode
                print(f"finished {item[0]} (exit {item[1].returncode}) in {time.time() - item[2]:.0f}s", flush=True)
        print(f"wall time {time.time() - t0:.0f}s")
        if any(codes.values()):
            print(f"failed: {[n for n, c in codes.items() if c]}; see the .log files in {out}")
            return 1
    print(report(out, methods))
    return 0


if __name__ == "__main__":
    sys.exit(main())
