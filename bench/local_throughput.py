"""Local-training speed: samples/second of ONE client update, and the time of one full in-process round.

Part 1 times ``fedrod_ray.local.local_update`` (what ``ClientHost.train`` runs; its own wall time,
``LocalResult.seconds``) for one client of ~600 examples, 5 local epochs, batch 40, for
  * the MNIST-shaped ConvNet (mnist_cnn, 1x28x28; real MNIST, client 0 of an IID split over 100 clients),
  * the CIFAR-shaped ConvNet (cifar_cnn, 3x32x32 random uint8 images, 10 classes, crop/flip augmentation on),
for torch threads 1 and 2 and for FedAvg (``train.head: none``, ``balanced_loss: ce``), Fed-RoD (linear)
and Fed-RoD (hyper) (``train.head: linear`` / ``hyper``, balanced softmax), all with the generic rule
``fedavg``. Each configuration gets one short warm-up update (1 epoch), then ``--repeats`` timed updates;
the table gives the median.
Ratios are against FedAvg with the same shape and threads, and 2 threads against 1, all from this run.

Part 2 times whole FMNIST-shaped rounds in-process with 2 torch threads: MNIST, 100 clients IID
(600 examples each), 20 sampled per round, 5 epochs, batch 40, via ``Federation.step`` with
evaluation off (``eval.eval_every`` beyond the last round) and no checkpoint (``step`` writes none). One
warm-up round, then the median of ``--rounds`` rounds; compared with 20 x the single-update median of part 1.

Run by hand (nothing else heavy should be running; ~4 minutes on 2 cores):

    FEDROD_DATA_DIR=/work/shared/data python bench/local_throughput.py
    FEDROD_DATA_DIR=/work/shared/data python bench/local_throughput.py --quick   # smoke run, ~30 s

Without real MNIST (``--data-dir``/``$FEDROD_DATA_DIR``) it prints a note and uses synthetic 1x28x28 data.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np
import torch
from _common import machine_note, make_config, md_table, median, mnist_data_section

from fedrod_ray.algorithms import build_rule
from fedrod_ray.config import TrainConfig
from fedrod_ray.federation import Federation, InProcessExecutor, make_host, prepare
from fedrod_ray.local import ClientData, RoundInput, local_update
from fedrod_ray.models import build_model
from fedrod_ray.server import sample_clients

METHODS = {  # name -> train section; FedAvg is the one-head model with plain cross-entropy
    "fedavg": {"head": "none", "balanced_loss": "ce"},
    "fedrod_linear": {"head": "linear"},
    "fedrod_hyper": {"head": "hyper"},
}
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class Shape:
    """One client's data and how to train on it."""

    def __init__(self, name: str, arch: str, data: ClientData, mean, std, augment: bool, hyper_hidden: int):
        self.name, self.arch, self.data = name, arch, data
        self.mean, self.std, self.augment, self.hyper_hidden = mean, std, augment, hyper_hidden

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(int(s) for s in self.data.x.shape[1:])


def mnist_shape(data_section: dict, n: int) -> tuple[Shape, str]:
    cfg = make_config(data_section | {"num_clients": 100, "partition": "iid"})
    setup = prepare(cfg)
    host = make_host(setup, [0])
    data = host.data[0]
    if n < len(data):
        data = ClientData(
            data.x[:n].contiguous(),
            data.y[:n].contiguous(),
            torch.bincount(data.y[:n], minlength=setup.dataset.num_classes),
        )
    ds = setup.dataset
    label = f"{ds.name} 1x28x28 (mnist_cnn)"
    return Shape(label, "mnist_cnn", data, ds.mean, ds.std, False, 16), ds.name


def cifar_shape(n: int, seed: int) -> Shape:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, 3, 32, 32), generator=g, dtype=torch.uint8)
    y = torch.randint(0, 10, (n,), generator=g)
    data = ClientData(x, y, torch.bincount(y, minlength=10))
    # hyper_hidden 32 as in configs/cifar10_paper.yaml.
    return Shape("random 3x32x32 + augment (cifar_cnn)", "cifar_cnn", data, CIFAR_MEAN, CIFAR_STD, True, 32)


def time_update(shape: Shape, method: str, epochs: int, batch: int, repeats: int, seed: int) -> list[float]:
    cfg = TrainConfig(**METHODS[method], batch_size=batch)
    rule = build_rule(cfg.generic_rule, cfg.rule_params)
    model = build_model(shape.arch, 10, shape.image_shape, cfg.variant, shape.hyper_hidden, seed)
    state = model.state_dict()
    message = RoundInput({k: state[k].detach().clone() for k in model.shared_keys()})

    def run(local_epochs: int, round_idx: int) -> float:
        train_cfg = dataclasses.replace(cfg, local_epochs=local_epochs)
        opts = {"seed": seed, "client_id": 0, "mean": shape.mean, "std": shape.std, "augment": shape.augment}
        result, _, _ = local_update(model, message, shape.data, train_cfg, rule, round_idx=round_idx, **opts)
        return result.seconds

    run(1, 0)  # warm-up: one short update (allocator, kernels, thread pool)
    return [run(epochs, r) for r in range(repeats)]


def part1(args, shapes: list[Shape]) -> tuple[str, dict[tuple[str, str, int], float]]:
    rows = []
    med: dict[tuple[str, str, int], float] = {}
    for shape in shapes:
        for threads in args.threads:
            torch.set_num_threads(threads)
            for method in METHODS:
                times = time_update(shape, method, args.epochs, args.batch_size, args.repeats, args.seed)
                med[shape.name, method, threads] = median(times)
                print(
                    f"  {shape.name} | {method} | {threads} thread(s): "
                    + ", ".join(f"{t:.2f}s" for t in times),
                    flush=True,
                )
    for shape in shapes:
        n = len(shape.data)
        for threads in args.threads:
            for method in METHODS:
                t = med[shape.name, method, threads]
                vs_avg = t / med[shape.name, "fedavg", threads]
                base_threads = min(args.threads)
                speedup = (
                    f"{med[shape.name, method, base_threads] / t:.2f}x"
                    if threads != base_threads
                    else "1.00x (base)"
                )
                rows.append(
                    [
                        shape.name,
                        method,
                        threads,
                        n,
                        f"{t:.2f}",
                        f"{n * args.epochs / t:,.0f}",
                        f"{vs_avg:.2f}x",
                        speedup,
                    ]
                )
    headers = [
        "data / model",
        "method",
        "threads",
        "examples",
        "s / update (median)",
        "samples/s",
        "time vs fedavg",
        f"speedup vs {min(args.threads)} thread",
    ]
    return md_table(headers, rows, [False, False] + [True] * 6), med


def part2(args, data_section: dict, single: dict[str, float]) -> str:
    torch.set_num_threads(args.round_threads)
    rows = []
    for method in args.round_methods:
        big = 10**6  # evaluation rounds never reached
        cfg = make_config(
            data_section | {"num_clients": args.clients, "partition": "iid"},
            seed=args.seed,
            train=METHODS[method]
            | {
                "rounds": big,
                "client_fraction": args.fraction,
                "local_epochs": args.epochs,
                "batch_size": args.batch_size,
            },
            eval={"eval_every": big},
            runtime={"torch_threads": args.round_threads},
        )
        setup = prepare(cfg)
        sizes = [len(setup.partition.client_indices[c]) for c in range(setup.num_clients)]
        n = sum(sizes) / len(sizes)
        fed = Federation(setup, InProcessExecutor(make_host(setup, setup.all_client_ids)), log=lambda s: None)
        walls, trains, samples = [], [], []
        for r in range(1 + args.rounds):
            t0 = time.perf_counter()
            rec = fed.step(r)
            wall = time.perf_counter() - t0
            print(f"  round {method}: {'warm-up round' if r == 0 else f'round {r}'} {wall:.1f}s", flush=True)
            if r == 0:
                continue
            walls.append(wall)
            trains.append(rec["train_seconds"])
            ids = sample_clients(cfg.seed, r, setup.num_clients, cfg.train.client_fraction)
            samples.append(sum(sizes[c] for c in ids) * args.epochs)
        wall = median(walls)
        # Part 1's update is of one client of args.examples examples: comparable only at that client size.
        per_update = single.get(method) if abs(n - args.examples) <= 0.01 * args.examples else None
        expected = rec["clients"] * per_update if per_update else None
        rows.append(
            [
                method,
                f"{rec['clients']} x ~{round(n)}",
                args.round_threads,
                f"{wall:.1f}",
                f"{median(trains):.1f}",
                f"{median([s / w for s, w in zip(samples, walls)]):,.0f}",
                f"{expected:.1f}" if expected else "-",
                f"{wall / expected:.2f}x" if expected else "-",
            ]
        )
    headers = [
        "method",
        "clients x examples",
        "threads",
        "s / round (median)",
        "train+aggregate s",
        "samples/s",
        "20 x single update s",
        "round / (20 x update)",
    ]
    if rows:
        headers[6] = f"{rec['clients']} x single update s"
        headers[7] = f"round / ({rec['clients']} x update)"
    return md_table(headers, rows, [False] + [True] * 7)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data-dir", help="directory holding mnist/ (default: $FEDROD_DATA_DIR, then the cache dir)"
    )
    p.add_argument("--examples", type=int, default=600, help="examples of the one client (part 1)")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3, help="timed updates per configuration (median)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up round (part 2)")
    p.add_argument("--round-threads", type=int, default=2)
    p.add_argument(
        "--round-methods",
        nargs="*",
        default=["fedrod_linear"],
        choices=list(METHODS),
        help="methods to time whole rounds for (none: skip part 2)",
    )
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--fraction", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 200 examples, 1 epoch, 1 repeat, 1 round of 2 clients (100 clients x 0.02)",
    )
    args = p.parse_args()
    if args.quick:
        args.examples, args.epochs, args.repeats, args.rounds = 200, 1, 1, 1
        args.fraction = 0.02
    np.random.seed(args.seed)

    data_section = mnist_data_section(args.data_dir)
    print(machine_note())
    mnist, ds_name = mnist_shape(data_section, args.examples)
    shapes = [mnist, cifar_shape(args.examples, args.seed)]
    print(
        f"part 1: one client update, {args.epochs} epoch(s), batch {args.batch_size}, "
        f"median of {args.repeats} after a 1-epoch warm-up",
        flush=True,
    )
    table1, med = part1(args, shapes)
    table2 = ""
    if args.round_methods:
        # Part 1's single-update medians of the MNIST shape at the round's thread count, when measured.
        single = {
            m: med[mnist.name, m, args.round_threads]
            for m in METHODS
            if (mnist.name, m, args.round_threads) in med and args.examples == 600
        }
        print(
            f"part 2: whole rounds in-process, {args.round_threads} thread(s), {args.clients} clients IID, "
            f"fraction {args.fraction}, evaluation off, no checkpoint",
            flush=True,
        )
        table2 = part2(args, data_section, single)
    print()
    print(
        f"### One client update ({args.examples} examples, {args.epochs} local epochs, batch {args.batch_size}; "
        f"median of {args.repeats})\n"
    )
    print(table1)
    if table2:
        print(
            f"\n### One in-process FMNIST-shaped round ({ds_name} data, {args.clients} clients IID, fraction {args.fraction}, "
            f"{args.epochs} epochs, batch {args.batch_size}; median of {args.rounds} after 1 warm-up round; "
            f"evaluation off, no checkpoint)\n"
        )
        print(table2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
