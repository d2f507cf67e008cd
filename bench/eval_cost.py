"""Evaluation cost: an exact evaluation of a paper-sized federation against the forward-pass floor, the P-FL
estimate's error and cost, and the share of a run's wall time spent evaluating.

The federation: FMNIST (``--dataset``), ``--clients`` clients under Dir(``--alpha``), 20% per round,
``--epochs`` local epochs, batch 40, Fed-RoD with the linear head and BSM, in this process on every core
(``torch.set_num_threads(os.cpu_count())``, the in-process runtime's default). Each of ``--rounds`` rounds
is timed in three parts: training (``train_seconds``), the estimate (``eval.estimate_size`` test images,
inside the step) and an exact evaluation after it (``Federation.evaluate``; with the PM cache, only that
round's clients' PMs are new, as when every round is evaluated). The first table gives each round's exact
figures, the estimate's and their difference.

The exact evaluations' images are the test set once (the GM, and every global-reading PM from its
features) plus each new PM's test images of its client's classes through its own model; their images/s
over rounds 2.. go against the floor: as many images through one model, a plain ``torch.inference_mode`` forward (features and generic
head) at the best of several batch sizes, channels-last, on every core, measured in the same run.

The last table: a ``--run-rounds`` run of ``--run-epochs`` local epochs, from the measured costs per
round (the train round scaled by run-epochs / epochs when they differ). (a) evaluated exactly every
``--eval-every`` rounds: extrapolated, at the measured exact cost per image, with the PMs new at each
evaluation (the expected number of clients sampled since the last one); (b) a sweep trial: (a) plus the
measured per-round estimate; and, for comparison, exact every round (measured per round).

    FEDROD_DATA_DIR=../shared/data python bench/eval_cost.py                  # 3 rounds of 5 epochs
    FEDROD_DATA_DIR=../shared/data python bench/eval_cost.py --rounds 3 --epochs 1 --dataset mnist
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from _common import machine_note, make_config, md_table

from fedrod_ray.data import resolve_data_dir
from fedrod_ray.executors.in_process import InProcessExecutor
from fedrod_ray.federation_state.setup import make_host, prepare
from fedrod_ray.round_loop.evaluation import anchored, estimate_offset
from fedrod_ray.round_loop.federation import Federation

NEVER = 10**6
KEYS = ("gfl_gm", "pfl_gm", "pfl_pm")
FLOOR_BATCHES = (64, 128, 256, 500, 1000, 2000)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="fmnist", choices=["fmnist", "mnist"])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--alpha", type=float, default=0.3)
    p.add_argument("--rounds", type=int, default=3, help="training rounds before the evaluation")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--run-rounds", type=int, default=100, help="the run the shares are for")
    p.add_argument("--run-epochs", type=int, default=5,
                   help="the run's local epochs: the measured train round is scaled by run-epochs / epochs")
    p.add_argument("--eval-every", type=int, default=10, help="the run's exact evaluations")
    p.add_argument("--estimate-size", type=int, default=1000, help="eval.estimate_size")
    p.add_argument("--anchor-every", type=int, default=2,
                   help="rounds between the exact evaluations the estimate is corrected by (as eval.eval_every)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def test_images(setup, client_ids, labels: torch.Tensor) -> int:
    """Images the PMs of ``client_ids`` forward: each one's images (of ``labels``) of the classes it has."""
    per_class = torch.bincount(labels, minlength=setup.test.num_classes)
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
    print(machine_note(), flush=True)
    fraction = 0.2
    cfg = make_config(
        {"dataset": args.dataset, "data_dir": str(resolve_data_dir(None)), "download": False,
         "num_clients": args.clients, "partition": "dirichlet", "alpha": args.alpha},
        name="eval_cost", seed=args.seed,
        train={"head": "linear", "balanced_loss": "bsm", "rounds": NEVER, "client_fraction": fraction,
               "local_epochs": args.epochs, "batch_size": 40, "lr": 0.01, "momentum": 0.9},
        eval={"eval_every": NEVER, "estimate_size": args.estimate_size},
        runtime={"mode": "local"},
    )
    setup = prepare(cfg)
    fed = Federation(setup, InProcessExecutor(make_host(setup)), log=print)
    sample = fed.evaluation.estimate_test
    rows, train_s, est_s, exact_s, images, est_images = [], [], [], [], [], []
    offset: dict[str, float] = {}
    errors: dict[str, list[float]] = {"sample": [], "anchored": []}
    for r in range(args.rounds):
        before = {cid: st.rounds_trained for cid, st in fed.clients.items()}
        rec = fed.step(r)  # trains, then the estimate: the sample's alone (eval_every NEVER: no offset)
        t0 = time.perf_counter()
        exact = fed.evaluate()  # exact, as at an eval_every round: only this round's PMs are new
        exact_s.append(time.perf_counter() - t0)
        sampled = {f"{k}_est": rec[f"{k}_est"] for k in KEYS}
        est = anchored(sampled, offset)
        if offset:
            errors["sample"] += [abs(sampled[f"{k}_est"] - exact[k]) for k in KEYS]
            errors["anchored"] += [abs(est[f"{k}_est"] - exact[k]) for k in KEYS]
        anchor = (r + 1) % args.anchor_every == 0
        if anchor:
            offset = estimate_offset(exact, sampled)
        train_s.append(rec["train_seconds"])
        est_s.append(rec["seconds"] - rec["train_seconds"])
        new = [cid for cid, st in fed.clients.items() if st.rounds_trained != before[cid]]
        images.append(len(setup.test.y) + test_images(setup, new, setup.test.y))
        est_images.append(len(sample.y) + test_images(setup, new, sample.y))
        rows.append([f"{r + 1}{' (anchor)' if anchor else ''}"]
                    + [f"{100 * exact[k]:.2f} / {100 * sampled[k + '_est']:.2f} ({100 * (sampled[k + '_est'] - exact[k]):+.2f})"
                       f" / {100 * (est[k + '_est'] - exact[k]):+.2f}" for k in KEYS]
                    + [f"{train_s[-1]:.1f}", f"{est_s[-1]:.2f}", f"{exact_s[-1]:.1f}"])
        print(f"  round {r + 1}: train {train_s[-1]:.2f} s, estimate {est_s[-1]:.2f} s, exact {exact_s[-1]:.2f} s "
              f"({images[-1]:,} images); P-FL PM {exact['pfl_pm']:.4f}, estimate {rec['pfl_pm_est']:.4f}", flush=True)
    # Round 1 warms up (and trains from scratch): the costs are the means of the later rounds.
    later = slice(1, None) if args.rounds > 1 else slice(None)
    train_round, est_round, exact_round = (sum(x[later]) / len(x[later]) for x in (train_s, est_s, exact_s))
    # Images/s of the evaluations after rounds 2..: the GM's pass plus each new PM's (its classes' images).
    n_exact, n_est = sum(images[later]), sum(est_images[later])
    t_exact, t_est = sum(exact_s[later]), sum(est_s[later])
    rate, best_bs = floor_rate(setup)
    floor_s = n_exact / rate
    per_image = t_exact / n_exact

    def exact_cost(stale: float) -> float:
        per_client = test_images(setup, list(range(args.clients)), setup.test.y) / args.clients
        return per_image * (len(setup.test.y) + stale * per_client)

    runs, every = args.run_rounds, args.eval_every
    run_train = train_round * args.run_epochs / args.epochs  # an epoch costs the same each time
    evals = runs // every
    e_every = exact_cost(expected_stale(args.clients, fraction, every))
    run_a = runs * run_train + evals * e_every
    run_b = run_a + runs * est_round
    run_old = runs * (run_train + exact_round)
    print()
    print(f"{args.dataset}, {args.clients} clients, Dir({args.alpha}), {args.epochs} local epochs, linear head, "
          f"{args.rounds} rounds; estimate on {len(sample.y)} test images; the floor at batch {best_bs}")
    print()
    print("Exact / the sample's estimate (its error) / the anchored estimate's error, in %, after each round; "
          "seconds of each part:")
    print(md_table("round|G-FL (GM)|P-FL (GM)|P-FL (PM)|train, s|estimate, s|exact, s", rows))
    if errors["sample"]:
        print(f"after the first anchor (round {args.anchor_every}): largest error of the sample's estimate "
              f"{100 * max(errors['sample']):.2f} points, of the anchored one {100 * max(errors['anchored']):.2f} "
              f"(mean {100 * sum(errors['sample']) / len(errors['sample']):.2f} and "
              f"{100 * sum(errors['anchored']) / len(errors['anchored']):.2f})")
    print()
    print(md_table(f"the evaluations after rounds {later.start + 1 if later.start else 1}..{args.rounds}|"
                   "seconds|images|images/s|x floor", [
        ["exact (Federation.evaluate)", f"{t_exact:.2f}", f"{n_exact:,}", f"{n_exact / t_exact:,.0f}",
         f"{t_exact / floor_s:.2f}"],
        ["estimate (Evaluation.estimate)", f"{t_est:.2f}", f"{n_est:,}", f"{n_est / t_est:,.0f}",
         f"{t_est * rate / n_est:.2f}"],
        ["floor: plain forward, the exact's images", f"{floor_s:.2f}", f"{n_exact:,}", f"{rate:,.0f}", "1.00"],
    ]))
    print()
    print(md_table(f"a {runs}-round run (from the measured costs per round)|evaluating, s|total, s|"
                   "share evaluating", [
        [f"(a) exact every {every} (extrapolated: {expected_stale(args.clients, fraction, every):.0f} new PMs each)",
         f"{evals * e_every:.0f}", f"{run_a:.0f}", f"{100 * evals * e_every / run_a:.1f}%"],
        [f"(b) sweep trial: (a) + the estimate every round (measured {est_round:.2f} s)",
         f"{run_b - runs * run_train:.0f}", f"{run_b:.0f}", f"{100 * (run_b - runs * run_train) / run_b:.1f}%"],
        [f"before: exact every round (measured {exact_round:.2f} s)", f"{runs * exact_round:.0f}", f"{run_old:.0f}",
         f"{100 * runs * exact_round / run_old:.1f}%"],
    ]))
    print(f"(train round: measured {train_round:.2f} s at {args.epochs} local epochs, the mean of rounds "
          f"2..{args.rounds}; the run's: {run_train:.2f} s at {args.run_epochs} epochs"
          f"{', scaled by epochs' if args.run_epochs != args.epochs else ''})")


if __name__ == "__main__":
    main()
