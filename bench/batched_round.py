"""One round's local training, 20 clients in one batched pass against the same clients one after another.

The round: MNIST split IID over 100 clients (600 examples each), 20 of them sampled, 5 local epochs,
batch 40, the MNIST ConvNet, Fed-RoD with the linear head unless ``--heads``, the fedavg rule unless
``--rule``. Both paths train exactly the same updates, from the same global weights and with the same
per-client seeds, on ``--device``:

- one after another: ``InProcessExecutor`` (``ClientHost.train``: ``local.local_update`` per client);
- batched: ``BatchedExecutor`` (``fedrod_ray.executors.batched``), up to ``--group`` clients per pass.

Each path gets one untimed warm-up round (2 clients), then ``--repeats`` timed rounds; the table gives the
median seconds, samples/s (examples x epochs / s) and the speed-up of batched over one after another,
plus the largest differences between the two paths' trained weights and mean losses over the clients.
Those are float rounding (another summation order) grown over the update: a near-tie in a max-pooling
window that rounding resolves the other way sends one gradient to another pixel, and SGD carries the
difference on (tests/test_batched.py); in float64 the two paths agree to 1e-8. Run by hand, with nothing
else heavy running:

    FEDROD_DATA_DIR=../shared/data python bench/batched_round.py --threads 1       # CPU, ~2 minutes per head
    FEDROD_DATA_DIR=../shared/data python bench/batched_round.py --device cuda --heads none linear hyper

Without real MNIST it prints a note and uses synthetic 1x28x28 data of MNIST's size.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from _common import machine_note, make_config, md_table, median, mnist_data_section

from fedrod_ray.client_update.local import RoundInput
from fedrod_ray.clients.client import ClientFailure, ClientState
from fedrod_ray.executors.batched import BatchedExecutor
from fedrod_ray.executors.in_process import InProcessExecutor
from fedrod_ray.federation_state.setup import make_host, prepare
from fedrod_ray.round_loop.federation import Federation
from fedrod_ray.server_math.server import sample_clients

HEADS = {"none": {"head": "none", "balanced_loss": "ce"}, "linear": {"head": "linear"}, "hyper": {"head": "hyper"}}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--heads", nargs="+", default=["linear"], choices=sorted(HEADS))
    p.add_argument("--rule", default="fedavg")
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--fraction", type=float, default=0.2)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=40)
    p.add_argument("--group", type=int, default=20, help="most clients per batched pass")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def timed_round(executor, jobs, message, device) -> tuple[float, dict]:
    """Seconds of one round's training and each client's result, in job order."""
    t0 = time.perf_counter()
    out = dict(executor.train(0, jobs, message))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    failed = [o for o in out.values() if isinstance(o, ClientFailure)]
    if failed:
        raise RuntimeError(f"{len(failed)} clients failed, first: {failed[0].error}\n{failed[0].traceback}")
    return seconds, {jobs[slot][0]: out[slot][0] for slot in out}


def bench_head(args, data: dict, head: str) -> tuple[list, list]:
    cfg = make_config(
        data | {"num_clients": args.clients, "partition": "iid"}, seed=args.seed,
        train=HEADS[head] | {"generic_rule": args.rule, "client_fraction": args.fraction,
                             "local_epochs": args.epochs, "batch_size": args.batch_size},
        runtime={"mode": "local", "device": args.device, "batched_clients": args.group},
    )
    setup = prepare(cfg)
    host = make_host(setup, args.device)
    fed = Federation(setup, InProcessExecutor(host), log=lambda s: None)
    message = RoundInput(fed.global_shared, fed.rule.broadcast(fed.server_state))
    ids = sample_clients(cfg.seed, 0, setup.num_clients, cfg.train.client_fraction)
    jobs = [(cid, ClientState()) for cid in ids]
    samples = sum(len(setup.partition.client_indices[c]) for c in ids) * args.epochs
    device = torch.device(args.device)
    paths = {"one after another": InProcessExecutor(host), f"batched (up to {args.group} per pass)":
             BatchedExecutor(host, args.group)}
    for executor in paths.values():
        timed_round(executor, jobs[:2], message, device)  # warm-up: allocator, kernels, thread pool
    times, results = {name: [] for name in paths}, {}
    for _ in range(args.repeats):  # the paths take turns, so that a change in the machine's load hits both
        for name, executor in paths.items():
            t, results[name] = timed_round(executor, jobs, message, device)
            times[name].append(t)
            print(f"  {head} | {name}: {t:.2f}s", flush=True)
    seconds = {name: median(ts) for name, ts in times.items()}
    (base, base_res), (other, other_res) = ((n, results[n]) for n in paths)
    weight_diff = max((other_res[c].shared[k] - base_res[c].shared[k]).abs().max().item()
                      for c in ids for k in base_res[c].shared)
    loss_diff = max(abs(other_res[c].loss - base_res[c].loss) for c in ids)
    rows = [[head, name, f"{seconds[name]:.2f}", f"{samples / seconds[name]:,.0f}",
             f"**{seconds[base] / seconds[name]:.2f}x**" if name == other else "1.00x (base)",
             f"{weight_diff:.1e} / {loss_diff:.1e}" if name == other else ""] for name in paths]
    return rows, [len(ids), samples // args.epochs]


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_note())
    device = torch.device(args.device)
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}")
    data = mnist_data_section(os.environ.get("FEDROD_DATA_DIR"))
    rows, shape = [], None
    for head in args.heads:
        head_rows, shape = bench_head(args, data, head)
        rows += head_rows
    print(f"\nOne round's local training on {args.device} ({torch.get_num_threads()} torch threads): {shape[0]} "
          f"clients, {shape[1]:,} examples in all, {args.epochs} local epochs, batch {args.batch_size}, rule "
          f"{args.rule}; median of {args.repeats} round(s) after a warm-up:\n")
    print(md_table("head|path|s / round|samples/s|speed-up|max abs diff: weights / mean loss", rows,
                   [False, False, True, True, True, True]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
