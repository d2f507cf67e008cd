"""What client-level DP costs a round: a round with clipping, noise and the accountant against the same round
without them, as a ratio, and where the difference goes.

The setting is the privacy-utility table's (configs/fmnist_dp.yaml, docs/privacy.md) at a size a laptop
times: MNIST-shaped data over ``--clients`` clients, Dir(0.3), ``--fraction`` of them per round, 5 local
epochs of batch 40, in this process. Both federations train the same clients each round (the fixed-size
draw, ``privacy.sampling: fixed``, seeded by ``privacy.noise_seed``, which draws what the non-private run
does), and their rounds alternate, so that the machine's load falls on both alike. Timed per round, medians
over ``--rounds`` rounds after one untimed warm-up round each:

- clip: ``privacy.clip_update`` on every client's upload (in its actor, on Ray), summed over the round;
- noise: the server's noised mean (``privacy.noised_mean``: the noise draw and the division);
- epsilon: the accountant (``accounting.epsilon``, dp_accounting's RDP for this round, not cached).

The measured ratio is of two whole rounds, and on a loaded machine the load's swings can hide a few
percent either way; the last column, (round without DP + clip + noise + epsilon) / round without DP, is
what DP adds by its own timers. No evaluation runs. Run by hand, with nothing else heavy running:

    FEDROD_DATA_DIR=../shared/data python bench/dp_cost.py --threads 1
    FEDROD_DATA_DIR=../shared/data python bench/dp_cost.py --heads none hyper --clients 1000 --fraction 0.1

Without real MNIST it prints a note and uses synthetic 1x28x28 data of MNIST's size.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from _common import machine_note, make_config, md_table, median, mnist_data_section

import fedrod_ray.clients.client as client_module
import fedrod_ray.federation_state.dp_rounds as dp_module
from fedrod_ray.executors.in_process import InProcessExecutor
from fedrod_ray.federation_state.setup import make_host, prepare
from fedrod_ray.round_loop.federation import Federation
from fedrod_ray.server_math import accounting

HEADS = {"none": {"head": "none", "balanced_loss": "ce"}, "linear": {"head": "linear"}, "hyper": {"head": "hyper"}}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", nargs="+", default=["none", "hyper"], choices=sorted(HEADS))
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--fraction", type=float, default=0.1)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per federation")
    p.add_argument("--noise-multiplier", type=float, default=1.0)
    p.add_argument("--clip-norm", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None)
    return p.parse_args()


class Timers:
    """Wall time of the functions it wraps, summed per round under their labels."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, label: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - t0

        return timed


def federation(data: dict, head: str, args, private: bool) -> Federation:
    privacy = ({"enabled": True, "noise_multiplier": args.noise_multiplier, "clip_norm": args.clip_norm,
                "sampling": "fixed", "noise_seed": args.seed} if private else {})
    rounds = args.rounds + 2  # never the last: no evaluation
    cfg = make_config({**data, "num_clients": args.clients, "alpha": 0.3}, seed=args.seed,
                      train={**HEADS[head], "rounds": rounds, "client_fraction": args.fraction},
                      eval={"eval_every": rounds}, privacy=privacy)
    setup = prepare(cfg)
    return Federation(setup, InProcessExecutor(make_host(setup)), log=lambda s: None)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    data = mnist_data_section(args.data_dir)
    timers = Timers()
    client_module.clip_update = timers.wrap("clip", client_module.clip_update)
    dp_module.noised_mean = timers.wrap("noise", dp_module.noised_mean)
    dp_module.epsilon = timers.wrap("epsilon", dp_module.epsilon)
    print(machine_note())
    print(f"{args.clients} clients, {args.fraction:g} per round, sigma {args.noise_multiplier:g}, S {args.clip_norm:g}, "
          f"{torch.get_num_threads()} thread(s); medians over {args.rounds} rounds\n")
    rows = []
    for head in args.heads:
        accounting.epsilon.cache_clear()  # every head's accountant computes afresh, as a run's does
        plain, private = federation(data, head, args, False), federation(data, head, args, True)
        times: dict[str, list[float]] = defaultdict(list)
        for r in range(args.rounds + 1):
            for name, fed in (("plain", plain), ("private", private)):
                timers.seconds.clear()
                t0 = time.perf_counter()
                fed.step(r)
                if r:  # the first round warms up
                    times[name].append(time.perf_counter() - t0)
                    if name == "private":
                        for label in ("clip", "noise", "epsilon"):
                            times[label].append(timers.seconds[label])
        without, with_dp = median(times["plain"]), median(times["private"])
        own = [median(times[k]) for k in ("clip", "noise", "epsilon")]
        rows.append([head, f"{without:.2f}", f"{with_dp:.2f}", f"{with_dp / without:.3f}",
                     *(f"{1000 * t:.1f}" for t in own), f"{(without + sum(own)) / without:.3f}"])
    print(md_table("head|round without DP (s)|with DP (s)|ratio|clip, all clients (ms)|noise (ms)|epsilon (ms)|"
                   "ratio by DP's own timers", rows))


if __name__ == "__main__":
    main()
