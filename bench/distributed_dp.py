"""Distributed against central DP at equal epsilon on Flower (docs/privacy.md, "Distributed DP").

For each head and target epsilon: central DP in process (the server adds the noise), and distributed DP
(``privacy.mechanism: distributed_dgauss``: each SuperNode adds its share before SecAgg+ masks it) on a SuperLink
and ``--nodes`` SuperNodes on loopback (tests/flower_federation.py), at ``--bits`` per coordinate; and SecAgg+
without DP, for the cost of a round. Prints the noise multiplier each mechanism needs for the target, the final
G-FL and P-FL (PM), the epsilon spent, and the median seconds of a round. Needs ``fedrod-ray[flower]``.

The table of docs/privacy.md (Fashion-MNIST, 1,000 clients, Dir(0.3), q = 0.1, 100 rounds; hours per row):

    FEDROD_DATA_DIR=/path/to/data python bench/distributed_dp.py --epsilons 8 4 1 --bits 16 --rounds 100

A short version (60 clients, a few rounds) runs in minutes: --clients 60 --rounds 3 --epsilons 8.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fedrod_ray_flower.split import split
from flower_federation import FlowerFederation

from fedrod_ray.config import load_config
from fedrod_ray.data import resolve_data_dir
from fedrod_ray.drivers.runner import run_local
from fedrod_ray.outputs.storage import RunStorage

ROOT = Path(__file__).resolve().parents[1]
METRICS = ("gfl_gm", "pfl_pm")


def write_config(folder: Path, name: str, head: str, args, privacy: dict | None) -> Path:
    """configs/fmnist_dp.yaml for ``head`` (``--clients``, ``--rounds``), evaluated at the end only, with
    ``privacy`` (None: without DP)."""
    cfg = yaml.safe_load((ROOT / "configs" / "fmnist_dp.yaml").read_text())
    cfg["name"], cfg["data"]["data_dir"] = name, str(resolve_data_dir(None))
    cfg["data"]["num_clients"] = args.clients
    cfg["train"].update(head=head, rounds=args.rounds)
    # P-FL over a seeded sample of 100 clients where there are more (as the config does), else over all.
    cfg["eval"] = {"eval_every": args.rounds, **({"clients": 100} if args.clients > 100 else {})}
    cfg["runtime"] = {"torch_threads": 1}
    if privacy is not None:
        cfg["privacy"] = {"enabled": True, "clip_norm": args.clip, "sampling": "poisson", **privacy}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def summary(run_dir: Path) -> dict:
    """The last record's metrics, epsilon and the median seconds of the run's rounds."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    meta = json.loads((run_dir / "final" / "meta.json").read_text())
    last = records[-1]
    return {**{m: last.get(m) for m in METRICS}, "epsilon": last.get("dp_epsilon"),
            "noise_multiplier": (meta.get("privacy") or {}).get("noise_multiplier"),
            "seconds": statistics.median(r["seconds"] for r in records if "seconds" in r)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", nargs="+", default=["none", "hyper"])
    p.add_argument("--epsilons", type=float, nargs="+", default=[8.0, 4.0, 1.0])
    p.add_argument("--bits", type=int, default=16)
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--clip", type=float, default=0.5)
    p.add_argument("--nodes", type=int, default=3)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ddg-bench-"))
    # SecAgg+ completes with its reconstruction threshold of nodes (below its shares): the least noise in a sum.
    secagg = (f"secure-aggregation=true secagg-num-shares={args.nodes} secagg-reconstruction-threshold="
              f"{args.nodes - 1} secagg-clipping-range=8.0 secagg-quantization-range=1048576")
    distributed = {"mechanism": "distributed_dgauss", "bits": args.bits, "min_participants": args.nodes - 1,
                   "max_participants": args.nodes}
    rows = []
    for head in args.heads:
        plain = write_config(root, f"{head}-secagg", head, args, None)
        fed = FlowerFederation(root / f"flower-{head}", split(str(plain), root / f"nodes-{head}", args.nodes))
        try:
            fed.run(plain, root / f"{head}-secagg", timeout=36000, extra=secagg)
            rows.append((head, "SecAgg+, no DP", "-", "-", summary(root / f"{head}-secagg")))
            for eps in args.epsilons:
                central = write_config(root, f"{head}-central-{eps:g}", head, args, {"target_epsilon": eps})
                run_local(load_config(central), RunStorage(str(root / central.stem)), log=lambda line: None)
                rows.append((head, "central", eps, 32, summary(root / central.stem)))
                ddg = write_config(root, f"{head}-ddg-{eps:g}", head, args, {"target_epsilon": eps, **distributed})
                fed.run(ddg, root / ddg.stem, timeout=36000, extra=secagg)
                rows.append((head, "distributed", eps, args.bits, summary(root / ddg.stem)))
        finally:
            fed.close()
    print(f"FMNIST, {args.clients} clients, Dir(0.3), q = 0.1, {args.rounds} rounds, S = {args.clip:g}, "
          f"{args.nodes} SuperNodes (n_min = {args.nodes - 1}); runs in {root}")
    print("| head | mechanism | target ε | bits | z | ε spent | G-FL | P-FL (PM) | s / round |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for head, mech, eps, bits, s in rows:
        z = f"{s['noise_multiplier']:.3f}" if s["noise_multiplier"] is not None else "-"
        spent = f"{s['epsilon']:.3f}" if s["epsilon"] is not None else "-"
        print(f"| {head} | {mech} | {eps} | {bits} | {z} | {spent} | {s['gfl_gm']:.4f} | {s['pfl_pm']:.4f} | "
              f"{s['seconds']:.1f} |")


if __name__ == "__main__":
    main()
