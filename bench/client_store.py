"""Client state out of core: a federation of 10,000 (Fashion-MNIST) or 100,000 (synthetic) clients, 100 a
round, against a 100-client federation of the same participants, in-process.

For each dataset the big federation (``runtime.client_cache`` states in memory, the rest in the client store
on disk) runs ``--rounds`` rounds; after each, a checkpoint is saved (on the round's path, timed) as a run
with ``checkpoint_every: 1`` saves it. The small one holds exactly the big one's round-r participants (their
shards, as a partition of 100 clients, all trained each round, all in memory): after an untimed warm-up
round, round r of the big federation and one round of the small federation of its participants run back
to back, in alternating order, so that a changing load weighs on both alike, and "round vs 100" is the
median of their ratios. The last big round is evaluated (``eval.clients``
of the training clients: G-FL and P-FL with their 95% half-widths), then the checkpoint is loaded into a new
federation ("resume": load and restore, the data already prepared).

Memory per idle client: each federation again in a process of its own, its RSS growth (garbage collected and
freed memory returned to the system at both ends) from right after the data is prepared (and split) to the end
of the same rounds, checkpoints, evaluation and resume, the resumed federation beside the first; the big
federation's growth minus the small one's, over the clients it has beyond them.

    FEDROD_DATA_DIR=../shared/data python bench/client_store.py --set runtime.torch_threads=1
    FEDROD_DATA_DIR=../shared/data python bench/client_store.py --datasets synthetic --clients 20000
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import _memory, machine_note, md_table, median

from fedrod_ray.config import config_from_dict
from fedrod_ray.data.partition import Partition
from fedrod_ray.executors.in_process import InProcessExecutor
from fedrod_ray.federation_state.checkpoint import CheckpointWriter, load_checkpoint
from fedrod_ray.federation_state.setup import Setup, make_host, prepare
from fedrod_ray.outputs.storage import RunStorage
from fedrod_ray.round_loop.federation import Federation
from fedrod_ray.server_math.server import sample_clients

DATA = {
    "fmnist": {"dataset": "fmnist", "download": False},
    # 200,000 training images: two a client on average at 100,000 clients.
    "synthetic": {"dataset": "synthetic", "synthetic_train_per_class": 20000, "synthetic_test_per_class": 100},
}
PER_ROUND = 100


def config(args, dataset: str, clients: int, overrides: list[str]):
    data = DATA[dataset] | {"num_clients": clients, "alpha": 0.3, "min_per_client": 1}
    if dataset == "fmnist" and os.environ.get("FEDROD_DATA_DIR"):
        data["data_dir"] = os.environ["FEDROD_DATA_DIR"]
    return config_from_dict({
        "name": f"client_store_{dataset}", "seed": args.seed, "data": data,
        "train": {"head": args.head, "rounds": args.rounds, "client_fraction": PER_ROUND / clients,
                  "local_epochs": args.epochs, "batch_size": 20},
        "eval": {"eval_every": args.rounds, "clients": PER_ROUND},
        # A round's clients in memory: the others' states are on disk between their rounds.
        "runtime": {"client_cache": PER_ROUND},
    }, overrides)


def participants(setup: Setup, round_idx: int) -> Setup:
    """A federation of round ``round_idx``'s participants of ``setup`` alone: their shards, all trained each
    round, all in memory."""
    cfg = setup.cfg
    ids = sample_clients(cfg.seed, round_idx, setup.num_clients, cfg.train.client_fraction)
    part = setup.partition
    small = Partition([part.client_indices[c] for c in ids], part.counts[ids], len(ids))
    small_cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, num_clients=len(ids)),
                                    train=dataclasses.replace(cfg.train, client_fraction=1.0),
                                    eval=dataclasses.replace(cfg.eval, clients=0),
                                    runtime=dataclasses.replace(cfg.runtime, client_cache=1000))
    return dataclasses.replace(setup, cfg=small_cfg, partition=small)


def federation(setup: Setup) -> Federation:
    return Federation(setup, InProcessExecutor(make_host(setup)), log=lambda s: None)


def rss() -> int:
    """This process's resident memory once the garbage is collected and freed memory handed back (glibc's
    malloc_trim): what it holds, not what it once touched."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _memory(os.getpid())[1]


def timed(args, dataset: str) -> dict:
    """The big federation's rounds interleaved with its participants' federations; checkpoint, evaluation
    and resume of the big one."""
    cfg = config(args, dataset, args.clients[dataset], args.set)
    setup = prepare(cfg)
    big = federation(setup)
    storage = RunStorage(tempfile.mkdtemp(prefix="fedrod-client-store-"))
    big.clients.attach(storage)
    writer = CheckpointWriter(storage)
    federation(participants(setup, 0)).step(0)  # warm-up, untimed: the process's first training
    ratios, rounds, saves, small_rounds = [], [], [], []
    for r in range(args.rounds):
        small = federation(participants(setup, r))
        if r % 2:  # which of the two goes first alternates
            small_record, record = small.step(0), big.step(r)
        else:
            record, small_record = big.step(r), small.step(0)
        rounds.append(record["train_seconds"])
        small_rounds.append(small_record["train_seconds"])
        ratios.append(record["train_seconds"] / small_record["train_seconds"])
        t0 = time.perf_counter()
        writer.save(big.snapshot())
        saves.append(time.perf_counter() - t0)
        print(f"  {dataset}, round {r + 1}: {record['train_seconds']:.2f} s, its participants alone "
              f"{small_record['train_seconds']:.2f} s; checkpoint {saves[-1]:.2f} s; {big.clients.in_memory} "
              "states in memory", flush=True)
    t0 = time.perf_counter()
    resumed = federation(setup)
    resumed.clients.attach(storage)
    resumed.restore(load_checkpoint(storage))
    resume = time.perf_counter() - t0
    files = list(Path(storage.path("checkpoints", "clients")).iterdir())
    return {"clients": args.clients[dataset], "round": median(rounds), "small": median(small_rounds),
            "ratio": median(ratios), "ckpt": median(saves), "resume": resume,
            "eval": record["seconds"] - record["train_seconds"], "gfl": record["gfl_gm"], "pfl_pm": record["pfl_pm"],
            "pfl_pm_ci": record["pfl_pm_ci"], "pfl_gm_ci": record["pfl_gm_ci"],
            "store_mib": sum(f.stat().st_size for f in files) / 2**20, "store_files": len(files)}


def memory(args, dataset: str, small: bool) -> dict:
    """RSS growth of one federation (the big one, or round 1's participants alone) from right after its data
    is prepared to the end of its rounds, checkpoints, evaluation and resume."""
    cfg = config(args, dataset, args.clients[dataset], args.set)
    setup = prepare(cfg)
    if small:
        setup = participants(setup, 0)
    before = rss()
    fed = federation(setup)
    storage = RunStorage(tempfile.mkdtemp(prefix="fedrod-client-store-"))
    fed.clients.attach(storage)
    writer = CheckpointWriter(storage)
    for r in range(args.rounds):
        fed.step(r)
        writer.save(fed.snapshot())
    resumed = federation(setup)
    resumed.clients.attach(storage)
    resumed.restore(load_checkpoint(storage))
    return {"clients": setup.num_clients, "growth": rss() - before}


def in_subprocess(args, dataset: str, small: bool) -> dict:
    cmd = [sys.executable, __file__, "--memory-of", dataset, *(["--small"] if small else []),
           "--rounds", str(args.rounds), "--seed", str(args.seed), "--head", args.head, "--epochs", str(args.epochs),
           "--clients", str(args.clients["fmnist"]), str(args.clients["synthetic"]),
           *[a for s in args.set for a in ("--set", s)]]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", nargs="+", default=["fmnist", "synthetic"], choices=list(DATA))
    p.add_argument("--clients", type=int, nargs=2, default=[10_000, 100_000], metavar=("FMNIST", "SYNTHETIC"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--head", default="hyper", choices=["none", "linear", "hyper"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], help="a config override, as fedrod-ray train's --set")
    p.add_argument("--memory-of", choices=list(DATA), help=argparse.SUPPRESS)
    p.add_argument("--small", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.clients = dict(zip(("fmnist", "synthetic"), args.clients))
    return args


def main() -> int:
    args = parse_args()
    torch.manual_seed(0)
    threads = config(args, "synthetic", 1000, args.set).runtime.torch_threads
    if threads:
        torch.set_num_threads(threads)
    if args.memory_of:
        print(json.dumps(memory(args, args.memory_of, args.small)))
        return 0
    print(machine_note())
    cache = config(args, "synthetic", 100_000, args.set).runtime.client_cache
    rows = []
    for dataset in args.datasets:
        res = timed(args, dataset)
        big, small = in_subprocess(args, dataset, False), in_subprocess(args, dataset, True)
        per_client = (big["growth"] - small["growth"]) / (big["clients"] - small["clients"])
        rows.append([dataset, f"{res['clients']:,}", f"{per_client / 2**10:.2f} KiB", f"{res['round']:.2f}",
                     f"{res['small']:.2f}", f"{res['ratio']:.2f}x", f"{res['ckpt']:.2f}", f"{res['resume']:.2f}",
                     f"{res['eval']:.1f}", f"{res['pfl_pm']:.3f} ± {res['pfl_pm_ci']:.3f}",
                     f"{res['pfl_gm_ci']:.3f}", f"{res['store_mib']:.0f} ({res['store_files']})"])
        print(f"  {dataset}: RSS growth {big['growth'] / 2**20:.0f} MiB ({big['clients']:,} clients) vs "
              f"{small['growth'] / 2**20:.0f} MiB ({small['clients']})", flush=True)
    print(f"load average at the end {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"\n{PER_ROUND} clients a round, Dir(0.3), head {args.head}, {args.epochs} local epoch(s), batch 20, "
          f"runtime.client_cache={cache}, in-process; medians of {args.rounds} rounds; evaluation of round "
          f"{args.rounds} with eval.clients={PER_ROUND}; overrides {args.set}:\n")
    print(md_table("data|clients|memory per idle client|s / round|s / round, its 100 participants alone|"
                   "round vs 100|s / checkpoint|s / resume|s / evaluation|P-FL (PM) ± 95% half-width|"
                   "P-FL (GM) half-width|client files MiB (files)", rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
