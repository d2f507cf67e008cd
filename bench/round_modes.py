"""Virtual and real time to a G-FL target under the three round modes (``rounds.mode``, docs/rounds.md).

For FedAvg (``train.head: none``, ``balanced_loss: ce``) and Fed-RoD (``train.head: hyper``, BSM) on FMNIST,
``--clients`` clients on a Dir(``--alpha``) split, each mode runs in process until the generic model's
accuracy (``gfl_gm``) reaches ``--target``:

- sync: ``--fraction`` of the clients a round, the round lasting as long as its slowest;
- deadline: over-selects by ``--over-selection`` and keeps the clients within ``--deadline`` virtual
  seconds (default: the median client's duration);
- fedbuff: ``--concurrency`` clients in flight (default: sync's per round), a server step every
  ``--buffer-size`` arrivals, staleness 1/sqrt(1+s); it gets as many client updates as sync's ``--rounds``.

The clients' speeds are the default heavy-tailed log-normal (median 100 examples/s, sigma 1), the same in
every mode (the seed's). G-FL is evaluated every ``--eval-every`` rounds (FedBuff: server steps scaled to
the same number of updates), P-FL on a sample of 10 clients only, to keep the evaluation cheap. Prints a
Markdown table: the virtual and real seconds at the first evaluation at or above the target ("-" when not
reached), the rounds (server steps) and client updates it took, and the best G-FL. Each evaluation prints a
progress line; with ``--rows FILE`` each finished run is appended to FILE (JSON lines) and a run FILE already
holds is not run again, so a killed benchmark continues where it stopped.

    FEDROD_DATA_DIR=../shared/data python bench/round_modes.py --rows rows.jsonl   # 1,000 clients Dir(0.3)
    FEDROD_DATA_DIR=../shared/data python bench/round_modes.py --clients 100 --rounds 12 --target 0.6
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from _common import machine_note, md_table

from fedrod_ray.config import config_from_dict
from fedrod_ray.executors.in_process import InProcessExecutor
from fedrod_ray.federation_state.setup import make_host, prepare
from fedrod_ray.round_loop.federation import Federation
from fedrod_ray.server_math.server import clients_per_round

METHODS = {"FedAvg": {"head": "none", "balanced_loss": "ce"}, "Fed-RoD": {"head": "hyper"}}


def run(args, method: str, mode: str, deadline: float | None) -> list:
    per_round = clients_per_round(args.clients, args.fraction)
    steps_per_round = math.ceil(per_round / args.buffer_size) if mode == "fedbuff" else 1
    rounds = {"mode": mode}
    if mode == "deadline":
        rounds |= {"deadline": deadline, "over_selection": args.over_selection}
    if mode == "fedbuff":
        rounds |= {"buffer_size": args.buffer_size, "concurrency": args.concurrency or per_round}
    cfg = config_from_dict({
        "name": f"{method}-{mode}", "seed": args.seed,
        "data": {"dataset": "fmnist", "num_clients": args.clients, "alpha": args.alpha, "download": False},
        "train": {**METHODS[method], "rounds": args.rounds * steps_per_round, "client_fraction": args.fraction,
                  "local_epochs": args.local_epochs},
        "eval": {"eval_every": args.eval_every * steps_per_round, "clients": min(10, args.clients - 1),
                 "at_end": False},
        "runtime": {"mode": "local"},
        "rounds": rounds,
    })
    setup = prepare(cfg)
    fed = Federation(setup, InProcessExecutor(make_host(setup)), log=lambda line: None)
    start, best, updates = time.perf_counter(), 0.0, 0
    for r in range(fed.rounds):
        record = fed.step(r)
        updates += record["clients_done"]
        if "gfl_gm" in record:
            best = max(best, record["gfl_gm"])
            print(f"  {method} {mode}: round {r + 1}/{fed.rounds}, virtual {record['virtual_time']:.0f} s, real "
                  f"{time.perf_counter() - start:.0f} s, G-FL {100 * record['gfl_gm']:.2f}", file=sys.stderr,
                  flush=True)
            if record["gfl_gm"] >= args.target:
                return [method, mode, f"{record['virtual_time']:.0f}", f"{time.perf_counter() - start:.0f}",
                        r + 1, updates, f"{100 * best:.2f}"]
    return [method, mode, "-", "-", "-", updates, f"{100 * best:.2f}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--alpha", type=float, default=0.3)
    p.add_argument("--fraction", type=float, default=0.1, help="sync's clients per round, as a fraction")
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--rounds", type=int, default=100, help="sync rounds at most (FedBuff: as many updates)")
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--target", type=float, default=0.7, help="G-FL accuracy to reach, a fraction")
    p.add_argument("--deadline", type=float, default=None, help="seconds; default: the median client's")
    p.add_argument("--over-selection", type=float, default=0.3)
    p.add_argument("--buffer-size", type=int, default=10)
    p.add_argument("--concurrency", type=int, default=None)
    p.add_argument("--methods", default="FedAvg,Fed-RoD")
    p.add_argument("--modes", default="sync,deadline,fedbuff")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rows", type=Path, help="JSON lines of the finished runs: appended to, and read to skip them")
    args = p.parse_args()
    torch.set_num_threads(1)
    deadline = args.deadline
    if deadline is None:
        probe = config_from_dict({"seed": args.seed, "data": {"dataset": "fmnist", "num_clients": args.clients,
                                                              "alpha": args.alpha, "download": False},
                                  "train": {"local_epochs": args.local_epochs}, "runtime": {"mode": "local"}})
        setup = prepare(probe)
        deadline = float(np.median(Federation(setup, InProcessExecutor(make_host(setup)), log=print).durations))
    print(machine_note())
    print(f"FMNIST, {args.clients} clients Dir({args.alpha}), {clients_per_round(args.clients, args.fraction)} a "
          f"round, {args.local_epochs} local epoch(s), seed {args.seed}; deadline {deadline:.1f} s, over-selection "
          f"{args.over_selection}; FedBuff K={args.buffer_size}; target G-FL {100 * args.target:.0f}%\n")
    # A finished run counts only for the same settings (every option but the two lists, and the deadline).
    settings = {k: v for k, v in vars(args).items() if k not in ("rows", "methods", "modes")} | {"deadline": deadline}
    lines = args.rows.read_text().splitlines() if args.rows and args.rows.is_file() else []
    done = [line["row"] for line in map(json.loads, lines) if line["settings"] == settings]
    rows = []
    for method in args.methods.split(","):
        for mode in args.modes.split(","):
            row = next((row for row in done if row[:2] == [method, mode]), None)
            if row is None:
                row = run(args, method, mode, deadline)
                if args.rows:
                    with open(args.rows, "a") as f:
                        f.write(json.dumps({"settings": settings, "row": row}) + "\n")
            rows.append(row)
    print(md_table("method|mode|virtual s to target|real s to target|rounds (steps)|client updates|best G-FL %",
                   rows, [False, False, True, True, True, True, True]))


if __name__ == "__main__":
    main()
