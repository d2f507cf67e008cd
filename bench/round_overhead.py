"""Ray overhead: seconds per round on Ray vs in-process, against a perfect-parallel floor; memory; startup.

The round: MNIST, 5 local epochs, batch 40, Fed-RoD (linear) unless ``--method``, evaluation off
(``eval.eval_every`` beyond the last round) and checkpointing as configured by default, i.e. a
checkpoint after EVERY round (``runtime.checkpoint_every: 1``), which the round times include.
Each configuration runs one warm-up round (round 0) and then rounds 1..``--rounds``; every
configuration trains the same rounds, hence the same sampled clients (sampling is a function of
(seed, round) only). The table gives the median seconds per round as seen by the driver.

Setup A (``--clients`` 100 clients of ~600 examples, ``--fraction`` 0.2 = 20 per round, IID unless
``--partition dirichlet``):
  (a) in-process runner (``Federation`` + ``InProcessExecutor``), 2 torch threads;
  (b) in-process runner, 1 torch thread -- also times every client update: the floor of a round is
      (sum of its clients' 1-thread update seconds) / 2 cores;
  (c) the Ray runtime as ``fedrod-ray train --mode ray`` runs it (``Coordinator`` actor, ``plan_layout``'s
      default layout: 2 actors per core = 4 actors x 25 clients, 1 thread each, at most 2 in flight).
Setup B (20 clients of 600 examples = the first 12,000 MNIST training images, all 20 train every
round), because 100 one-client actors do not fit in memory on a small machine:
  (a20)/(b20) the in-process runner with 2 / 1 threads on that setup;
  (d) Ray with ``runtime.clients_per_actor=1`` and ``runtime.client_resources={num_cpus: 0.1}``: 20 actors.
      Same coordinator code as the library's, only fed the 12,000-image subset.

Ray runs in this process with ``ray.init(address="local", num_cpus=2, include_dashboard=False)``.
After the Ray rounds the script records (from ``ray.timeline()``) how long each ``ClientActorImpl.train``
call took inside the actors, and the RSS and PSS (psutil ``memory_full_info``) of every Ray process
(gcs_server, raylet, agents, the coordinator and the client-actor workers: all descendants of this
driver) with the actors of (c) and of (d) alive; the driver is reported separately. A what-if table
replays RayExecutor.train's scheduling policy on (b)'s measured update times for more, smaller actors.
Startup: seconds from ``ray.init`` to the end of the coordinator's construction (``RayExecutor`` built,
actors ready = when the first round can start), and, separately, from launching
``fedrod-ray train --mode ray`` as a subprocess to its "ready" line (the subprocess is then interrupted).

Run by hand, with nothing else heavy running (~11 minutes on 2 cores; ~10 GiB RSS at peak, with (d)'s actors):

    FEDROD_DATA_DIR=/work/shared/data python bench/round_overhead.py
    FEDROD_DATA_DIR=/work/shared/data python bench/round_overhead.py --quick   # smoke run, ~1.5 minutes
    # optional: --py-spy /tmp/spy.txt (stack dumps during one extra, untimed Ray round), --partition dirichlet

Do not edit fedrod_ray/ while it runs: Ray workers import the library afresh, and a class that changed
under the driver fails to load in them.

Without real MNIST it prints a note and uses synthetic 1x28x28 data of MNIST's size.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # before anything imports ray

import argparse
import dataclasses
import heapq
import importlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch
from _common import machine_note, make_config, md_table, median, mnist_data_section

from fedrod_ray.config import ExperimentConfig, config_from_dict
from fedrod_ray.coordinator import Coordinator, CoordinatorImpl, RayExecutor, plan_layout
from fedrod_ray.federation import Federation, InProcessExecutor, Setup, make_host, prepare
from fedrod_ray.partition import make_partition
from fedrod_ray.server import sample_clients
from fedrod_ray.storage import RunStorage

psutil = importlib.import_module("psutil")  # ray's vendored copy (ray/thirdparty_files): after `import ray`

METHODS = {
    "fedavg": ("fedavg", "linear"),
    "fedrod_linear": ("fedrod", "linear"),
    "fedrod_hyper": ("fedrod", "hyper"),
}
BIG = 10**6  # train.rounds and eval.eval_every: evaluation (and the final round's extras) never happen
REPO = Path(__file__).resolve().parents[1]


# --- setups --------------------------------------------------------------------------------------------


def build_config(args, data: dict, num_clients: int, fraction: float, **runtime) -> ExperimentConfig:
    algorithm, variant = METHODS[args.method]
    return make_config(
        data | {"num_clients": num_clients, "partition": args.partition, "alpha": args.alpha},
        name="round_overhead",
        seed=args.seed,
        train={
            "algorithm": algorithm,
            "variant": variant,
            "rounds": BIG,
            "client_fraction": fraction,
            "local_epochs": args.epochs,
            "batch_size": args.batch_size,
        },
        eval={"eval_every": BIG},
        runtime=runtime,  # checkpoint_every stays at its default: 1
    )


def subset_setup(cfg: ExperimentConfig, train_limit: int | None) -> Setup:
    """``prepare(cfg)``, with only the first ``train_limit`` training images partitioned over the clients."""
    setup = prepare(cfg)
    if not train_limit:
        return setup
    ds = setup.dataset
    ds = dataclasses.replace(
        ds, train_x=ds.train_x[:train_limit].contiguous(), train_y=ds.train_y[:train_limit].contiguous()
    )
    part = make_partition(cfg.data, ds.train_y.numpy(), ds.num_classes, cfg.seed)
    return dataclasses.replace(setup, dataset=ds, partition=part)


class SubsetCoordinatorImpl(CoordinatorImpl):
    """The library's coordinator (same layout, executor and round loop), on a subset of the images."""

    def __init__(self, cfg_dict: dict, storage_uri: str, train_limit: int | None):
        self.cfg = config_from_dict(cfg_dict)
        torch.set_num_threads(max(1, self.cfg.runtime.torch_threads or 1))
        self.storage = RunStorage(storage_uri)
        self.setup = subset_setup(self.cfg, train_limit)
        self.layout = plan_layout(self.cfg.runtime, len(self.setup.all_client_ids), ray.cluster_resources())
        self.executor = RayExecutor(self.setup, self.storage, self.layout)
        self.federation = Federation(self.setup, self.executor, self.storage, log=print)
        self.federation.start()


SubsetCoordinator = ray.remote(SubsetCoordinatorImpl)


# --- in-process runs -----------------------------------------------------------------------------------


class TimedExecutor(InProcessExecutor):
    """The in-process executor, also recording the seconds of every client update."""

    def __init__(self, host):
        super().__init__(host)
        self.update_seconds: dict[tuple[int, int], float] = {}

    def train(self, round_idx, client_ids, global_shared):
        for slot, cid in enumerate(client_ids):
            t0 = time.perf_counter()
            result = self.host.train(cid, global_shared, round_idx)
            self.update_seconds[round_idx, cid] = time.perf_counter() - t0
            yield slot, result


@dataclasses.dataclass
class RunTimes:
    walls: dict[int, float]  # round -> seconds seen by the driver (includes the checkpoint)
    trains: dict[int, float]  # round -> the record's train_seconds (local training + aggregation)
    updates: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)  # (round, client) -> s
    windows: dict[int, tuple[float, float]] = dataclasses.field(default_factory=dict)  # round -> epoch s


def run_inprocess(setup: Setup, threads: int, rounds: int, workdir: Path, label: str) -> RunTimes:
    torch.set_num_threads(threads)
    executor = TimedExecutor(make_host(setup, setup.all_client_ids))
    fed = Federation(setup, executor, RunStorage(str(workdir / label)), log=lambda s: None)
    fed.start()
    out = RunTimes({}, {})
    for r in range(rounds + 1):
        t0 = time.perf_counter()
        rec = fed.run_round(r)
        out.walls[r], out.trains[r] = time.perf_counter() - t0, rec["train_seconds"]
        print(f"  {label}: round {r}{' (warm-up)' if r == 0 else ''} {out.walls[r]:.1f}s", flush=True)
    out.updates = executor.update_seconds
    return out


# --- Ray runs ------------------------------------------------------------------------------------------


def classify(proc: psutil.Process) -> str:
    cmd = " ".join(proc.cmdline())
    if "ray::ClientActor" in cmd:
        return "client actor workers"
    if "Coordinator" in cmd and cmd.startswith("ray::"):
        return "coordinator worker"
    if cmd.startswith("ray::IDLE"):
        return "idle workers"
    if "gcs_server" in cmd:
        return "gcs_server"
    if "raylet" in proc.name():
        return "raylet"
    return "other (agents, monitors)"


def ray_memory() -> dict:
    """RSS and PSS (bytes) of this driver's descendants (the Ray processes it started), by kind."""
    groups: dict[str, list[int]] = {}
    for p in psutil.Process().children(recursive=True):
        try:
            kind = classify(p)
            info = p.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        g = groups.setdefault(kind, [0, 0, 0])
        g[0] += 1
        g[1] += info.rss
        g[2] += info.pss
    drv = psutil.Process().memory_full_info()
    return {"groups": groups, "driver": (drv.rss, drv.pss)}


def run_ray(
    cfg: ExperimentConfig, rounds: int, workdir: Path, label: str, train_limit: int | None, on_round=None
) -> tuple[RunTimes, dict, float, dict]:
    storage = RunStorage(str(workdir / label))
    t0 = time.perf_counter()
    if train_limit is None:
        # Exactly what fedrod_ray.ray_runtime.run_ray starts.
        coord = Coordinator.options(num_cpus=0, max_restarts=0).remote(cfg.to_dict(), storage.uri, False)
    else:
        coord = SubsetCoordinator.options(num_cpus=0, max_restarts=0).remote(
            cfg.to_dict(), storage.uri, train_limit
        )
    info = ray.get(coord.info.remote())
    ready = time.perf_counter() - t0
    print(
        f"  {label}: {info['num_actors']} actor(s) x {info['clients_per_actor']} client(s), "
        f"{info['max_in_flight']} in flight; ready in {ready:.1f}s",
        flush=True,
    )
    out = RunTimes({}, {})
    for r in range(rounds + 1):
        w0, t0 = time.time(), time.perf_counter()
        rec = ray.get(coord.run_round.remote(r))
        out.walls[r], out.trains[r] = time.perf_counter() - t0, rec["train_seconds"]
        out.windows[r] = (w0, time.time())
        print(f"  {label}: round {r}{' (warm-up)' if r == 0 else ''} {out.walls[r]:.1f}s", flush=True)
    mem = ray_memory()
    if on_round is not None:
        # One more, untimed round to take stack dumps from (py-spy pauses the processes it reads).
        ref = coord.run_round.remote(rounds + 1)
        on_round(ref)
        ray.get(ref)
    ray.get(coord.finish.remote())
    ray.kill(coord)
    return out, info, ready, mem


def actor_calls(windows: dict[int, tuple[float, float]]) -> dict[int, list[tuple[str, float, float]]]:
    """Per round, the ClientActorImpl.train calls as (worker, start, seconds), from ray.timeline()."""
    try:
        events = ray.timeline()
    except Exception as e:  # noqa: BLE001 - diagnostics only
        print(f"  (ray.timeline() failed: {e}; no per-call figures)")
        return {}
    out: dict[int, list[tuple[str, float, float]]] = {r: [] for r in windows}
    for ev in events:
        if ev.get("cat") != "task::ClientActorImpl.train" or ev.get("ph") != "X":
            continue
        start, dur = ev["ts"] / 1e6, ev["dur"] / 1e6
        for r, (w0, w1) in windows.items():
            if w0 <= start <= w1:
                out[r].append((ev["tid"], start, dur))
    return out


def py_spy_dumps(label: str, note_file: Path, ref, at=(2.0, 8.0, 14.0)) -> None:
    """While the round ``ref`` runs, dump the coordinator's and client actors' Python stacks at ``at`` s."""
    t0 = time.perf_counter()
    for i, t in enumerate(at):
        ready, _ = ray.wait([ref], timeout=max(0.0, t - (time.perf_counter() - t0)))
        if ready:
            return
        py_spy_dump(f"{label}, {t:.0f}s into the round", note_file)


def py_spy_dump(label: str, note_file: Path) -> None:
    """Dump the Python stacks of the coordinator and client-actor workers, appended to a file."""
    exe = shutil.which("py-spy")
    if exe is None:
        print("  (py-spy not found; no stack dumps)")
        return
    with note_file.open("a") as f:
        for p in psutil.Process().children(recursive=True):
            try:
                kind = classify(p)
            except psutil.Error:
                continue
            if kind not in ("client actor workers", "coordinator worker"):
                continue
            res = subprocess.run(
                [exe, "dump", "--pid", str(p.pid)], check=False, capture_output=True, text=True, timeout=60
            )
            f.write(f"==== {label}: {kind} pid {p.pid}\n{res.stdout}{res.stderr}\n")


def simulate_round(
    ids: list[int], seconds: dict[int, float], home: dict[int, int], max_in_flight: int
) -> float:
    """Makespan of one round under RayExecutor.train's policy (at most ``max_in_flight`` calls, one per actor;
    a freed slot goes to the idle actor with the longest queue), with zero overhead per call."""
    queues: dict[int, list[int]] = {}
    for cid in ids:
        queues.setdefault(home[cid], []).append(cid)
    running: list[tuple[float, int]] = []
    busy: set[int] = set()
    now = 0.0

    def launch() -> None:
        while len(running) < max_in_flight:
            idle = [a for a in queues if queues[a] and a not in busy]
            if not idle:
                return
            a = max(idle, key=lambda k: len(queues[k]))
            heapq.heappush(running, (now + seconds[queues[a].pop(0)], a))
            busy.add(a)

    launch()
    while running:
        now, a = heapq.heappop(running)
        busy.discard(a)
        launch()
    return now


# --- startup of the CLI --------------------------------------------------------------------------------


def cli_startup(args, data: dict, workdir: Path) -> tuple[float | None, str]:
    """Seconds from launching ``fedrod-ray train --mode ray`` to its 'ready' line; then interrupt it."""
    exe = shutil.which("fedrod-ray")
    cmd = [exe] if exe else [sys.executable, "-m", "fedrod_ray.cli"]
    algorithm, variant = METHODS[args.method]
    sets = {
        "data.num_clients": args.clients,
        "data.partition": args.partition,
        "data.alpha": args.alpha,
        "train.rounds": BIG,
        "eval.eval_every": BIG,
        "runtime.checkpoint_every": 1,
        "train.local_epochs": args.epochs,
        "train.algorithm": algorithm,
        "train.variant": variant,
        "train.client_fraction": args.fraction,
        "seed": args.seed,
    }
    sets.update({f"data.{k}": v for k, v in data.items()})
    cmd += [
        "train",
        "--config",
        str(REPO / "configs" / "mnist_paper.yaml"),
        "--mode",
        "ray",
        "--run-dir",
        str(workdir / "cli_startup"),
    ]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    ready_line, seconds, lines = "", None, []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("ray:") and "ready in" in line:
            seconds, ready_line = time.perf_counter() - t0, line.strip()
            break
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # the driver's finally: kills the coordinator, ray.shutdown()
    try:
        proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
    for p in descendants:  # anything the interrupted driver left behind (only processes it started)
        try:
            if p.is_running():
                p.terminate()
        except psutil.Error:
            pass
    psutil.wait_procs(descendants, timeout=10)
    if seconds is None:
        print("  CLI startup: no 'ready' line; its output:\n" + "".join(lines[-20:]))
    return seconds, ready_line


# --- reporting -----------------------------------------------------------------------------------------


def f1(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def ratio(x: float | None, y: float | None) -> str:
    return "-" if x is None or not y else f"{x / y:.2f}x"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data-dir", help="directory holding mnist/ (default: $FEDROD_DATA_DIR, then the cache dir)"
    )
    p.add_argument("--method", default="fedrod_linear", choices=list(METHODS))
    p.add_argument("--partition", default="iid", choices=["iid", "dirichlet"])
    p.add_argument("--alpha", type=float, default=0.1, help="Dirichlet alpha (with --partition dirichlet)")
    p.add_argument("--clients", type=int, default=100, help="setup A: clients")
    p.add_argument("--fraction", type=float, default=0.2, help="setup A: fraction sampled per round")
    p.add_argument("--small-clients", type=int, default=20, help="setup B: clients (= actors in (d))")
    p.add_argument("--examples", type=int, default=600, help="setup B: examples per client")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--skip", nargs="*", default=[], choices=["cli-startup", "setup-b"], help="parts to leave out"
    )
    p.add_argument(
        "--py-spy",
        metavar="FILE",
        help="after the timed rounds of (c) and (d), run one more (untimed) round and append py-spy "
        "dumps of the coordinator and client-actor workers taken during it to FILE",
    )
    p.add_argument("--workdir", help="where the runs' checkpoints go (default: a temporary directory)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1 epoch, 1 timed round, 2 clients per round, 4 one-client actors",
    )
    args = p.parse_args()
    if args.quick:
        args.epochs, args.rounds, args.fraction, args.small_clients = 1, 1, 0.02, 4
    tmp = tempfile.TemporaryDirectory(prefix="bench-overhead-") if args.workdir is None else None
    workdir = Path(args.workdir or tmp.name)
    workdir.mkdir(parents=True, exist_ok=True)

    data = mnist_data_section(args.data_dir)
    print(machine_note())
    part = "IID" if args.partition == "iid" else f"Dir({args.alpha:g})"
    rounds = list(range(1, args.rounds + 1))

    cli_s, cli_line = None, ""
    if "cli-startup" not in args.skip:
        print("CLI startup: fedrod-ray train --mode ray (interrupted once ready)", flush=True)
        cli_s, cli_line = cli_startup(args, data, workdir)
        print(f"  {cli_s and round(cli_s, 1)}s: {cli_line}", flush=True)

    # In-process runs first (no Ray processes alive), then Ray.
    cfg_a = build_config(args, data, args.clients, args.fraction)
    setup_a = subset_setup(cfg_a, None)
    runs: dict[str, RunTimes] = {}
    runs["a"] = run_inprocess(setup_a, 2, args.rounds, workdir, "a_inproc_2thr")
    runs["b"] = run_inprocess(setup_a, 1, args.rounds, workdir, "b_inproc_1thr")
    limit = args.small_clients * args.examples
    cfg_b = build_config(
        args, data, args.small_clients, 1.0, clients_per_actor=1, client_resources={"num_cpus": 0.1}
    )
    if "setup-b" not in args.skip:
        setup_b = subset_setup(cfg_b, limit)
        runs["a20"] = run_inprocess(setup_b, 2, args.rounds, workdir, "a20_inproc_2thr")
        runs["b20"] = run_inprocess(setup_b, 1, args.rounds, workdir, "b20_inproc_1thr")

    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    init_s = time.perf_counter() - t0
    print(f"ray.init: {init_s:.1f}s; cluster {ray.cluster_resources()}", flush=True)
    mem_idle = ray_memory()
    spy = (lambda label: lambda ref: py_spy_dumps(label, Path(args.py_spy), ref)) if args.py_spy else None
    infos, readies, mems, calls = {}, {}, {}, {}
    try:
        runs["c"], infos["c"], readies["c"], mems["c"] = run_ray(
            cfg_a, args.rounds, workdir, "c_ray_default", None, spy and spy("c")
        )
        calls["c"] = actor_calls({r: runs["c"].windows[r] for r in rounds})
        if "setup-b" not in args.skip:
            runs["d"], infos["d"], readies["d"], mems["d"] = run_ray(
                cfg_b, args.rounds, workdir, "d_ray_1client_actors", limit, spy and spy("d")
            )
            calls["d"] = actor_calls({r: runs["d"].windows[r] for r in rounds})
    finally:
        ray.shutdown()

    # --- round table ---
    def ids_of(cfg: ExperimentConfig, setup: Setup, r: int) -> list[int]:
        return sample_clients(cfg.seed, r, setup.num_clients, cfg.train.client_fraction)

    def floors(one_thread: RunTimes, cfg, setup) -> dict[int, float]:
        return {r: sum(one_thread.updates[r, c] for c in ids_of(cfg, setup, r)) / 2 for r in rounds}

    layout_c = plan_layout(cfg_a.runtime, len(setup_a.all_client_ids), {"CPU": 2.0})
    home = {c: a for a, ids in enumerate(layout_c.assignment(setup_a.all_client_ids)) for c in ids}

    def pinned_floor(r: int) -> float:
        per_actor: dict[int, float] = {}
        for c in ids_of(cfg_a, setup_a, r):
            per_actor[home[c]] = per_actor.get(home[c], 0.0) + runs["b"].updates[r, c]
        # An actor trains one client at a time, and at most 2 train at once (2 cores).
        return max(max(per_actor.values()), sum(per_actor.values()) / 2)

    def med(run: RunTimes) -> float:
        return median([run.walls[r] for r in rounds])

    def other(run: RunTimes) -> float:
        return median([run.walls[r] - run.trains[r] for r in rounds])

    def vs(run: RunTimes, fl: dict[int, float]) -> str:
        return f"{median([run.walls[r] / fl[r] for r in rounds]):.2f}x"

    groups = [("A", cfg_a, setup_a, ["a", "b", "c"], "a", "b")]
    if "setup-b" not in args.skip:
        groups.append(("B", cfg_b, setup_b, ["a20", "b20", "d"], "a20", "b20"))
    names = {
        "a": "(a) in-process, 2 threads",
        "b": "(b) in-process, 1 thread",
        "c": f"(c) Ray default layout: {infos['c']['num_actors']} actors x {infos['c']['clients_per_actor']} "
        f"clients, 1 thread each, {infos['c']['max_in_flight']} in flight",
        "a20": "(a20) in-process, 2 threads",
        "b20": "(b20) in-process, 1 thread",
        "d": (
            f"(d) Ray clients_per_actor=1, num_cpus 0.1: {infos['d']['num_actors']} actors, "
            f"{infos['d']['max_in_flight']} in flight"
        )
        if "d" in infos
        else "",
    }
    rows = []
    for g, cfg, setup, keys, base2, base1 in groups:
        fl = floors(runs[base1], cfg, setup)
        sizes = [len(setup.partition.client_indices[c]) for c in range(setup.num_clients)]
        per_round = len(ids_of(cfg, setup, 1))
        desc = (
            f"{g}: {setup.num_clients} clients x ~{round(sum(sizes) / len(sizes))} ({part}), "
            f"{per_round}/round"
        )
        for k in keys:
            run = runs[k]
            rows.append(
                [
                    desc,
                    names[k],
                    f"{med(run):.1f}",
                    f"{other(run):.2f}",
                    ratio(med(run), med(runs[base2])),
                    f"{median(list(fl.values())):.1f}",
                    vs(run, fl),
                ]
            )
        if g == "A":
            pf = {r: pinned_floor(r) for r in rounds}
            rows.append(
                [
                    desc,
                    "  pinned floor of (c): max(busiest actor's 1-thread seconds, all / 2 cores)",
                    f"{median(list(pf.values())):.1f}",
                    "-",
                    ratio(median(list(pf.values())), med(runs["a"])),
                    f"{median(list(fl.values())):.1f}",
                    f"{median([pf[r] / fl[r] for r in rounds]):.2f}x",
                ]
            )
    headers = [
        "setup",
        "runner",
        "s / round (median)",
        "ckpt + other s",
        "vs in-process 2 thr (same setup)",
        "floor s",
        "vs floor",
    ]

    # --- per-call table (inside the actors) ---
    # --- what-if: the executor's policy with more, smaller actors (setup A, (b)'s 1-thread update times) ---
    sim_rows = []
    fl_a = floors(runs["b"], cfg_a, setup_a)
    for num_actors in sorted({2, 4, 5, 10, 20, setup_a.num_clients} & set(range(1, setup_a.num_clients + 1))):
        rt = dataclasses.replace(cfg_a.runtime, clients_per_actor=-(-setup_a.num_clients // num_actors))
        lay = plan_layout(rt, setup_a.num_clients, {"CPU": 2.0})
        h = {c: a for a, ids in enumerate(lay.assignment(setup_a.all_client_ids)) for c in ids}
        spans = {
            r: simulate_round(
                ids_of(cfg_a, setup_a, r),
                {c: runs["b"].updates[r, c] for c in ids_of(cfg_a, setup_a, r)},
                h,
                lay.max_in_flight,
            )
            for r in rounds
        }
        sim_rows.append(
            [
                f"{lay.num_actors} x {lay.clients_per_actor}",
                lay.max_in_flight,
                f"{median(list(spans.values())):.1f}",
                f"{median([spans[r] / fl_a[r] for r in rounds]):.2f}x",
                " ".join(f"{spans[r]:.1f}" for r in rounds),
            ]
        )

    call_rows = []
    for k, (cfg, setup, base1) in {
        "c": (cfg_a, setup_a, "b"),
        "d": (cfg_b, setup_b if "d" in runs else None, "b20"),
    }.items():
        if k not in calls or not calls[k]:
            continue
        durs = [d for r in rounds for (_, _, d) in calls[k][r]]
        inproc = [runs[base1].updates[r, c] for r in rounds for c in ids_of(cfg, setup, r)]
        busy = []
        for r in rounds:
            per_worker: dict[str, float] = {}
            for tid, _, d in calls[k][r]:
                per_worker[tid] = per_worker.get(tid, 0.0) + d
            busy.append((sum(per_worker.values()) / 2, max(per_worker.values()), runs[k].walls[r]))
        call_rows.append(
            [
                names[k].split(":")[0],
                len(durs) // len(rounds),
                f"{median(durs):.2f}",
                f"{median(inproc):.2f}",
                ratio(median(durs), median(inproc)),
                f"{median([b[0] for b in busy]):.1f}",
                f"{median([b[1] for b in busy]):.1f}",
                f"{median([b[2] - b[1] for b in busy]):.1f}",
            ]
        )
    call_headers = [
        "runner",
        "train calls / round",
        "s / call in actor (median)",
        "s / update in-process 1 thr",
        "actor vs in-process",
        "sum of calls / 2 s",
        "busiest actor s",
        "round - busiest actor s",
    ]

    # --- memory table ---
    mb = 1 / 2**20
    kinds = [
        "client actor workers",
        "coordinator worker",
        "idle workers",
        "raylet",
        "gcs_server",
        "other (agents, monitors)",
    ]
    mem_cols = [("Ray idle (no actors)", mem_idle, None)]
    if "c" in mems:
        mem_cols.append(
            (
                f"(c) {infos['c']['num_actors']} actors x {infos['c']['clients_per_actor']} clients",
                mems["c"],
                setup_a.num_clients,
            )
        )
    if "d" in mems:
        mem_cols.append((f"(d) {infos['d']['num_actors']} one-client actors", mems["d"], setup_b.num_clients))
    mem_rows = []
    for kind in kinds:
        row = [kind]
        for _, m, _ in mem_cols:
            n, rss, pss = m["groups"].get(kind, [0, 0, 0])
            row.append(f"{n} / {rss * mb:,.0f} / {pss * mb:,.0f}" if n else "-")
        mem_rows.append(row)
    total_row, per_client_row, driver_row = (
        ["**all Ray processes**"],
        ["per client (all Ray processes)"],
        ["driver"],
    )
    for _, m, nclients in mem_cols:
        n = sum(g[0] for g in m["groups"].values())
        rss = sum(g[1] for g in m["groups"].values())
        pss = sum(g[2] for g in m["groups"].values())
        total_row.append(f"**{n} / {rss * mb:,.0f} / {pss * mb:,.0f}**")
        per_client_row.append(
            f"- / {rss * mb / nclients:,.1f} / {pss * mb / nclients:,.1f}" if nclients else "-"
        )
        driver_row.append(f"1 / {m['driver'][0] * mb:,.0f} / {m['driver'][1] * mb:,.0f}")
    mem_rows += [total_row, per_client_row, driver_row]

    # --- startup table ---
    start_rows = [
        ["ray.init(address='local', num_cpus=2) in this process", f"{init_s:.1f}"],
        [
            (
                f"coordinator + RayExecutor construction, (c) {infos['c']['num_actors']} actors "
                "(until the first round can start)"
            ),
            f"{readies['c']:.1f}",
        ],
        ["ray.init -> first round start, (c)", f"{init_s + readies['c']:.1f}"],
    ]
    if "d" in readies:
        start_rows.append(
            [
                f"coordinator + RayExecutor construction, (d) {infos['d']['num_actors']} actors",
                f"{readies['d']:.1f}",
            ]
        )
    if "cli-startup" not in args.skip:
        start_rows.append(
            ["launch `fedrod-ray train --mode ray` (subprocess) -> its 'ready' line, default layout", f1(cli_s)]
        )
        if cli_line:
            start_rows.append([f'  of which the CLI\'s own figure: "{cli_line}"', "-"])

    print()
    print(
        f"### Seconds per round ({args.method}, MNIST-shaped, {args.epochs} local epochs, batch {args.batch_size}; "
        f"median of rounds {rounds[0]}..{rounds[-1]} after warm-up round 0; evaluation off; "
        "a checkpoint after every round (runtime.checkpoint_every=1, the default) is included)\n"
    )
    print(md_table(headers, rows, [False, False] + [True] * 5))
    print(
        "\nfloor = (sum over the round's clients of their 1-thread update seconds, measured in (b) / (b20)) / 2 "
        "cores; ckpt + other = driver's round time minus the record's train_seconds (training + aggregation); "
        "setup B = the first "
        f"{limit:,} training images over {args.small_clients} clients, all training every round, because "
        f"{args.clients} one-client actors would not fit in memory here."
    )
    if call_rows:
        print("\n### Inside the Ray rounds (from ray.timeline(): ClientActorImpl.train calls)\n")
        print(md_table(call_headers, call_rows))
    print(
        "\n### What-if: RayExecutor.train's scheduling with more, smaller actors (setup A; simulated from (b)'s "
        "1-thread update times, zero per-call overhead)\n"
    )
    print(
        md_table(["actors x clients", "in flight", "s / round (median)", "vs floor", "per round s"], sim_rows)
    )
    print(
        "\n### Memory of the Ray processes (count / RSS MB / PSS MB; descendants of this driver, after the "
        "timed rounds)\n"
    )
    print(md_table(["process kind"] + [c[0] for c in mem_cols], mem_rows))
    print("\n### Startup\n")
    print(md_table(["step", "seconds"], start_rows))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
