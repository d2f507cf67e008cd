"""fedrod-ray's Ray runtime against Flower 1.42's simulation engine on the same FMNIST job: the round's time
and the whole run's peak memory.

The job: Fashion-MNIST, 100 clients, Dir(0.3), 10 per round (the same ones in both: fedrod-ray's seeded
sample; the Flower side tells each sampled node which client it is), FedAvg (train.head=none,
train.balanced_loss=ce), fedrod-ray's FMNIST model from the same initial weights, 5 local epochs of SGD
(batch 40, lr 0.01 decayed by 0.99 a round, momentum 0.9, weight decay 1e-5) on channels-last batches, one
torch thread per client, a private local Ray of 2 CPUs with one client actor per CPU. No evaluation in
either; fedrod-ray checkpoints every round, as a run does. The Flower side (``_flower_app``) imports
fedrod-ray's config, data loading, partition and model, and loads the data in each client actor, as a
Flower app does.

Each system runs in a process of its own with a Ray of its own (its own RAY_TMPDIR), one after the other
(``--repeats 2``: A B B A). Every second this script reads the memory of that process and all its descendants
(the driver, Ray's processes and workers): their PSS without shared memory, plus Ray's object store (its
/dev/shm file) counted once. Printed: the median seconds per round after the first (warm-up) round, the peak
memory, and the ratios to Flower's.

    FEDROD_DATA_DIR=../shared/data python bench/flower_compare.py   # the folder holding fmnist/; flwr here too
    ... --flower-python VENV/bin/python   # Flower from another environment (default: this Python)
    ... --before /path/to/older/checkout   # fedrod-ray from that source tree too (before/after a change)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import machine_note, make_config, md_table, median, tree_memory

from fedrod_ray.config import ExperimentConfig

HERE = Path(__file__).resolve().parent
NUM_CPUS = 2


def job_config(rounds: int) -> ExperimentConfig:
    data_dir = os.environ.get("FEDROD_DATA_DIR", "data")
    return make_config(
        {"dataset": "fmnist", "data_dir": data_dir, "download": False, "num_clients": 100, "partition": "dirichlet",
         "alpha": 0.3},
        name="flower_compare", seed=0,
        train={"head": "none", "balanced_loss": "ce", "rounds": rounds, "client_fraction": 0.1, "local_epochs": 5,
               "batch_size": 40},
        eval={"eval_every": rounds + 1, "at_end": False},
        runtime={"mode": "ray", "address": "local", "torch_threads": 1},
    )


def fedrod_side(rounds: int) -> list[float]:
    """Seconds of each round of the job on fedrod-ray's Ray runtime (``fedrod-ray train --mode ray``)."""
    import ray

    from fedrod_ray.drivers.ray_runtime import run_ray
    from fedrod_ray.outputs.storage import RunStorage

    ray.init(address="local", num_cpus=NUM_CPUS, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            return [r["seconds"] for r in run_ray(job_config(rounds), RunStorage(run_dir), log=lambda s: None)]
    finally:
        ray.shutdown()


def flower_side(rounds: int) -> list[float]:
    """Seconds of each round of the job on Flower's simulation engine."""
    import _flower_app
    from flwr.simulation import run_simulation

    backend = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
               "init_args": {"address": "local", "num_cpus": NUM_CPUS, "include_dashboard": False}}
    _flower_app.ROUNDS = rounds
    run_simulation(_flower_app.server_app, _flower_app.client_app, num_supernodes=100, backend_config=backend)
    ends = _flower_app.ROUND_ENDS  # when round 0 (the initial weights) and each round after it ended
    return [b - a for a, b in itertools.pairwise(ends)]


def measure(name: str, python: str, source: str | None, rounds: int) -> dict:
    """Run one system's side in a process of its own and sample its memory; its round times and peak memory."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=tempfile.mkdtemp(prefix="fc-", dir="/tmp"), RAY_USAGE_STATS_ENABLED="0",
               RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    if source is not None:
        env["PYTHONPATH"] = source
    side = "flower" if name == "Flower" else "fedrod"
    # Run from bench/: Ray puts the driver's working directory first on its workers' path.
    proc = subprocess.Popen([python, "flower_compare.py", "--side", side, "--rounds", str(rounds)], cwd=HERE,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak, peak_at, t0 = (0, 0), 0.0, time.perf_counter()

    def sample() -> None:
        nonlocal peak, peak_at
        while proc.poll() is None:
            now = tree_memory(proc.pid)
            if sum(now) > sum(peak):
                peak, peak_at = now, time.perf_counter() - t0
            time.sleep(1.0)

    sampler = threading.Thread(target=sample)
    sampler.start()
    out, _ = proc.communicate()
    sampler.join()
    results = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        raise RuntimeError(f"{name} exited {proc.returncode}:\n{out[-4000:]}")
    seconds = json.loads(results[-1][len("RESULT "):])
    print(f"{name}: rounds {', '.join(f'{s:.1f}' for s in seconds)} s; peak {sum(peak) / 2**20:.0f} MiB at "
          f"{peak_at:.0f} s of {time.perf_counter() - t0:.0f} s", flush=True)
    return {"name": name, "seconds": seconds, "processes": peak[0], "store": peak[1]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4, help="rounds per run; the first is a warm-up, not timed")
    p.add_argument("--repeats", type=int, default=1, choices=(1, 2), help="2: A B B A, medians over both")
    p.add_argument("--flower-python", default=sys.executable,
                   help="a Python with flwr[simulation] 1.42 and fedrod-ray (pip install --no-deps -e .); "
                        "default: this one")
    p.add_argument("--before", help="also run fedrod-ray from this source tree (e.g. a worktree of an older commit)")
    p.add_argument("--side", choices=("fedrod", "flower"), help=argparse.SUPPRESS)  # one system, in its process
    args = p.parse_args()
    if args.side is not None:
        seconds = (fedrod_side if args.side == "fedrod" else flower_side)(args.rounds)
        print("RESULT " + json.dumps(seconds), flush=True)
        return 0

    print(machine_note())
    systems = [("fedrod-ray", sys.executable, None), ("Flower", args.flower_python, None)]
    if args.before:
        systems.insert(1, ("fedrod-ray (before)", sys.executable, args.before))
    order = systems if args.repeats == 1 else systems + systems[::-1]
    runs = [measure(name, python, source, args.rounds) for name, python, source in order]
    load = os.getloadavg()
    print(f"load average at the end {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}")

    rows, flower = [], None
    for name, _, _ in systems[::-1]:  # Flower first, for the ratios
        mine = [r for r in runs if r["name"] == name]
        round_s = median([s for r in mine for s in r["seconds"][1:]])
        peak = max(mine, key=lambda r: r["processes"] + r["store"])
        total = peak["processes"] + peak["store"]
        flower = flower or (round_s, total)
        rows.insert(0, [name, f"{round_s:.1f}", f"{round_s / flower[0]:.2f}x", f"{total / 2**30:.2f}",
                        f"{total / flower[1]:.2f}x", f"{peak['processes'] / 2**30:.2f}",
                        f"{peak['store'] / 2**20:.0f}"])
    print(f"\nFMNIST, 100 clients, Dir(0.3), 10 per round, FedAvg, 5 local epochs, batch 40, {NUM_CPUS} client actors; "
          f"median of rounds 2..{args.rounds}" + (" of both runs" if args.repeats == 2 else "") + "; peak memory of "
          "the whole run (driver, Ray's processes and workers: PSS; object store once):\n")
    print(md_table("system|s / round|vs Flower|peak memory GiB|vs Flower|of which processes GiB|object store MiB",
                   rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
