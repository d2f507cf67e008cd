"""A checkpoint on local disk against one on an S3 server, without Ray or training: what
``bench/scale.py --s3`` measures inside a federation, when a machine is too loaded for that.

A federation of ``--clients`` clients with the hyper head's MNIST model (its committed state: the client's
last local model, 438 KiB), ``--changed`` clients trained between saves, saved by ``CheckpointWriter`` as a
run saves, into a local directory and into ``s3://`` on moto's S3 server started on loopback (the tests'
server, through pyarrow's S3 filesystem), the two back to back for each save. The first save (full) is
left out of the medians.

    python bench/checkpoint_storage.py                      # 1,000 clients, 20 per save, 6 saves
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _common import machine_note, md_table
from servers import s3_server

from fedrod_ray.clients.client import ClientState
from fedrod_ray.config import config_from_dict
from fedrod_ray.federation_state.checkpoint import CheckpointWriter
from fedrod_ray.federation_state.state import Snapshot
from fedrod_ray.models import build_model
from fedrod_ray.outputs.storage import RunStorage


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--changed", type=int, default=20)
    p.add_argument("--saves", type=int, default=6)
    args = p.parse_args()
    print(machine_note())
    cfg = config_from_dict({"name": "checkpoint_storage"}, [f"data.num_clients={args.clients}", "train.head=hyper"])
    weights = {k: v for k, v in build_model("mnist_cnn", 10, (1, 28, 28), "hyper", 16, 0).state_dict().items()
               if not k.startswith("personal_head")}
    clients = {c: ClientState() for c in range(args.clients)}
    with tempfile.TemporaryDirectory() as tmp, s3_server(Path(tmp)) as env:
        os.environ.update(env)
        import boto3

        boto3.client("s3").create_bucket(Bucket="bench")
        writers = {"local": CheckpointWriter(RunStorage(f"{tmp}/run")), "s3": CheckpointWriter(RunStorage("s3://bench/run"))}
        times: dict[str, list[float]] = {k: [] for k in writers}
        for save in range(1, args.saves + 1):
            for c in range(args.changed * save, args.changed * (save + 1)):
                clients[c % args.clients] = ClientState(local_model={k: v + save for k, v in weights.items()},
                                                        rounds_trained=save)
            snap = Snapshot(save, cfg, weights, {}, dict(clients))
            for kind, writer in writers.items():
                t0 = time.perf_counter()
                writer.save(snap)
                if save > 1:
                    times[kind].append(time.perf_counter() - t0)
    local, s3 = statistics.median(times["local"]), statistics.median(times["s3"])
    print(f"\n{args.clients} clients, {args.changed} changed per save; medians of saves 2..{args.saves}:\n")
    print(md_table("clients|changed per save|s / checkpoint, local|s / checkpoint, S3 (moto)|S3 vs local",
                   [[args.clients, args.changed, f"{local:.3f}", f"{s3:.3f}", f"{s3 / local:.1f}x"]]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
