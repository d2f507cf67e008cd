"""Ray overhead: seconds per round on Ray vs in-process, against a perfect-parallel floor; memory; startup.

The round: MNIST, 5 local epochs, batch 40, Fed-RoD (linear) unless ``--method``, evaluation off
(``eval.eval_every`` beyond the last round), and a checkpoint after EVERY round as the CLI's driver
(``fedrod_ray.runner``) writes it with the default ``runtime.checkpoint_every: 1``; the round times include
it. Each configuration runs one warm-up round (round 0) and then rounds 1..``--rounds``, through
``Federation.step`` (in-process) or the ``Coordinator`` actor's ``step`` (Ray); every configuration trains
the same rounds, hence the same sampled clients (sampling is a function of (seed, round) only). The table
gives the median seconds per round as seen by the driver.

Setup A (``--clients`` 100 clients of ~600 examples, ``--fraction`` 0.2 = 20 per round, IID unless
``--partition dirichlet``):
  (a) in-process runner (``Federation`` + ``InProcessExecutor``), 2 torch threads;
  (b) in-process runner, 1 torch thread. After its rounds, each timed round's clients are trained once
      more, untimed, on a fresh ``ClientHost`` with the message their round started from, and their
      ``LocalResult.seconds`` (1 thread) give the floor of a round: (sum of its clients' seconds) / 2 cores;
  (c) the Ray runtime as ``fedrod-ray train --mode ray`` runs it (``Coordinator`` actor handed the Setup
      prepared here, ``plan_layout``'s default layout: 2 actors per core = 4 actors x 25 clients, 1 thread
      each, at most 2 in flight).
Setup B (20 clients of 600 examples = the first 12,000 MNIST training images, all 20 train every
round), because 100 one-client actors do not fit in memory on a small machine:
  (a20)/(b20) the in-process runner with 2 / 1 threads on that setup (b20 also gives B's update seconds);
  (d) Ray with ``runtime.clients_per_actor=1`` and ``runtime.client_resources={num_cpus: 0.1}``: 20 actors.
      The library's ``Coordinator``, handed the 12,000-image Setup.

Ray runs in this process with ``ray.init(address="local", num_cpus=2, include_dashboard=False)``.
After the Ray rounds the script records (from ``ray.timeline()``) how long each ``ClientActorImpl.train``
call took inside the actors, and the RSS and PSS (psutil ``memory_full_info``) of every Ray process
(gcs_server, raylet, agents, the coordinator and the client-actor workers: all descendants of this
driver) with the actors of (c) and of (d) alive; the driver is reported separately. A what-if table
replays the executor's policy (``fedrod_ray.scheduling.LongestQueueFirst``) on (b)'s update seconds for
more, smaller actors. Startup: seconds from ``ray.init`` to the end of the coordinator's construction
(from handing it the prepared Setup until ``RayExecutor`` is built and its actors are ready = when the
first round can start), and, separately, from launching ``fedrod-ray train --mode ray`` as a subprocess
to its "ready" line (the subprocess is then interrupted).

Run by hand, with nothing else heavy running (~13 minutes on 2 cores; ~10 GiB RSS at peak, with (d)'s actors):

    FEDROD_DATA_DIR=/work/shared/data python bench/round_overhead.py
    FEDROD_DATA_DIR=/work/shared/data python bench/round_overhead.py --quick   # smoke run, ~2 minutes
    # optional: --partition dirichlet, --method fedavg|fedrod_hyper, --skip cli-startup setup-b

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

from fedrod_ray.config import ExperimentConfig, dump_config
from fedrod_ray.coordinator import Coordinator, Layout, plan_layout
from fedrod_ray.federation import Federation, InProcessExecutor, Setup, make_host, prepare
from fedrod_ray.local import RoundInput
from fedrod_ray.partition import make_partition
from fedrod_ray.runner import checkpoint_due, save_federation
from fedrod_ray.scheduling import LongestQueueFirst
from fedrod_ray.server import sample_clients
from fedrod_ray.storage import RunStorage

psutil = importlib.import_module("psutil")  # ray's vendored copy (ray/thirdparty_files): after `import ray`

METHODS = {  # name -> train section; FedAvg is the one-head model with plain cross-entropy
    "fedavg": {"head": "none", "balanced_loss": "ce"},
    "fedrod_linear": {"head": "linear"},
    "fedrod_hyper": {"head": "hyper"},
}
BIG = 10**6  # train.rounds and eval.eval_every: evaluation (and the final round's extras) never happen


# --- setups --------------------------------------------------------------------------------------------


def make_setup(args, data: dict, num_clients: int, fraction: float, train_limit=None, **runtime) -> Setup:
    """``prepare`` of the bench's config; with ``train_limit``, only the first ``train_limit`` training
    images are partitioned over the clients."""
    train = {"rounds": BIG, "client_fraction": fraction, "local_epochs": args.epochs}
    cfg = make_config(
        data | {"num_clients": num_clients, "partition": args.partition, "alpha": args.alpha},
        name="round_overhead",
        seed=args.seed,
        train=METHODS[args.method] | train | {"batch_size": args.batch_size},
        eval={"eval_every": BIG},
        runtime=runtime,  # checkpoint_every stays at its default: 1
    )
    setup = prepare(cfg)
    if not train_limit:
        return setup
    ds = setup.dataset
    ds = dataclasses.replace(
        ds, train_x=ds.train_x[:train_limit].contiguous(), train_y=ds.train_y[:train_limit].contiguous()
    )
    part = make_partition(cfg.data, ds.train_y.numpy(), ds.num_classes, cfg.seed)
    return dataclasses.replace(setup, dataset=ds, partition=part)


def ids_of(setup: Setup, r: int) -> list[int]:
    return sample_clients(setup.cfg.seed, r, setup.num_clients, setup.cfg.train.client_fraction)


class RunTimes:
    def __init__(self):
        self.walls: dict[int, float] = {}  # round -> seconds seen by the driver (includes the checkpoint)
        self.trains: dict[int, float] = {}  # round -> the record's train_seconds (training + aggregation)
        self.windows: dict[int, tuple[float, float]] = {}  # round -> (start, end), epoch seconds
        self.updates: dict[tuple[int, int], float] = {}  # (round, client) -> 1-thread update seconds


def timed_rounds(label: str, setup: Setup, rounds: int, step, checkpoint) -> RunTimes:
    """Rounds 0..``rounds``, each ``step(r)`` then ``checkpoint()`` when due, as the CLI's driver does."""
    out = RunTimes()
    for r in range(rounds + 1):
        w0, t0 = time.time(), time.perf_counter()
        rec = step(r)
        if checkpoint_due(setup.cfg, r):
            checkpoint()
        out.walls[r], out.trains[r] = time.perf_counter() - t0, rec["train_seconds"]
        out.windows[r] = (w0, time.time())
        print(f"  {label}: round {r}{' (warm-up)' if r == 0 else ''} {out.walls[r]:.1f}s", flush=True)
    return out


# --- in-process runs -----------------------------------------------------------------------------------


def run_inprocess(
    setup: Setup, threads: int, rounds: int, workdir: Path, label: str, probe=False
) -> RunTimes:
    """With ``probe``, also the 1-thread seconds of every timed (round, client) update (see the docstring)."""
    torch.set_num_threads(threads)
    storage = RunStorage(str(workdir / label))
    fed = Federation(setup, InProcessExecutor(make_host(setup, setup.all_client_ids)), log=lambda s: None)
    messages: dict[int, RoundInput] = {}

    def step(r: int) -> dict:
        messages[r] = RoundInput(fed.global_shared, fed.rule.broadcast(fed.server_state))
        return fed.step(r)

    out = timed_rounds(label, setup, rounds, step, lambda: save_federation(fed, storage))
    if probe:
        torch.set_num_threads(1)
        host = make_host(setup, sorted({c for r in range(1, rounds + 1) for c in ids_of(setup, r)}))
        for r in range(1, rounds + 1):
            out.updates.update({(r, c): host.train(c, messages[r], r).seconds for c in ids_of(setup, r)})
        print(f"  {label}: {len(out.updates)} updates re-run for their seconds", flush=True)
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


MEMORY_KINDS = ("client actor workers", "coordinator worker", "idle workers", "raylet", "gcs_server")
MEMORY_KINDS += ("other (agents, monitors)",)


def ray_memory() -> dict:
    """RSS and PSS (bytes) of this driver's descendants (the Ray processes it started), by kind."""
    groups: dict[str, list[int]] = {}
    for p in psutil.Process().children(recursive=True):
        try:
            kind, info = classify(p), p.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        g = groups.setdefault(kind, [0, 0, 0])
        g[0], g[1], g[2] = g[0] + 1, g[1] + info.rss, g[2] + info.pss
    drv = psutil.Process().memory_full_info()
    return {"groups": groups, "driver": (drv.rss, drv.pss)}


def run_ray(setup: Setup, rounds: int, workdir: Path, label: str) -> tuple[RunTimes, dict, float, dict]:
    storage = RunStorage(str(workdir / label))
    t0 = time.perf_counter()
    # As fedrod_ray.ray_runtime.run_ray starts it: handed the Setup prepared in the driver.
    coord = Coordinator.options(num_cpus=0, max_restarts=0).remote(setup, storage.uri)
    info = ray.get(coord.info.remote())
    ready = time.perf_counter() - t0
    print(
        f"  {label}: {info['num_actors']} actor(s) x {info['clients_per_actor']} client(s), "
        f"{info['max_in_flight']} in flight; ready in {ready:.1f}s",
        flush=True,
    )
    step, checkpoint = coord.step.remote, coord.save_checkpoint.remote
    out = timed_rounds(
        label, setup, rounds, lambda r: ray.get(step(r)), lambda: ray.get(checkpoint(storage.uri))
    )
    mem = ray_memory()
    ray.get(coord.close.remote())
    ray.kill(coord)
    return out, info, ready, mem


def actor_calls(windows: dict[int, tuple[float, float]]) -> dict[int, list[tuple[str, float]]]:
    """Per round, the ClientActorImpl.train calls as (worker, seconds), from ray.timeline()."""
    try:
        events = ray.timeline()
    except Exception as e:  # noqa: BLE001 - diagnostics only
        print(f"  (ray.timeline() failed: {e}; no per-call figures)")
        return {}
    out: dict[int, list[tuple[str, float]]] = {r: [] for r in windows}
    for ev in events:
        if ev.get("cat") != "task::ClientActorImpl.train" or ev.get("ph") != "X":
            continue
        for r, (w0, w1) in windows.items():
            if w0 <= ev["ts"] / 1e6 <= w1:
                out[r].append((ev["tid"], ev["dur"] / 1e6))
    return out


def simulate_round(
    ids: list[int], seconds: dict[int, float], home: dict[int, int], max_in_flight: int
) -> float:
    """Makespan of one round under the Ray executor's policy (``LongestQueueFirst``, replayed on a heap of
    finish times), with zero overhead per call."""
    queues: dict[int, list[int]] = {}
    for cid in ids:
        queues.setdefault(home[cid], []).append(cid)
    policy = LongestQueueFirst(queues, max_in_flight)
    running: list[tuple[float, int]] = []
    now = 0.0
    while True:
        for a, cid in policy.take():
            heapq.heappush(running, (now + seconds[cid], a))
        if not running:
            return now
        now, a = heapq.heappop(running)
        policy.release(a)


def homes(setup: Setup, clients_per_actor: int) -> tuple[dict[int, int], Layout]:
    """Client -> actor under ``plan_layout`` on 2 CPUs, and the layout."""
    rt = dataclasses.replace(setup.cfg.runtime, clients_per_actor=clients_per_actor)
    lay = plan_layout(rt, len(setup.all_client_ids), {"CPU": 2.0})
    return {c: a for a, ids in enumerate(lay.assignment(setup.all_client_ids)) for c in ids}, lay


# --- startup of the CLI --------------------------------------------------------------------------------


def cli_startup(cfg: ExperimentConfig, workdir: Path) -> tuple[float | None, str]:
    """Seconds from launching ``fedrod-ray train --mode ray`` on setup A's config to its 'ready' line; then
    interrupt it."""
    exe = shutil.which("fedrod-ray")
    (workdir / "cli_startup.yaml").write_text(dump_config(cfg))
    cmd = [exe] if exe else [sys.executable, "-m", "fedrod_ray.cli"]
    cmd += ["train", "--config", str(workdir / "cli_startup.yaml"), "--mode", "ray"]
    cmd += ["--run-dir", str(workdir / "cli_startup")]
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


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", help="holds mnist/ (default: $FEDROD_DATA_DIR, then the cache dir)")
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
    p.add_argument("--skip", nargs="*", default=[], choices=["cli-startup", "setup-b"], help="leave out")
    p.add_argument("--workdir", help="where the runs' checkpoints go (default: a temporary directory)")
    quick = "smoke run: 1 epoch, 1 timed round, 2 clients per round, 4 one-client actors"
    p.add_argument("--quick", action="store_true", help=quick)
    args = p.parse_args()
    if args.quick:
        args.epochs, args.rounds, args.fraction, args.small_clients = 1, 1, 0.02, 4
    return args


def main() -> int:
    args = parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="bench-overhead-") if args.workdir is None else None
    workdir = Path(args.workdir or tmp.name)
    workdir.mkdir(parents=True, exist_ok=True)

    data = mnist_data_section(args.data_dir)
    print(machine_note())
    part = "IID" if args.partition == "iid" else f"Dir({args.alpha:g})"
    rounds = list(range(1, args.rounds + 1))

    # In-process runs first (no Ray processes alive), then Ray. A group: (name, setup, keys of the
    # in-process 2-thread, in-process 1-thread and Ray runs).
    limit = args.small_clients * args.examples
    setup_a = make_setup(args, data, args.clients, args.fraction)
    cli_s, cli_line = None, ""
    if "cli-startup" not in args.skip:
        print("CLI startup: fedrod-ray train --mode ray (interrupted once ready)", flush=True)
        cli_s, cli_line = cli_startup(setup_a.cfg, workdir)
        print(f"  {f1(cli_s)}s: {cli_line}", flush=True)
    groups = [("A", setup_a, ("a", "b", "c"))]
    if "setup-b" not in args.skip:
        one_client_actors = {"clients_per_actor": 1, "client_resources": {"num_cpus": 0.1}}
        setup_b = make_setup(args, data, args.small_clients, 1.0, limit, **one_client_actors)
        groups.append(("B", setup_b, ("a20", "b20", "d")))
    runs: dict[str, RunTimes] = {}
    labels = {"a": "a_inproc_2thr", "b": "b_inproc_1thr", "a20": "a20_inproc_2thr", "b20": "b20_inproc_1thr"}
    for _, setup, (k2, k1, _) in groups:
        runs[k2] = run_inprocess(setup, 2, args.rounds, workdir, labels[k2])
        runs[k1] = run_inprocess(setup, 1, args.rounds, workdir, labels[k1], probe=True)

    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    init_s = time.perf_counter() - t0
    print(f"ray.init: {init_s:.1f}s; cluster {ray.cluster_resources()}", flush=True)
    mem_idle = ray_memory()
    infos, readies, mems, calls = {}, {}, {}, {}
    try:
        for _, setup, (_, _, k) in groups:
            label = {"c": "c_ray_default", "d": "d_ray_1client_actors"}[k]
            runs[k], infos[k], readies[k], mems[k] = run_ray(setup, args.rounds, workdir, label)
            calls[k] = actor_calls({r: runs[k].windows[r] for r in rounds})
    finally:
        ray.shutdown()

    # --- round table ---
    def floors(setup: Setup, one_thread: RunTimes) -> dict[int, float]:
        return {r: sum(one_thread.updates[r, c] for c in ids_of(setup, r)) / 2 for r in rounds}

    def med(xs) -> float:
        return median(list(xs.values()) if isinstance(xs, dict) else xs)

    def vs(xs: dict[int, float], fl: dict[int, float]) -> str:
        return f"{med([xs[r] / fl[r] for r in rounds]):.2f}x"

    names = {
        "a": "(a) in-process, 2 threads",
        "b": "(b) in-process, 1 thread",
        "a20": "(a20) in-process, 2 threads",
        "b20": "(b20) in-process, 1 thread",
        "c": "(c) Ray default layout: {num_actors} actors x {clients_per_actor} clients, 1 thread each, "
        "{max_in_flight} in flight",
        "d": "(d) Ray clients_per_actor=1, num_cpus 0.1: {num_actors} actors, {max_in_flight} in flight",
    }
    names.update({k: names[k].format(**info) for k, info in infos.items()})
    rows = []
    for g, setup, (k2, k1, kr) in groups:
        fl = floors(setup, runs[k1])
        size = round(setup.partition.counts[: setup.num_clients].sum() / setup.num_clients)
        desc = f"{g}: {setup.num_clients} clients x ~{size} ({part}), {len(ids_of(setup, 1))}/round"
        base = med(runs[k2].walls)
        for k in (k2, k1, kr):
            walls, other = runs[k].walls, med([runs[k].walls[r] - runs[k].trains[r] for r in rounds])
            rows.append(
                [desc, names[k], f1(med(walls)), f"{other:.2f}", ratio(med(walls), base), f1(med(fl))]
            )
            rows[-1].append(vs(walls, fl))
        if g == "A":
            # An actor trains one client at a time, and at most 2 train at once (2 cores).
            home_c, _ = homes(setup_a, setup_a.cfg.runtime.clients_per_actor)  # (c)'s layout
            pf = {}
            for r in rounds:
                per_actor: dict[int, float] = {}
                for c in ids_of(setup_a, r):
                    per_actor[home_c[c]] = per_actor.get(home_c[c], 0.0) + runs["b"].updates[r, c]
                pf[r] = max(max(per_actor.values()), sum(per_actor.values()) / 2)
            what = "  pinned floor of (c): max(busiest actor's 1-thread seconds, all / 2 cores)"
            rows.append([desc, what, f1(med(pf)), "-", ratio(med(pf), base), f1(med(fl)), vs(pf, fl)])
    headers = (
        "setup|runner|s / round (median)|ckpt + other s|vs in-process 2 thr (same setup)|floor s|vs floor"
    )

    # --- per-call table (inside the actors) ---
    call_rows = []
    for _, setup, (_, k1, k) in groups:
        if not calls.get(k):
            continue
        durs = [d for r in rounds for (_, d) in calls[k][r]]
        inproc = med([runs[k1].updates[r, c] for r in rounds for c in ids_of(setup, r)])
        busy = []
        for r in rounds:
            per_worker: dict[str, float] = {}
            for tid, d in calls[k][r]:
                per_worker[tid] = per_worker.get(tid, 0.0) + d
            busy.append((sum(per_worker.values()) / 2, max(per_worker.values()), runs[k].walls[r]))
        call_rows.append(
            [names[k].split(":")[0], len(durs) // len(rounds), f"{med(durs):.2f}", f"{inproc:.2f}"]
        )
        call_rows[-1] += [
            ratio(med(durs), inproc),
            f1(med([b[0] for b in busy])),
            f1(med([b[1] for b in busy])),
        ]
        call_rows[-1].append(f1(med([b[2] - b[1] for b in busy])))
    call_headers = "runner|train calls / round|s / call in actor (median)|s / update in-process 1 thr|"
    call_headers += "actor vs in-process|sum of calls / 2 s|busiest actor s|round - busiest actor s"

    # --- what-if: the executor's policy with more, smaller actors (setup A, (b)'s 1-thread update times) ---
    sim_rows = []
    fl_a, n = floors(setup_a, runs["b"]), setup_a.num_clients
    for num_actors in sorted({2, 4, 5, 10, 20, n} & set(range(1, n + 1))):
        home, lay = homes(setup_a, -(-n // num_actors))
        spans = {}
        for r in rounds:
            ids = ids_of(setup_a, r)
            spans[r] = simulate_round(ids, {c: runs["b"].updates[r, c] for c in ids}, home, lay.max_in_flight)
        per_round = " ".join(f1(spans[r]) for r in rounds)
        sim_rows.append([f"{lay.num_actors} x {lay.clients_per_actor}", lay.max_in_flight, f1(med(spans))])
        sim_rows[-1] += [vs(spans, fl_a), per_round]

    # --- memory table ---
    mb = 1 / 2**20
    mem_cols = [("Ray idle (no actors)", mem_idle, None)]
    for _, setup, (_, _, k) in groups:
        a, per = infos[k]["num_actors"], infos[k]["clients_per_actor"]
        title = f"(c) {a} actors x {per} clients" if k == "c" else f"(d) {a} one-client actors"
        mem_cols.append((title, mems[k], setup.num_clients))
    mem_rows = []
    for kind in MEMORY_KINDS:
        row = [kind]
        for _, m, _ in mem_cols:
            cnt, rss, pss = m["groups"].get(kind, [0, 0, 0])
            row.append(f"{cnt} / {rss * mb:,.0f} / {pss * mb:,.0f}" if cnt else "-")
        mem_rows.append(row)
    total, per_client, driver = ["**all Ray processes**"], ["per client (all Ray processes)"], ["driver"]
    for _, m, nclients in mem_cols:
        cnt, rss, pss = (sum(g[i] for g in m["groups"].values()) for i in range(3))
        total.append(f"**{cnt} / {rss * mb:,.0f} / {pss * mb:,.0f}**")
        per_client.append(f"- / {rss * mb / nclients:,.1f} / {pss * mb / nclients:,.1f}" if nclients else "-")
        driver.append(f"1 / {m['driver'][0] * mb:,.0f} / {m['driver'][1] * mb:,.0f}")
    mem_rows += [total, per_client, driver]

    # --- startup table ---
    build = "coordinator + RayExecutor construction"
    start_rows = [["ray.init(address='local', num_cpus=2) in this process", f1(init_s)]]
    until = "(handed the prepared Setup; until the first round can start)"
    start_rows.append([f"{build}, (c) {infos['c']['num_actors']} actors {until}", f1(readies["c"])])
    start_rows.append(["ray.init -> first round start, (c)", f1(init_s + readies["c"])])
    if "d" in readies:
        start_rows.append([f"{build}, (d) {infos['d']['num_actors']} actors", f1(readies["d"])])
    if "cli-startup" not in args.skip:
        launch = "launch `fedrod-ray train --mode ray` (subprocess) -> its 'ready' line, default layout"
        start_rows.append([launch, f1(cli_s)])
        if cli_line:
            start_rows.append([f'  of which the CLI\'s own figure: "{cli_line}"', "-"])

    print()
    print(
        f"### Seconds per round ({args.method}, MNIST-shaped, {args.epochs} local epochs, batch {args.batch_size}; "
        f"median of rounds {rounds[0]}..{rounds[-1]} after warm-up round 0; evaluation off; "
        "a checkpoint after every round (runtime.checkpoint_every=1, the default) is included)\n"
    )
    print(md_table(headers, rows, [False, False] + [True] * 5))
    note = (
        "\nfloor = (sum over the round's clients of their 1-thread update seconds, LocalResult.seconds of the "
        "updates re-run after (b) / (b20)) / 2 cores; ckpt + other = driver's round time minus the record's "
        "train_seconds (training + aggregation)."
    )
    if len(groups) > 1:
        note += f" Setup B = the first {limit:,} training images over {args.small_clients} clients, all "
        note += (
            f"training every round, because {args.clients} one-client actors would not fit in memory here."
        )
    print(note)
    if call_rows:
        print("\n### Inside the Ray rounds (from ray.timeline(): ClientActorImpl.train calls)\n")
        print(md_table(call_headers, call_rows))
    print(
        "\n### What-if: the Ray executor's scheduling (LongestQueueFirst) with more, smaller actors (setup A; "
        "simulated from (b)'s 1-thread update times, zero per-call overhead)\n"
    )
    print(md_table("actors x clients|in flight|s / round (median)|vs floor|per round s", sim_rows))
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
