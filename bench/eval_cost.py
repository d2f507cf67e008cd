"""Evaluation cost: one exact evaluation of a paper-sized federation against the forward-pass floor, and the
share of a run's wall time spent evaluating.

The federation: FMNIST (``--dataset``), ``--clients`` clients under Dir(``--alpha``), 20% per round,
``--epochs`` local epochs, batch 40, Fed-RoD with the linear head and BSM, in this process on every core
(``torch.set_num_threads(os.cpu_count())``, the in-process runtime's default). It trains ``--rounds``
rounds (timed: the train round), so that the clients that trained hold PMs of their own, then:

- exact: one evaluation as ``Federation.evaluate`` does it (G-FL, P-FL of the GM and of every client's PM
  in both readings), the PM cache cleared first so that every trained client's PM is evaluated afresh, as
  at an ``eval_every`` round. Its images are the test set once (the GM, and every global-reading PM from
  its features) plus each trained client's test images of its own classes (its own model);
- floor: the same number of images through one model, a plain ``torch.inference_mode`` forward (features
  and generic head) at the best of several batch sizes, channels-last, measured in the same run.

The shares: a run of ``--run-rounds`` rounds evaluated exactly every ``--eval-every`` rounds, extrapolated
from the measured train round and the measured evaluation cost per image, with the PMs that are stale at
each evaluation (clients sampled since the last one: the expected number under uniform sampling, as
rounds fall) - so the table says "extrapolated".

    FEDROD_DATA_DIR=../shared/data python bench/eval_cost.py                  # ~5 minutes on 2 cores
    FEDROD_DATA_DIR=../shared/data python bench/eval_cost.py --rounds 5 --clients 100 --dataset mnist
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from _common import machine_note, make_config, md_table

from fedrod_ray.data import resolve_data_dir
from fedrod_ray.executors.in_process import InProcessExecutor
from fedrod_ray.federation import Federation
from fedrod_ray.setup import make_host, prepare

NEVER = 10**6
FLOOR_BATCHES = (250, 500, 1000, 2000, 5000)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="fmnist", choices=["fmnist", "mnist"])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--alpha", type=float, default=0.3)
    p.add_argument("--rounds", type=int, default=3, help="training rounds before the evaluation")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--run-rounds", type=int, default=100, help="the run the shares are for")
    p.add_argument("--eval-every", type=int, default=10, help="the run's exact evaluations")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def test_images(setup, client_ids) -> int:
    """Images the PMs of ``client_ids`` forward: each one's test images of the classes it has."""
    per_class = torch.bincount(setup.test.y, minlength=setup.test.num_classes)
    counts = torch.as_tensor(setup.partition.counts[client_ids])
    return int(((counts > 0).to(torch.long) * per_class).sum())


@torch.inference_mode()
def floor_rate(setup) -> tuple[float, int]:
    """Best images/s of a plain forward of the test set through one model, and the batch size."""
    model = setup.build_model().eval()
    x = setup.test.x
    best = (0.0, 0)
    for bs in FLOOR_BATCHES:
        model(x[:bs].contiguous(memory_format=torch.channels_last))  # warm-up
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 2.0:
            for start in range(0, len(x), bs):
                model(x[start:start + bs].contiguous(memory_format=torch.channels_last))
            done += len(x)
        rate = done / (time.perf_counter() - t0)
        print(f"  floor: batch {bs}: {rate:,.0f} images/s", flush=True)
        best = max(best, (rate, bs))
    return best


def expected_stale(clients: int, fraction: float, rounds: int) -> float:
    """Clients sampled at least once in ``rounds`` rounds of ``fraction`` of them (uniform sampling)."""
    return clients * (1 - (1 - fraction) ** rounds)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    print(machine_note())
    fraction = 0.2
    cfg = make_config(
        {"dataset": args.dataset, "data_dir": str(resolve_data_dir(None)), "download": False,
         "num_clients": args.clients, "partition": "dirichlet", "alpha": args.alpha},
        name="eval_cost", seed=args.seed,
        train={"head": "linear", "balanced_loss": "bsm", "rounds": NEVER, "client_fraction": fraction,
               "local_epochs": args.epochs, "batch_size": 40, "lr": 0.01, "momentum": 0.9},
        eval={"eval_every": NEVER},
        runtime={"mode": "local"},
    )
    setup = prepare(cfg)
    fed = Federation(setup, InProcessExecutor(make_host(setup)), log=print)
    train_s = []
    for r in range(args.rounds):
        rec = fed.step(r)
        train_s.append(rec["train_seconds"])
        print(f"  round {r + 1}: train {rec['train_seconds']:.2f} s", flush=True)
    train_round = sum(train_s[1:]) / len(train_s[1:]) if len(train_s) > 1 else train_s[0]

    trained = [cid for cid, st in fed.clients.items() if st.local_model is not None]
    images = len(setup.test.y) + test_images(setup, trained)
    fed.evaluation.clear()
    t0 = time.perf_counter()
    exact = fed.evaluate()
    exact_s = time.perf_counter() - t0
    print(f"  exact evaluation: {exact_s:.2f} s, {len(trained)} PMs, {images:,} images; "
          f"P-FL PM {exact['pfl_pm']:.4f}", flush=True)
    rate, best_bs = floor_rate(setup)
    floor_s = images / rate
    per_image = exact_s / images

    def run_share(every: int) -> tuple[float, float]:
        evals = args.run_rounds // every
        stale = expected_stale(args.clients, fraction, every)
        one = per_image * (len(setup.test.y) + stale * test_images(setup, list(range(args.clients))) / args.clients)
        return one, evals * one / (evals * one + args.run_rounds * train_round)

    e10, share10 = run_share(args.eval_every)
    e1, share1 = run_share(1)
    print()
    print(f"{args.dataset}, {args.clients} clients, Dir({args.alpha}), {args.epochs} local epochs, "
          f"{args.rounds} rounds trained; floor at batch {best_bs}")
    print(md_table("what|seconds|images|images/s|x floor", [
        ["train round (measured, mean of rounds 2..)", f"{train_round:.2f}", "", "", ""],
        ["exact evaluation (measured)", f"{exact_s:.2f}", f"{images:,}", f"{images / exact_s:,.0f}",
         f"{exact_s / floor_s:.2f}"],
        ["floor: plain forward, same images", f"{floor_s:.2f}", f"{images:,}", f"{rate:,.0f}", "1.00"],
    ]))
    print()
    print(md_table("run (extrapolated from the measured costs)|evaluation, s|share of wall time evaluating", [
        [f"{args.run_rounds} rounds, exact every {args.eval_every}", f"{e10:.2f}", f"{100 * share10:.1f}%"],
        [f"{args.run_rounds} rounds, exact every round", f"{e1:.2f}", f"{100 * share1:.1f}%"],
    ]))


if __name__ == "__main__":
    main()
