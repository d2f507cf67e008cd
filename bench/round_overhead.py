"""Seconds per round on Ray against two floors, for MNIST-shaped rounds on unequal shards.

The round (issue 7's target): MNIST, 100 clients, 20 sampled per round, 5 local epochs, batch 40,
Fed-RoD (linear head) unless ``--head``, evaluation and checkpoints off, one Dirichlet split per
``--alphas`` value (default 0.3 and 0.1: unequal and very unequal shards). Every configuration trains
rounds 1..``--rounds`` after an untimed warm-up round 0, so all see the same sampled clients. With
``--step compiled`` (``train.step``) every process compiles during that warm-up round.

- in-process: ``Federation`` + ``InProcessExecutor`` with 1 torch thread, every client in turn. Its
  updates' own seconds (``LocalResult.seconds``) are the round's single-thread compute.
- ideal floor: that compute divided by the cores.
- measured floor: the same updates (each round's global weights as the in-process run saw them) run by
  one plain Python process per core (``multiprocessing``, 1 torch thread, no Ray), which pull clients
  from one queue, largest shard first. Busy processes slow each other down (memory bandwidth), which
  no scheduler can avoid, so this is the floor a distributed runtime can hope for.
- Ray: the runtime as ``fedrod-ray train --mode ray`` runs it: the coordinator actor (driven round by
  round, ``_by_round``), handed the setup prepared here, with the default layout (one pooled actor per
  core, clients pulled largest first), in a local Ray of ``--cores`` CPUs started by this script.

Prints, per split, the median seconds per round and the ratios to both floors, and the memory (PSS) of
the Ray processes. Run by hand, with nothing else heavy running (about 8 minutes on 2 cores):

    FEDROD_DATA_DIR=../shared/data python bench/round_overhead.py
    FEDROD_DATA_DIR=../shared/data python bench/round_overhead.py --rounds 1 --alphas 0.3   # ~2 minutes

Without real MNIST it prints a note and uses synthetic 1x28x28 data of MNIST's size.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # before anything imports ray
# A private local Ray: no token auth, so that nothing is written to ~/.ray (deploy/README.md).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import argparse
import multiprocessing as mp
import time

import ray
import torch
from _by_round import Coordinator
from _common import machine_note, make_config, md_table, median, mnist_data_section, ray_memory

from fedrod_ray.client_update.local import RoundInput
from fedrod_ray.clients.client import ClientState
from fedrod_ray.config import ExperimentConfig, config_from_dict
from fedrod_ray.config.sections import STEPS
from fedrod_ray.executors.in_process import InProcessExecutor
from fedrod_ray.federation_state.setup import Setup, make_host, prepare
from fedrod_ray.round_loop.federation import Federation
from fedrod_ray.server_math.server import sample_clients

NEVER = 10**6  # an eval_every / checkpoint_every beyond the last round


def bench_config(args, data: dict, alpha: float) -> ExperimentConfig:
    return make_config(
        data | {"num_clients": args.clients, "partition": "dirichlet", "alpha": alpha},
        name="round_overhead", seed=args.seed,
        train={"head": args.head, "rounds": NEVER, "client_fraction": args.fraction,
               "local_epochs": args.epochs, "batch_size": args.batch_size, "step": args.step},
        eval={"eval_every": NEVER},
        runtime={"torch_threads": 1, "checkpoint_every": NEVER},
    )


def run_in_process(setup: Setup, rounds: int) -> tuple[list[float], list[float], list[RoundInput]]:
    """Seconds per timed round, single-thread compute per timed round, and every round's message."""
    torch.set_num_threads(1)
    fed = Federation(setup, InProcessExecutor(make_host(setup)), log=lambda s: None)
    host = fed.executor.host
    update_seconds: list[float] = []
    train = host.train

    def timed_train(cid, state, message, round_idx):
        out = train(cid, state, message, round_idx)
        update_seconds.append(out[0].seconds)
        return out

    host.train = timed_train
    walls, compute, messages = [], [], []
    for r in range(rounds + 1):
        messages.append(RoundInput(dict(fed.global_shared), fed.rule.broadcast(fed.server_state)))
        update_seconds.clear()
        t0 = time.perf_counter()
        fed.step(r)
        if r:
            walls.append(time.perf_counter() - t0)
            compute.append(sum(update_seconds))
    return walls, compute, messages


def floor_worker(cfg_dict: dict, inbox, outbox) -> None:
    torch.set_num_threads(1)
    host = make_host(prepare(config_from_dict(cfg_dict)))
    outbox.put(None)  # ready
    for r, cid, message in iter(inbox.get, None):
        out = host.train(cid, ClientState(), message, r)
        outbox.put((cid, out[0].seconds))


def run_measured_floor(setup: Setup, messages: list[RoundInput], cores: int) -> list[float]:
    """Seconds per timed round with one plain process per core pulling clients largest first."""
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=floor_worker, args=(setup.cfg.to_dict(), inbox, outbox)) for _ in range(cores)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            outbox.get(timeout=300)
        sizes = setup.partition.sizes
        walls = []
        for r, message in enumerate(messages):  # round 0 warms the processes up, as it does the others
            ids = sorted(sample_clients(setup.cfg.seed, r, setup.num_clients, setup.cfg.train.client_fraction),
                         key=lambda c: -sizes[c])
            t0 = time.perf_counter()
            for cid in ids:
                inbox.put((r, cid, message))
            for _ in ids:
                outbox.get(timeout=600)
            if r:
                walls.append(time.perf_counter() - t0)
        return walls
    finally:
        for _ in procs:
            inbox.put(None)
        for p in procs:
            p.join(60)


def run_ray(setup: Setup, rounds: int) -> tuple[list[float], dict, dict]:
    coordinator = Coordinator.options(num_cpus=0, max_concurrency=2).remote(setup)
    try:
        info = ray.get(coordinator.info.remote())
        walls = []
        for r in range(rounds + 1):
            t0 = time.perf_counter()
            ray.get(coordinator.step.remote(r))
            if r:
                walls.append(time.perf_counter() - t0)
        memory = ray_memory()
        ray.get(coordinator.close.remote())
    finally:
        ray.kill(coordinator)
    return walls, info, memory


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--alphas", type=float, nargs="+", default=[0.3, 0.1])
    p.add_argument("--rounds", type=int, default=3, help="timed rounds, after one warm-up round")
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--fraction", type=float, default=0.2)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=40)
    p.add_argument("--head", default="linear", choices=["none", "linear", "hyper"])
    p.add_argument("--step", default="eager", choices=list(STEPS), help="train.step (compiled: every process "
                   "compiles in its warm-up round)")
    p.add_argument("--cores", type=int, default=os.cpu_count())
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    print(machine_note())
    data = mnist_data_section(os.environ.get("FEDROD_DATA_DIR"))
    ray.init(address="local", num_cpus=args.cores, include_dashboard=False, log_to_driver=False)
    rows, memory_rows = [], []
    try:
        for alpha in args.alphas:
            setup = prepare(bench_config(args, data, alpha))
            ids = [sample_clients(args.seed, r, args.clients, args.fraction) for r in range(1, args.rounds + 1)]
            sizes = setup.partition.sizes
            print(f"Dir({alpha}): sampled shard sizes per round (min / max): "
                  + ", ".join(f"{min(sizes[c] for c in i)}/{max(sizes[c] for c in i)}" for i in ids), flush=True)
            walls, compute, messages = run_in_process(setup, args.rounds)
            print(f"  in-process: {[round(w, 2) for w in walls]} s", flush=True)
            measured = run_measured_floor(setup, messages, args.cores)
            print(f"  measured floor: {[round(w, 2) for w in measured]} s", flush=True)
            ray_walls, info, memory = run_ray(setup, args.rounds)
            print(f"  ray ({info['num_actors']} actors): {[round(w, 2) for w in ray_walls]} s", flush=True)
            ideal = median([c / args.cores for c in compute])
            floor, on_ray, local = median(measured), median(ray_walls), median(walls)
            rows.append([f"Dir({alpha})", f"{ideal:.2f}", f"{floor:.2f}", f"{floor / ideal:.3f}",
                         f"{local:.2f}", f"{local / ideal:.2f}", f"{local / floor:.2f}",
                         f"{on_ray:.2f}", f"{on_ray / ideal:.3f}", f"**{on_ray / floor:.3f}**"])
            memory_rows += [[f"Dir({alpha})", kind, n, f"{pss / 2**20:.0f}"] for kind, (n, _, pss) in memory.items()]
    finally:
        ray.shutdown()
    print(f"\nSeconds per round (median of {args.rounds}), {args.clients} clients, {args.fraction:.0%} per round, "
          f"{args.epochs} local epochs, batch {args.batch_size}, head {args.head}, step {args.step}, {args.cores} cores; "
          "ratios to the ideal floor (single-thread compute / cores) and to the measured floor (one plain "
          "process per core, largest shard first):\n")
    print(md_table("split|ideal floor s|measured floor s|measured / ideal|in-process (1 thread) s|"
                   "in-process / ideal|in-process / measured|Ray s|Ray / ideal|Ray / measured", rows))
    print("\nMemory (PSS) of the Ray run's processes, after its rounds:\n")
    print(md_table("split|process kind|processes|PSS MiB", memory_rows, right=[False, False, True, True]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
