"""How fast one client update trains, per technique, against today's eager step measured in the same run.

One update (``fedrod_ray.client_update.local.local_update``): one client of 600 examples, 5 local epochs,
batch 40 (75 steps), 1 torch thread, Fed-RoD with the linear and the hyper head (balanced softmax, rule
fedavg), for
  * MNIST (mnist_cnn, 1x28x28; real MNIST, client 0 of an IID split over 100 clients),
  * CIFAR-10-shaped data (cifar_cnn, 3x32x32 random uint8 images, 10 classes, crop/flip augmentation on).

Techniques (``--techniques``):
  * eager     today's step: op by op, torch.optim.SGD's for-loop implementation (the baseline);
  * foreach   SGD(foreach=True): one multi-tensor kernel per operation instead of one per parameter;
  * fused     SGD(fused=True): one fused kernel per parameter group;
  * retain    glibc's malloc keeps freed memory in the process (mallopt: trim threshold 256 MiB, mmap
              threshold 32 MiB), so that a step's fresh tensors cost no page faults;
  * compiled  ``train.step: compiled`` (fedrod_ray.client_update.step): torch.compile of the forward pass and
    both losses,
              whose backward AOTAutograd compiles with them; the optimizer runs eagerly;
(foreach, fused and retain are not options of the library, as they did not pay: their workers make
foreach or fused torch.optim.SGD's default, or call mallopt.)

Every measurement runs in a fresh worker process (the allocator setting and torch.compile's caches are
per process): a worker times its first update (with any compilation), then ``--updates`` more. The
techniques take turns, ``--repeats`` times over, so that each round of turns sees the same machine load;
a speed-up is the median over the rounds of (eager's time / the technique's time) in that round, in wall
time and in the worker's CPU time (which other processes' load disturbs far less; samples per CPU second
are samples/s per core on an otherwise idle machine). The compile time is the
first update's time less a steady one's: with an empty inductor cache in the first round (a fresh
``TORCHINDUCTOR_CACHE_DIR`` per model), from its on-disk cache afterwards. It is paid once per process (a
Ray actor, or the driver in-process); break-even = compile time / (eager's CPU time - compiled's per
update), in updates and in in-process rounds of 20 updates.

A last table puts eager against the arithmetic floor of the step: the multiply-adds of every convolution
and linear layer of the feature extractor (the heads' are negligible; so the floor is one per shape) (forward; backward twice that, once for the first layer, whose input needs no gradient)
at the speed of this core's own float32 matrix multiply (MKL, 1 thread, on the largest layer's im2col
shape). No step technique can beat that floor; eager / floor is the most any of them could give.

Run by hand, with nothing else heavy running (about 25 minutes on 2 cores; ``--quick`` about 4):

    FEDROD_DATA_DIR=../shared/data python bench/local_throughput.py
    FEDROD_DATA_DIR=../shared/data python bench/local_throughput.py --quick

Without real MNIST (``--data-dir``/``$FEDROD_DATA_DIR``) it prints a note and uses synthetic 1x28x28 data.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import machine_note, make_config, md_table, median, mnist_data_section

EXAMPLES, EPOCHS, BATCH = 600, 5, 40
ROUND_CLIENTS = 20  # a paper round: 20 of 100 clients
TECHNIQUES = ("eager", "foreach", "fused", "retain", "compiled")
SHAPES = {"mnist": "MNIST 1x28x28 (mnist_cnn)", "cifar": "CIFAR-10-shaped 3x32x32 + augment (cifar_cnn)"}
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


# --- worker: one technique, one shape, one head, in its own process ------------------------------------

def client_data(shape: str, data_dir: str | None):
    """(arch, the client's data, mean, std, augment)."""
    import torch

    from fedrod_ray.client_update.local import ClientData
    from fedrod_ray.federation_state.setup import make_host, prepare

    if shape == "mnist":
        setup = prepare(make_config(mnist_data_section(data_dir) | {"num_clients": 100, "partition": "iid"}))
        data = make_host(setup).data(0)
        ds = setup.dataset
        return "mnist_cnn", ClientData(data.x[:EXAMPLES], data.y[:EXAMPLES],
                                       torch.bincount(data.y[:EXAMPLES], minlength=10)), ds.mean, ds.std, False
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (EXAMPLES, 3, 32, 32), generator=g, dtype=torch.uint8)
    y = torch.randint(0, 10, (EXAMPLES,), generator=g)
    return "cifar_cnn", ClientData(x, y, torch.bincount(y, minlength=10)), CIFAR_MEAN, CIFAR_STD, True


def worker(spec: dict) -> dict:
    import functools

    import torch

    from fedrod_ray.algorithms import build_rule
    from fedrod_ray.client_update.local import RoundInput, UpdateContext, local_update
    from fedrod_ray.config import TrainConfig
    from fedrod_ray.models import build_model
    from fedrod_ray.personalization import build_method

    torch.set_num_threads(1)
    parts = set(spec["technique"].split("+"))
    if "retain" in parts:
        mallopt = ctypes.CDLL(None).mallopt  # glibc only
        if not (mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 and mallopt(M_TRIM_THRESHOLD, 256 << 20) == 1):
            raise RuntimeError("retain: mallopt refused the thresholds")
    for impl in ("foreach", "fused"):
        if impl in parts:  # local_update builds torch.optim.SGD(...) without naming an implementation
            torch.optim.SGD = functools.partial(torch.optim.SGD, **{impl: True})
    arch, data, mean, std, augment = client_data(spec["shape"], spec["data_dir"])
    cfg = TrainConfig(head=spec["head"], local_epochs=EPOCHS, batch_size=BATCH,
                      step="compiled" if "compiled" in parts else "eager")
    variant = build_method(cfg.head).variant
    model = build_model(arch, 10, tuple(data.x.shape[1:]), variant, 32 if arch == "cifar_cnn" else 16, seed=0)
    message = RoundInput({k: v.detach().clone() for k, v in model.state_dict().items() if k in model.shared_keys()})
    rule = build_rule(cfg.generic_rule, cfg.rule_params)

    def update(round_idx: int) -> tuple[float, float, int]:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0, c0 = time.perf_counter(), time.thread_time()
        local_update(model, message, data, UpdateContext(cfg, rule, round_idx, 0, 0, mean, std, augment))
        return (time.perf_counter() - t0, time.thread_time() - c0,
                resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)

    first = update(0)[0]
    runs = [update(r) for r in range(1, spec["updates"] + 1)]
    return {"first": first, "wall": [r[0] for r in runs], "cpu": [r[1] for r in runs],
            "faults": [r[2] for r in runs]}


def floor_worker(spec: dict) -> dict:
    """Multiply-adds of one update's steps through the feature extractor, and this core's float32 GEMM speed
    on its largest layer's shape."""
    import torch
    from torch import nn

    from fedrod_ray.models import build_model

    torch.set_num_threads(1)
    arch, data, *_ = client_data(spec["shape"], spec["data_dir"])
    model = build_model(arch, 10, tuple(data.x.shape[1:]), None, 16, seed=0)
    layers: list[tuple[int, int, int]] = []  # (rows, inner, columns) of each layer's GEMM

    def hook(module, inputs, out):
        if isinstance(module, nn.Conv2d):
            inner = module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]
            layers.append((out.numel() // module.out_channels, inner, module.out_channels))
        else:
            layers.append((out.numel() // module.out_features, module.in_features, module.out_features))

    for m in model.body.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            m.register_forward_hook(hook)
    with torch.no_grad():
        model.features(torch.zeros(BATCH, *data.x.shape[1:]))
    macs = [r * k * c for r, k, c in layers]
    step_macs = macs[0] * 2 + sum(macs[1:]) * 3  # forward + weight gradient (+ input gradient past layer 1)
    r, k, c = layers[macs.index(max(macs))]
    a, b = torch.randn(r, k), torch.randn(k, c)
    best = float("inf")
    for _ in range(100):
        t0 = time.thread_time()
        a @ b
        best = min(best, time.thread_time() - t0)
    steps = EPOCHS * -(-EXAMPLES // BATCH)
    return {"flops": 2 * step_macs * steps, "gemm_flops_per_s": 2 * r * k * c / best}


def run_worker(spec: dict, cache_dir: Path) -> dict:
    env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- driver ---------------------------------------------------------------------------------------------

def measure(args) -> dict:
    """results[(shape, head, technique)] = one worker's result per round of turns."""
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="frt-inductor-") as tmp:
        for rep in range(args.repeats):
            for shape in args.shapes:
                for head in args.heads:
                    for tech in args.techniques:
                        spec = {"shape": shape, "head": head, "technique": tech, "updates": args.updates,
                                "data_dir": args.data_dir}
                        r = run_worker(spec, Path(tmp) / f"{shape}-{head}")
                        results.setdefault((shape, head, tech), []).append(r)
                        print(f"  round {rep + 1}: {shape} {head} {tech}: first {r['first']:.2f}s, then "
                              + ", ".join(f"{w:.2f}" for w in r["wall"]) + f" s, faults/update "
                              f"{median(r['faults']):,.0f}", flush=True)
        for shape in args.shapes:
            spec = {"shape": shape, "data_dir": args.data_dir, "floor": True}
            results[shape, "floor"] = run_worker(spec, Path(tmp) / "floor")
    return results


def tables(args, results: dict) -> str:
    samples = EXAMPLES * EPOCHS
    rows, compile_rows = [], []
    for shape in args.shapes:
        for head in args.heads:
            base = results[shape, head, "eager"]
            for tech in args.techniques:
                runs = results[shape, head, tech]
                wall = median([median(r["wall"]) for r in runs])
                cpu = median([median(r["cpu"]) for r in runs])
                speed = median([median(b["wall"]) / median(r["wall"]) for b, r in zip(base, runs)])
                speed_cpu = median([median(b["cpu"]) / median(r["cpu"]) for b, r in zip(base, runs)])
                faults = median([median(r["faults"]) for r in runs])
                rows.append([SHAPES[shape], head, tech, f"{samples / wall:,.0f}", f"{samples / cpu:,.0f}",
                             f"{speed:.2f}x", f"{speed_cpu:.2f}x", f"{faults:,.0f}"])
                if "compiled" in tech:
                    cold = runs[0]["first"] - median(runs[0]["wall"])
                    warm = [r["first"] - median(r["wall"]) for r in runs[1:]]
                    gain = median([median(b["cpu"]) - median(r["cpu"]) for b, r in zip(base, runs)])
                    even = ("never (slower)" if gain <= 0 else
                            f"{cold / gain:,.0f} updates = {cold / gain / ROUND_CLIENTS:,.1f} rounds")
                    compile_rows.append([SHAPES[shape], head, tech, f"{cold:.1f}",
                                         f"{median(warm):.1f}" if warm else "-", f"{gain:+.3f}", even])
    out = [(f"### One client update ({EXAMPLES} examples, {EPOCHS} epochs, batch {BATCH}, 1 thread; median of "
            f"{args.repeats} rounds of turns x {args.updates} updates)\n"),
           md_table(["data / model", "head", "technique", "samples/s (wall)", "samples / CPU s",
                     "speed-up (wall)", "speed-up (CPU time)", "page faults / update"], rows,
                    [False] * 3 + [True] * 5)]
    if compile_rows:
        out += [("\n### One-off compile time and break-even (cold: empty inductor cache; warm: from its disk "
                 f"cache; saved: eager's CPU seconds per update less compiled's; a round: {ROUND_CLIENTS} "
                 "updates in-process)\n"),
                md_table(["data / model", "head", "technique", "compile s (cold)", "compile s (warm)",
                          "CPU s saved / update", "break-even (cold)"], compile_rows, [False] * 3 + [True] * 4)]
    floor_rows = []
    for shape in args.shapes:
        for head in args.heads:
            f = results[shape, "floor"]
            floor_s = f["flops"] / f["gemm_flops_per_s"]
            eager_s = median([median(r["cpu"]) for r in results[shape, head, "eager"]])
            floor_rows.append([SHAPES[shape], head, f"{f['flops'] / 1e9:.1f}", f"{f['gemm_flops_per_s'] / 1e9:.0f}",
                               f"{floor_s:.2f}", f"{eager_s:.2f}", f"{eager_s / floor_s:.2f}x"])
    out += [("\n### The arithmetic floor (multiply-adds of the convolutions and linear layers at this core's float32 "
             "GEMM speed, 1 thread) against eager's CPU time per update\n"),
            md_table(["data / model", "head", "GFLOP / update", "GEMM GFLOP/s", "floor s / update",
                      "eager CPU s / update", "eager / floor"], floor_rows, [False] * 2 + [True] * 5)]
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", help="directory holding mnist/ (default: $FEDROD_DATA_DIR, then the cache dir)")
    p.add_argument("--techniques", nargs="+", default=list(TECHNIQUES), choices=TECHNIQUES)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--heads", nargs="+", default=["linear", "hyper"], choices=["linear", "hyper"])
    p.add_argument("--repeats", type=int, default=3, help="rounds of turns (the first compiles from cold)")
    p.add_argument("--updates", type=int, default=3, help="timed updates per worker, after its first")
    p.add_argument("--quick", action="store_true", help="MNIST, linear head, eager/retain/compiled, 2 rounds")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        print(json.dumps(floor_worker(spec) if spec.get("floor") else worker(spec)))
        return 0
    if args.quick:
        args.shapes, args.heads, args.techniques, args.repeats = ["mnist"], ["linear"], ["eager", "retain",
                                                                                          "compiled"], 2
    if "eager" not in args.techniques:
        args.techniques.insert(0, "eager")
    args.data_dir = mnist_data_section(args.data_dir).get("data_dir") if "mnist" in args.shapes else None
    print(machine_note())
    results = measure(args)
    print()
    print(tables(args, results))
    print(f"\nload average at the end: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
