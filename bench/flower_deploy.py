"""fedrod-ray's Ray runtime against Flower 1.42's deployment engine on the same FMNIST job: seconds per round
and bytes per round between the server side and the clients.

The job is bench/flower_compare.py's (Fashion-MNIST, 100 clients, Dir(0.3), 10 a round, FedAvg, 5 local epochs,
one torch thread per client), without evaluation; both checkpoint every round, as a run does.

- Flower: a SuperLink and three SuperNodes as separate processes on loopback, started as tests/test_flower.py
  starts them (tests/flower_federation.py), each holding a third of the clients (``fedrod_ray_flower.split``)
  and running the repository's ClientApp; the ServerApp is the repository's, with a grid that counts
  (``_flower_wire``).
- Ray: the same round loop (``Run`` over ``Federation``) over fedrod-ray's Ray executor, its client actors on a
  private Ray of 2 CPUs, in this process and wrapped to count (``fedrod-ray train --mode ray`` runs that loop in
  a coordinator actor instead).

Seconds per round: the run's own records (``seconds``), the median of rounds 2.. (round 1 is a warm-up).
Bytes per round: what one training round carries between the server side and the clients, as each system
serializes it, transport framing (gRPC, HTTP/2, TLS) left out:
- Flower: every message the ServerApp sends to the SuperNodes and every reply, as Flower ships them (each of
  the message's objects deflated: what the SuperLink relays to and from the SuperNodes);
- Ray: the round's message pickled (protocol 5, as Ray serializes it) once per client actor (each reads it from
  the object store once), and each client's job (its id and the state the coordinator hands it) and result.

``--secagg KEYS``: the run config keys that turn SecAgg+ on in flower/app (docs/flower.md); with them, one more
row, Flower's deployment engine with SecAgg+ (its bytes: the protocol's four exchanges a round).

    FEDROD_DATA_DIR=../shared/data python bench/flower_deploy.py --rounds 3 --secagg "secure-aggregation=true \
        secagg-num-shares=3 secagg-reconstruction-threshold=2 secagg-clipping-range=8.0 \
        secagg-quantization-range=4194304"
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import sys
import tempfile
from pathlib import Path

from _common import machine_note, md_table, median
from flower_compare import NUM_CPUS, job_config

from fedrod_ray.config import ExperimentConfig
from fedrod_ray.config.loading import dump_config

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
NODES = 3


def pickled(obj: object) -> int:
    return len(pickle.dumps(obj, protocol=5))


class CountingExecutor:
    """An executor (``fedrod_ray.executors.base``) that counts each training round's bytes on the way to and
    from ``inner``, whose ``actors`` client actors each read the round's message once."""

    def __init__(self, inner, actors: int):
        self.inner, self.actors = inner, actors
        self.rounds: dict[int, dict[str, int]] = {}

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def train(self, round_idx, jobs, message):
        count = self.rounds[round_idx] = {"sent": self.actors * pickled(message) + sum(map(pickled, jobs)),
                                          "received": 0}
        for slot, out in self.inner.train(round_idx, jobs, message):
            count["received"] += pickled(out)
            yield slot, out


def ray_side(cfg: ExperimentConfig, work: Path) -> dict:
    """Seconds and bytes of each round of ``cfg`` on fedrod-ray's Ray executor."""
    import ray

    from fedrod_ray.executors.ray import RayExecutor, plan_layout
    from fedrod_ray.federation_state.setup import prepare
    from fedrod_ray.lifecycle.run import Run
    from fedrod_ray.outputs.storage import RunStorage
    from fedrod_ray.round_loop.federation import Federation

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private Ray, as fedrod-ray's own driver starts it
    ray.init(address="local", num_cpus=NUM_CPUS, include_dashboard=False, log_to_driver=False,
             _temp_dir=tempfile.mkdtemp(prefix="fd-", dir="/tmp"))
    try:
        setup = prepare(cfg)
        layout = plan_layout(cfg.runtime, len(setup.all_client_ids), ray.cluster_resources())
        executor = CountingExecutor(RayExecutor(setup, layout, log=lambda line: None), layout.num_actors)
        try:
            records = Run(Federation(setup, executor, log=lambda line: None), RunStorage(str(work / "ray"))).train()
        finally:
            executor.close()
    finally:
        ray.shutdown()
    return {"seconds": [r["seconds"] for r in records],
            "bytes": [executor.rounds[r]["sent"] + executor.rounds[r]["received"] for r in sorted(executor.rounds)]}


def flower_app(folder: Path) -> Path:
    """flower/app with ``_flower_wire``'s ServerApp and its ``wire-log`` key."""
    folder.mkdir(parents=True)
    text = (REPO / "flower" / "app" / "pyproject.toml").read_text()
    for old, new in (('serverapp = "fedrod_ray_flower.server_app:app"', 'serverapp = "fedrod_wire_count:app"'),
                     ("[tool.flwr.app.config]\n", '[tool.flwr.app.config]\nwire-log = "wire.jsonl"\n')):
        if old not in text:
            raise RuntimeError(f"flower/app/pyproject.toml has no {old.strip()!r} line to change")
        text = text.replace(old, new)
    (folder / "pyproject.toml").write_text(text)
    shutil.copy(HERE / "_flower_wire.py", folder / "fedrod_wire_count.py")
    return folder


def flower_side(cfg: ExperimentConfig, work: Path, name: str, extra: str = "") -> dict:
    """Seconds and bytes of each round of ``cfg`` on Flower's deployment engine with ``NODES`` SuperNodes."""
    sys.path.insert(0, str(REPO / "tests"))
    from fedrod_ray_flower.split import split
    from flower_federation import FlowerFederation

    root = work / name
    root.mkdir()
    config = root / "job.yaml"
    config.write_text(dump_config(cfg))
    nodes = split(str(config), root / "nodes", NODES)
    run_dir, wire_log = root / "run", root / "wire.jsonl"
    fed = FlowerFederation(root, nodes)
    try:
        proc = fed.run(config, run_dir, timeout=3600, node_timeout=600, app=flower_app(root / "app"),
                       extra=f'wire-log="{wire_log}" {extra}')
    finally:
        fed.close()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if proc.returncode != 0 or len(records) != cfg.train.rounds:
        log = root / f"flwr-run-{run_dir.name}.log"
        raise RuntimeError(f"{name}: flwr run exited {proc.returncode}:\n{log.read_text()[-4000:]}")
    per_round = [0] * cfg.train.rounds
    for line in map(json.loads, wire_log.read_text().splitlines()):
        if line["types"] != ["query"] and line["round"] <= cfg.train.rounds:
            per_round[line["round"] - 1] += line["sent"] + line["received"]
    return {"seconds": [r["seconds"] for r in records], "bytes": per_round}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds per run; the first is a warm-up, not timed")
    p.add_argument("--secagg", metavar="KEYS", help='run config keys that turn SecAgg+ on in flower/app, e.g. '
                                                    '"secure-aggregation=true secagg-num-shares=3 '
                                                    'secagg-reconstruction-threshold=2 secagg-clipping-range=8.0 '
                                                    'secagg-quantization-range=4194304" (docs/flower.md): adds '
                                                    'the row of Flower with SecAgg+')
    args = p.parse_args()
    if args.rounds < 2:
        p.error("--rounds: at least 2 (round 1 is a warm-up)")
    cfg = job_config(args.rounds)
    cfg.data.data_dir = str(Path(cfg.data.data_dir).resolve())  # the ServerApp runs in a folder of its own
    print(machine_note())
    systems = [("fedrod-ray, Ray runtime", "no", lambda work: ray_side(cfg, work)),
               (f"Flower deployment engine, {NODES} SuperNodes", "no", lambda work: flower_side(cfg, work, "flower"))]
    if args.secagg:
        systems.append((f"Flower deployment engine, {NODES} SuperNodes", "yes",
                        lambda work: flower_side(cfg, work, "flower-secagg", args.secagg)))
    rows = []
    with tempfile.TemporaryDirectory(prefix="flower-deploy-") as work:
        for name, secagg, side in systems:
            got = side(Path(work))
            print(f"{name} (SecAgg+ {secagg}): rounds {', '.join(f'{s:.1f}' for s in got['seconds'])} s; "
                  f"{', '.join(f'{b / 2**20:.2f}' for b in got['bytes'])} MiB", flush=True)
            rows.append([name, secagg, f"{median(got['seconds'][1:]):.1f}", f"{median(got['bytes']) / 2**20:.2f}"])
    load = os.getloadavg()
    print(f"load average at the end {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}")
    print(f"\nFMNIST, 100 clients, Dir(0.3), 10 per round, FedAvg, 5 local epochs, batch 40; median of rounds "
          f"2..{args.rounds}; bytes of a training round between the server side and the clients:\n")
    print(md_table("system|SecAgg+|s / round|MiB / round", rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
