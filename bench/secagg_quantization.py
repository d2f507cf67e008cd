"""What SecAgg+'s quantization costs on Flower's deployment engine (docs/flower.md, "Quantization cost").

A SuperLink and three SuperNodes on loopback (tests/flower_federation.py), MNIST's 60 clients split three ways,
Fed-RoD (hyper), 3 a round: the in-process run once, then the same run on Flower with SecAgg+ at each
quantization range T (clipping range c): the largest difference of any final weight from the in-process run's,
and the final accuracies of both. Needs ``fedrod-ray[flower]``; a few minutes a run on a loaded 2-core machine.

    FEDROD_DATA_DIR=../shared/data python bench/secagg_quantization.py --rounds 3 --levels 4096 65536 4194304
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fedrod_ray_flower.split import split
from flower_federation import FlowerFederation

from fedrod_ray.config import load_config
from fedrod_ray.data import resolve_data_dir
from fedrod_ray.drivers.runner import run_local
from fedrod_ray.outputs.storage import RunStorage

METRICS = ("gfl_gm", "pfl_pm")


def write_config(folder: Path, rounds: int) -> Path:
    cfg = {"name": "secagg", "seed": 0,
           "data": {"dataset": "mnist", "data_dir": str(resolve_data_dir(None)), "num_clients": 60,
                    "partition": "dirichlet", "alpha": 0.3},
           "train": {"rounds": rounds, "client_fraction": 0.05, "local_epochs": 1, "batch_size": 50, "lr": 0.01,
                     "head": "hyper"},
           "eval": {"eval_every": rounds},
           "runtime": {"torch_threads": 1}}
    path = folder / "secagg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def last_record(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


def max_difference(a_dir: Path, b_dir: Path) -> float:
    a = load_file(str(a_dir / "final" / "model.safetensors"))
    b = load_file(str(b_dir / "final" / "model.safetensors"))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clipping", type=float, default=8.0, help="secagg-clipping-range c")
    p.add_argument("--levels", type=int, nargs="+", default=[2**12, 2**16, 2**22], help="secagg-quantization-range T")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="secagg-bench-"))
    config = write_config(root, args.rounds)
    plain = root / "in-process"
    run_local(load_config(config), RunStorage(str(plain)), log=lambda line: None)
    want = last_record(plain)
    fed = FlowerFederation(root / "flower", split(str(config), root / "nodes", 3))
    rows = []
    try:
        for levels in args.levels:
            run_dir = root / f"secagg-{levels}"
            t0 = time.perf_counter()
            fed.run(config, run_dir, timeout=3600, extra=(
                f"secure-aggregation=true secagg-num-shares=3 secagg-reconstruction-threshold=2 "
                f"secagg-clipping-range={args.clipping} secagg-quantization-range={levels}"))
            got = last_record(run_dir)
            rows.append((levels, 2 * args.clipping / levels, max_difference(run_dir, plain),
                         *(f"{got[m]:.4f} / {want[m]:.4f}" for m in METRICS), time.perf_counter() - t0))
    finally:
        fed.close()
    print(f"Fed-RoD (hyper), MNIST 60 clients over 3 SuperNodes, 3 a round, {args.rounds} rounds, c = {args.clipping:g}")
    print("| T | quantum 2c/T | max abs weight difference | " + " | ".join(f"{m} SecAgg+ / in-process" for m in METRICS)
          + " | run s |")
    print("|---|---|---|" + "---|" * len(METRICS) + "---|")
    for levels, quantum, diff, *metrics, seconds in rows:
        print(f"| 2^{levels.bit_length() - 1} | {quantum:.2e} | {diff:.2e} | " + " | ".join(metrics) + f" | {seconds:.0f} |")


if __name__ == "__main__":
    main()
