"""Sites (``data.dataset: sites``) against the default Ray mode (the driver reads the data) on the same job, on a
local 3-node cluster: a head with no CPU and two worker nodes of one CPU each, labelled fedrod.site=a / b.

The job: real MNIST, 6 clients (3 at each site) of ``--per-client`` training images of 3 classes each, Fed-RoD
(hyper; ``--head ditto``: Ditto, whose clients keep a whole personal model), 3 clients a round, 1 local epoch, no evaluation; the same clients in both modes (the sites' per-client
.npz files, and one arrays .npz of them all for the default mode). Each (mode, data size) runs in a process of its
own with a cluster of its own; that process is the head's driver and coordinator (it drives the round loop
itself), so its peak memory (VmHWM) is the head's. Printed: the median seconds per round after the first, the
head's peak memory at 1x and ``--scale``x the data, and the bytes that cross between the nodes per round: the
round's message once per node with a client, each job and each client's result, pickled as Ray ships them,
against the model's size (its shared weights) times the round's clients.

    FEDROD_DATA_DIR=../shared/data python bench/sites.py [--rounds 6] [--per-client 40] [--scale 10] [--head ditto]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import machine_note, md_table, median

SITES = {"a": ("a0", "a1", "a2"), "b": ("b0", "b1", "b2")}


def make_data(root: Path, per_client: int) -> None:
    """site-a/, site-b/ (clients/<client>.npz), server.npz (the test set) and all.npz (every client, one file)."""
    from fedrod_ray.config import DataConfig
    from fedrod_ray.data import load_dataset

    ds = load_dataset(DataConfig(dataset="mnist", download=False))
    tx, ty, vx, vy = (a.numpy() for a in (ds.train_x, ds.train_y, ds.test_x, ds.test_y))
    rng = np.random.default_rng(0)
    xs, ys, owners = [], [], []
    for k, (site, name) in enumerate((s, n) for s, names in SITES.items() for n in names):
        pick = np.concatenate([rng.choice(np.flatnonzero(ty == (3 * k + j) % 10), per_client // 3 + (j == 0))
                               for j in range(3)])
        (root / f"site-{site}" / "clients").mkdir(parents=True, exist_ok=True)
        np.savez(root / f"site-{site}" / "clients" / f"{name}.npz", x_train=tx[pick, 0], y_train=ty[pick])
        xs.append(tx[pick, 0])
        ys.append(ty[pick])
        owners += [name] * len(pick)
    test = np.concatenate([np.flatnonzero(vy == c)[:100] for c in range(10)])
    np.savez(root / "server.npz", x_test=vx[test, 0], y_test=vy[test])
    np.savez(root / "all.npz", x_train=np.concatenate(xs), y_train=np.concatenate(ys), x_test=vx[test, 0],
             y_test=vy[test], client_train=np.array(owners))


class Counting:
    """An executor that counts the bytes of what its ``train`` calls send and receive (pickled)."""

    def __init__(self, inner, nodes: int):
        self.inner, self.nodes, self.bytes = inner, nodes, []

    def train(self, round_idx, jobs, message):
        sent = self.nodes * len(pickle.dumps(message)) + sum(len(pickle.dumps(job)) for job in jobs)
        back = 0
        for slot, out in self.inner.train(round_idx, jobs, message):
            back += len(pickle.dumps(out))
            yield slot, out
        self.bytes.append(sent + back)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def one(mode: str, root: Path, rounds: int, head: str) -> dict:
    """One run (in this process: the head's driver and coordinator) on a cluster of its own."""
    import ray
    import torch
    from ray.cluster_utils import Cluster

    from fedrod_ray.config import config_from_dict
    from fedrod_ray.executors.ray import RayExecutor, plan_layout
    from fedrod_ray.executors.sites import SitesExecutor
    from fedrod_ray.federation_state.setup import prepare, prepare_server
    from fedrod_ray.round_loop.federation import Federation

    torch.set_num_threads(1)
    cfg = {"seed": 0, "data": {"partition": "natural", "num_clients": 6, "normalize": False},
           "train": {"head": head, "rounds": rounds, "client_fraction": 0.5, "local_epochs": 1, "batch_size": 20},
           "eval": {"eval_every": rounds + 1, "at_end": False}, "runtime": {"torch_threads": 1, "mode": "ray"}}
    if mode == "sites":
        cfg["data"].update(dataset="sites", path=str(root / "server.npz"))
        cfg["sites"] = [{"name": s, "path": str(root / f"site-{s}"), "store": str(root / "stores" / s)} for s in SITES]
    else:
        cfg["data"].update(dataset="arrays", path=str(root / "all.npz"))
    if head == "ditto":
        cfg["train"]["balanced_loss"] = "ce"
    cfg = config_from_dict(cfg)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for site in SITES:
            cluster.add_node(num_cpus=1, labels={"fedrod.site": site})
        ray.init(address=cluster.address, log_to_driver=False)
        if mode == "sites":
            inner = SitesExecutor(prepare_server(cfg), log=lambda s: None)
            setup = inner.setup
        else:
            setup = prepare(cfg)
            inner = RayExecutor(setup, plan_layout(cfg.runtime, 6, ray.cluster_resources()), log=lambda s: None)
        executor = Counting(inner, nodes=len(SITES))
        fed = Federation(setup, executor, log=lambda s: None)
        seconds = []
        for r in range(rounds):
            t0 = time.perf_counter()
            fed.step(r)
            seconds.append(time.perf_counter() - t0)
        model_bytes = sum(v.numel() * v.element_size() for v in fed.global_shared.values())
        inner.close()
    finally:
        ray.shutdown()
        cluster.shutdown()
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return {"seconds": median(seconds[1:]), "head_mb": hwm / 1024, "bytes": median(executor.bytes),
            "model_bytes": model_bytes, "clients": 3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--per-client", type=int, default=40)
    p.add_argument("--scale", type=int, default=10)
    p.add_argument("--head", default="hyper", help="train.head (ditto: a method whose clients keep a whole model)")
    p.add_argument("--one", nargs=2, metavar=("MODE", "ROOT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one[0], Path(args.one[1]), args.rounds, args.head)), flush=True)
        return
    print(machine_note())
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-sites-") as tmp:
        for scale in sorted({1, args.scale}):
            root = Path(tmp) / f"x{scale}"
            make_data(root, args.per_client * scale)
            for mode in ("default", "sites"):
                env = {**os.environ, "RAY_TMPDIR": tempfile.mkdtemp(prefix="bs-", dir="/tmp")}
                proc = subprocess.run([sys.executable, __file__, "--rounds", str(args.rounds), "--head", args.head,
                                       "--one", mode, str(root)], check=True, capture_output=True, text=True, env=env)
                line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
                results[mode, scale] = json.loads(line[len("RESULT "):])
    rows = []
    for scale in sorted({1, args.scale}):
        d, s = results["default", scale], results["sites", scale]
        for mode, r in (("default", d), ("sites", s)):
            rows.append([f"{mode}, {args.head}, {args.per_client * scale} images/client", f"{r['seconds']:.3f}",
                         f"{r['seconds'] / d['seconds']:.2f}", f"{r['head_mb']:.0f}",
                         f"{r['bytes'] / 1e6:.2f}", f"{r['bytes'] / (r['model_bytes'] * r['clients']):.2f}"])
    print(md_table("job|s / round|vs default|head peak MB|MB / round|bytes / (model x clients)", rows))


if __name__ == "__main__":
    main()
