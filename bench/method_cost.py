"""What one client update of each row of the main table costs, against FedAvg's measured in the same run.

Each row as ``fedrod-ray reproduce --table main`` runs it (tune/tables.py's overrides on
``configs/fmnist_paper.yaml``: FMNIST, 100 clients, Dir(``--alpha``), 5 local epochs, batch 40), in this
process on one torch thread. An update: the client of median size, at round ``--round``, from the initial
weights, with the message the row's server sends it (FedFOMO's: the models it picks among the others'
last uploads, here the initial weights moved by seeded noise, so that it weighs and mixes them as it
would in a run). The rows take turns ``--repeats`` times, FedAvg in every turn; a row's cost is the median
over the turns of its CPU time over FedAvg's in the same turn (the process's CPU time, which other
processes' load disturbs far less than wall time), beside its optimiser steps per update.

A row's whole run also depends on what it does besides updates (evaluating its PMs, its server step):
per update is what differs most between the personalized-FL baselines. Two such costs are measured. A row
whose PM is made at each evaluation (Per-FedAvg's step, FedBABU's fine-tuning) costs that much again per
client evaluated, timed as one making of the same client's PM (``pm``). The methods whose server holds a
model of its own (``--round-rows``, default pFedHN and PeFLL) do much of their work there: the server's
hypernetwork generates every client's model and back-propagates every update, and PeFLL asks its clients for
descriptors and for their part of the backward pass. For those, whole rounds are timed too, each the next
round of the row's federation (its sampled clients' updates in this process, then the server's step with its
exchanges; no evaluation), in turns with FedAvg's, as CPU time over FedAvg's round in the same turn.

    FEDROD_DATA_DIR=../shared/data python bench/method_cost.py            # about 10 minutes on 2 cores
    FEDROD_DATA_DIR=../shared/data python bench/method_cost.py --rows FedAvg pFedMe --repeats 2
    FEDROD_DATA_DIR=../shared/data python bench/method_cost.py --rows pFedHN PeFLL --repeats 2 --round-repeats 2
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from _common import machine_note, md_table, median
from fedrod_ray_tune.repro_spec import build_spec
from fedrod_ray_tune.tables import MAIN

from fedrod_ray.client_update.local import RoundInput
from fedrod_ray.clients.client import ClientFailure, ClientState
from fedrod_ray.executors.in_process import InProcessExecutor
from fedrod_ray.federation_state.setup import make_host, prepare
from fedrod_ray.round_loop.federation import Federation
from fedrod_ray.server_math.server import sample_clients

BASE = Path(__file__).resolve().parent.parent / "configs" / "fmnist_paper.yaml"
BASELINE = "FedAvg"


def moved(state: dict, seed: int, scale: float = 0.01) -> dict:
    """``state`` with seeded noise: another client's model."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()
            for k, v in state.items()}


class Row:
    """One row's federation, its measured client and the message its server sends that client."""

    def __init__(self, label: str, alpha: float, round_idx: int):
        self.label = label
        spec = build_spec("main", BASE, [0], rows=[label], overrides={"data.alpha": alpha})
        cfg = spec.row_config(label, 0)
        setup = prepare(cfg)
        fed = Federation(setup, InProcessExecutor(make_host(setup)), log=lambda s: None)
        self.fed = fed
        self.host = fed.executor.host
        sizes = sorted(range(setup.num_clients), key=lambda c: (len(self.host.data(c)), c))
        self.client, self.round_idx = sizes[len(sizes) // 2], round_idx
        uploads = {c: moved(fed.global_shared, c) for c in range(setup.num_clients) if c != self.client}
        self.message = RoundInput(fed.global_shared, fed.rule.broadcast(fed.server_state),
                                  fed.method.messages(fed.method_state, [self.client], uploads, round_idx, cfg.seed,
                                                      fed._asker(round_idx)))
        # The state a PM made at evaluation starts from (None: the row's PM is its clients' own model).
        self.pm_state = (fed.method.pm_job(ClientState(), fed.global_shared, round_idx + 1, fed.method_state,
                                           self.client)
                         if fed.method.pm_from_global else None)

    def update(self) -> tuple[float, float, int]:
        """(CPU seconds, wall seconds, optimiser steps) of one update."""
        cpu, wall = time.process_time(), time.perf_counter()
        out = self.host.train(self.client, ClientState(), self.message, self.round_idx)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        if isinstance(out, ClientFailure):
            raise SystemExit(f"{self.label}: the update failed: {out.traceback}")
        return cpu, wall, out[0].steps

    def pm(self) -> float:
        """CPU seconds of making the client's PM at evaluation, after its last round ``round_idx``."""
        host, cpu = self.host, time.process_time()
        host.method.load_pm(host.model, self.pm_state, lambda: host.data(self.client),
                            host.context_of(self.client, self.round_idx))
        return time.process_time() - cpu

    def round(self) -> tuple[float, float]:
        """(CPU seconds, wall seconds) of the federation's next round: its clients' updates and the server's
        step with its exchanges (the rounds timed are not evaluated: the config evaluates every 20th)."""
        cpu, wall = time.process_time(), time.perf_counter()
        record = self.fed.step(self.fed.next_round)
        if record["clients_failed"] or "gfl_gm" in record:
            raise SystemExit(f"{self.label}: round {record['round']} failed or was evaluated: {record}")
        return time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="+", default=[r for r in MAIN if MAIN[r]["train.generic_rule"] == "fedavg"],
                   help="rows of the main table (default: those with the FedAvg rule)")
    p.add_argument("--alpha", type=float, default=0.3)
    p.add_argument("--round", type=int, default=3, help="the round the update is in (its learning rate)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--round-rows", nargs="*", default=["pFedHN", "PeFLL"],
                   help="rows whose whole rounds are timed too, against FedAvg's (default: pFedHN, PeFLL)")
    p.add_argument("--round-repeats", type=int, default=2, help="turns of whole rounds (after one warm-up round)")
    args = p.parse_args()
    torch.set_num_threads(1)
    labels = [BASELINE, *(r for r in args.rows if r != BASELINE)]
    rows = {label: Row(label, args.alpha, args.round) for label in labels}
    for row in rows.values():
        row.update()  # warm-up: first-call costs out of the turns
    cpu, wall, steps, pm = ({label: [] for label in labels} for _ in range(4))
    for turn in range(args.repeats):
        for label, row in rows.items():
            c, w, s = row.update()
            cpu[label].append(c)
            wall[label].append(w)
            steps[label] = s
            if row.pm_state is not None:
                pm[label].append(row.pm())
        print(f"turn {turn + 1}/{args.repeats}: " + ", ".join(f"{k} {cpu[k][-1]:.2f}s" for k in labels), flush=True)

    def ratio(label: str, times: dict, base: dict | None = None) -> float:
        """The median over the turns of ``label``'s time over FedAvg's update's (``base``: ``times``)."""
        return median([t / b for t, b in zip(times[label], (base or times)[BASELINE])])

    base = rows[BASELINE]
    print(machine_note())
    print(f"FMNIST (configs/fmnist_paper.yaml), Dir({args.alpha}), client {base.client} "
          f"({len(base.host.data(base.client))} examples), round {args.round}, 1 torch thread, "
          f"{args.repeats} turns; {BASELINE}'s update {median(cpu[BASELINE]):.2f} s CPU\n")
    print(md_table("row|CPU s / update|× FedAvg (CPU)|× FedAvg (wall)|optimiser steps|PM at evaluation, × FedAvg's "
                   "update (CPU)",
                   [[label, f"{median(cpu[label]):.2f}", f"{ratio(label, cpu):.2f}", f"{ratio(label, wall):.2f}",
                     steps[label], f"{ratio(label, pm, cpu):.2f}" if pm[label] else "—"] for label in labels]))
    if args.round_rows:
        round_labels = [BASELINE, *(r for r in args.round_rows if r != BASELINE)]
        for label in round_labels:
            rows.setdefault(label, Row(label, args.alpha, args.round)).round()  # warm-up
        cpu, wall = ({label: [] for label in round_labels} for _ in range(2))
        for turn in range(args.round_repeats):
            for label in round_labels:
                c, w = rows[label].round()
                cpu[label].append(c)
                wall[label].append(w)
            print(f"round turn {turn + 1}/{args.round_repeats}: "
                  + ", ".join(f"{k} {cpu[k][-1]:.1f}s" for k in round_labels), flush=True)
        clients = len(sample_clients(base.fed.cfg.seed, 0, base.fed.setup.num_clients,
                                     base.fed.cfg.train.client_fraction))
        print(f"\nWhole rounds ({clients} clients each, the server's step and exchanges, no evaluation), "
              f"{args.round_repeats} turns after a warm-up round\n")
        print(md_table("row|CPU s / round|× FedAvg (CPU)|× FedAvg (wall)",
                       [[label, f"{median(cpu[label]):.1f}", f"{ratio(label, cpu):.2f}", f"{ratio(label, wall):.2f}"]
                        for label in round_labels]))


if __name__ == "__main__":
    main()
