"""Latency and throughput of the HTTP API on loopback, driven by client threads on keep-alive connections:
``fedrod-ray serve`` (uvicorn) and Ray Serve (one replica, the deployment options of
deploy/serve_config.yaml; in Ray's high-throughput mode, `serve`, and with Serve's default Python proxy,
`serve-proxy`) in the same run, and their ratios; with --batch-waits, Serve's predict batching at several
waits; then, with --autoscale, Ray Serve adding a replica under load.

    python bench/serve_latency.py [RUN_DIR] [--requests 400] [--seconds 5] [--repeats 3]
                                  [--servers uvicorn serve serve-proxy] [--batch-waits 0 0.002] [--autoscale]

Without RUN_DIR it serves a freshly built MNIST-shaped hyper model (random weights: the latency does not
depend on them). Cells: POST /v1/heads (a new class distribution each request, so every head is computed)
and POST /v1/predict with 1 and 64 raw-pixel images plus class_counts (generic and personalized
predictions), each at concurrency 1, 8 and 32. uvicorn runs throughout; each Ray Serve configuration and
uvicorn take turns on every cell (--repeats turns each), so that both meet the same machine. A turn stops
after --requests requests or --seconds seconds, whichever comes first. The client runs on the same cores
as the servers. With /proc (Linux), each row also gives the CPU time the server's processes (uvicorn's; a
replica, HAProxy or Serve's proxy actor) spent per request: a server bound by its Python per process serves
as many requests/s as that allows.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from unittest import mock

import ray
import yaml
from _common import machine_note, md_table
from _served import REPO, build_run, start_server
from fedrod_ray_api.serve import HIGH_THROUGHPUT_ENV, LOCAL_RAY_ENV, FedRodAPI
from fedrod_ray_api.settings import Settings
from ray import serve

SERVE_CONFIG = REPO / "deploy" / "serve_config.yaml"
CONCURRENCY = (1, 8, 32)
WARMUP = 5  # requests per connection before timing


def bodies(kind: str, n: int, rng: random.Random) -> list[bytes]:
    if kind == "heads":
        return [json.dumps({"class_counts": [rng.randrange(0, 500) for _ in range(9)] + [1]}).encode()
                for _ in range(n)]
    batch = int(kind)
    images = [[[[rng.randrange(256) for _ in range(28)] for _ in range(28)]] for _ in range(batch)]
    return [json.dumps({"images": images, "class_counts": [120, 0, 3, 0, 0, 45, 0, 310, 0, 2]}).encode()]


def run_cell(host: str, port: int, path: str, payloads: list[bytes], concurrency: int, max_requests: int,
             max_seconds: float, pids: Sequence[int] = ()) -> tuple[list[float], float, float]:
    """Latencies (s) of up to max_requests requests from `concurrency` connections, the wall time, and the
    CPU seconds ``pids`` spent per request after the warm-up (NaN without /proc)."""
    latencies: list[float] = []
    answered = [0]  # after the warm-up, with the requests in flight at the end that are not timed
    lock = threading.Lock()
    errors: list[str] = []
    start_gate = threading.Barrier(concurrency + 1)
    state = {"deadline": 0.0}

    def worker(offset: int) -> None:
        conn = http.client.HTTPConnection(host, port, timeout=60)
        headers = {"Content-Type": "application/json"}

        def send(body: bytes) -> http.client.HTTPResponse:
            nonlocal conn
            try:
                conn.request("POST", path, body=body, headers=headers)
                return conn.getresponse()
            except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
                # The server closed the idle keep-alive connection while the others warmed up: reconnect.
                conn.close()
                conn = http.client.HTTPConnection(host, port, timeout=60)
                conn.request("POST", path, body=body, headers=headers)
                return conn.getresponse()

        def call(i: int) -> float:
            body = payloads[i % len(payloads)]
            t0 = time.perf_counter()
            resp = send(body)
            resp_data = resp.read()
            if resp.status != 200:
                errors.append(f"{resp.status}: {resp_data[:200]!r}")
            return time.perf_counter() - t0

        for i in range(WARMUP):
            call(offset + i)
        start_gate.wait()
        i = offset + WARMUP
        while True:
            latency = call(i)
            i += concurrency
            with lock:
                answered[0] += 1
                if len(latencies) >= max_requests or time.perf_counter() > state["deadline"]:
                    break
                latencies.append(latency)
        conn.close()

    threads = [threading.Thread(target=worker, args=(k * 1000,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    state["deadline"] = time.perf_counter() + 3600  # until every connection is warm
    start_gate.wait()
    t0 = time.perf_counter()
    cpu = cpu_seconds(pids)
    state["deadline"] = t0 + max_seconds
    for t in threads:
        t.join()
    after = cpu_seconds(pids)
    cpu_per_request = (after - cpu) / answered[0] if None not in (cpu, after) else math.nan
    if errors:
        raise SystemExit(f"{path}: {len(errors)} failed requests, e.g. {errors[0]}")
    return latencies, time.perf_counter() - t0, cpu_per_request


def percentile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_options() -> tuple[dict, dict]:
    """(the FedRodAPI deployment's options, the application's runtime_env) from deploy/serve_config.yaml."""
    (app,) = yaml.safe_load(SERVE_CONFIG.read_text())["applications"]
    (deployment,) = app["deployments"]
    return {k: v for k, v in deployment.items() if k != "name"}, app.get("runtime_env", {})


def fixed_options(replicas: int) -> dict:
    """serve_options() for ``replicas`` replicas, without autoscaling, the runtime_env in the actor options."""
    options, runtime_env = serve_options()
    options = {k: v for k, v in options.items() if k != "autoscaling_config"}
    actor = dict(options.get("ray_actor_options", {}))
    if runtime_env:
        actor["runtime_env"] = runtime_env
    return {**options, "num_replicas": replicas, "ray_actor_options": actor}


SERVE_PORT = free_port()
# Ray Serve's two ingress paths, each on a Ray started for it (the controller, proxy and replicas read these
# variables when they start): HAProxy straight to the replicas (Ray's high-throughput mode, what
# `fedrod-ray serve --ray` starts), and Serve's default Python proxy actor in front of them.
SERVE_MODES = {"serve": "high-throughput", "serve-proxy": "default"}


@contextlib.contextmanager
def serve_running(mode: str):
    """A private local Ray with Ray Serve in ``mode`` (``SERVE_MODES``) listening on SERVE_PORT."""
    env = LOCAL_RAY_ENV if SERVE_MODES[mode] == "high-throughput" else dict.fromkeys(HIGH_THROUGHPUT_ENV, "0")
    # Only this process talks to its private Ray: no token auth, whose token Ray would write to ~/.ray (and
    # so switch auth on for the user's own `ray start`), as fedrod_ray.drivers.ray_runtime does for its local
    # Ray.
    with mock.patch.dict(os.environ, {**env, "RAY_AUTH_MODE": "disabled"}):
        try:
            ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
            serve.start(http_options={"host": "127.0.0.1", "port": SERVE_PORT})
            yield
        finally:
            serve.shutdown()
            ray.shutdown()


def _stat(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command name (which may hold spaces): state, ppid, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _cmdlines() -> dict[int, tuple[int, str]]:
    """Every process of this machine: pid -> (parent pid, command line); empty where there is no /proc."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ppid = int(_stat(proc.name)[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        found[int(proc.name)] = ppid, cmd
    return found


def serve_pids() -> list[int]:
    """The processes that handle the bench's requests on the Ray of ``serve_running``: its replicas, its
    Python proxy actor and the HAProxy of its node (whose config path holds the node id)."""
    node = ray.get_runtime_context().get_node_id()
    procs = _cmdlines()
    replicas = [pid for pid, (_, cmd) in procs.items() if cmd.startswith("ray::ServeReplica:bench:")]
    raylets = {procs[pid][0] for pid in replicas}
    return replicas + [pid for pid, (ppid, cmd) in procs.items()
                       if (ppid in raylets and cmd.startswith("ray::ProxyActor")) or ("haproxy" in cmd and node in cmd)]


def cpu_seconds(pids: Sequence[int]) -> float | None:
    """User + system CPU time of ``pids`` so far (None without /proc, not Linux, or without a process to
    count: a table's 0.00 would claim a measurement)."""
    if not pids:
        return None
    total = 0.0
    for pid in pids:
        try:
            fields = _stat(pid)
        except OSError:
            return None
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def start_serve(run_dir: Path, options: dict) -> tuple[str, int, Callable[[], list[int]]]:
    """The FedRodAPI deployment with ``options``, on the Serve of ``serve_running``."""
    app = FedRodAPI.options(**options).bind(Settings(model_dir=str(run_dir), max_batch=64).model_dump())
    serve.run(app, name="bench", route_prefix="/")
    # HAProxy restarts itself (a new process) as the replicas register: the first cell would count a
    # process that is gone by its end. Wait until the set stays the same for a second.
    deadline, pids = time.monotonic() + 15, serve_pids()
    while time.monotonic() < deadline:
        time.sleep(1)
        pids, before = serve_pids(), pids
        if pids == before:
            break
    return "127.0.0.1", SERVE_PORT, serve_pids


CELLS = (("/v1/heads", "heads", "-"), ("/v1/predict", "1", 1), ("/v1/predict", "64", 64))


def bench(servers: dict[str, tuple[str, int, Callable[[], list[int]]]], args, rows: list, ratios: list) -> None:
    """Every cell on each of ``servers`` (label: host, port, its processes), the servers taking turns ``args.repeats`` times
    per cell: the speed of a shared machine drifts by tens of percent within minutes, and servers measured
    one after the other would be compared across that drift. A server's figures pool its turns; the ratios
    are to the first server (uvicorn, when it runs). Its CPU per request is that of its processes (the
    client's threads are not counted)."""
    rng = random.Random(0)
    for path, kind, batch in CELLS:
        for c in CONCURRENCY:
            latencies = {label: [] for label in servers}
            walls = dict.fromkeys(servers, 0.0)
            cpus = {label: [] for label in servers}
            for _ in range(args.repeats):
                # New class distributions every turn: each /v1/heads request computes its head.
                payloads = bodies(kind, args.requests + max(CONCURRENCY) * (WARMUP + 1), rng)
                for label, (host, port, processes) in servers.items():
                    lat, wall, cpu = run_cell(host, port, path, payloads, c, args.requests, args.seconds,
                                              processes())
                    latencies[label] += lat
                    walls[label] += wall
                    cpus[label].append(cpu)
            figures = {}
            for label, lat in latencies.items():
                rps, cpu = len(lat) / walls[label], statistics.mean(cpus[label])
                p50, p99 = percentile(lat, 50) * 1e3, percentile(lat, 99) * 1e3
                figures[label] = p99, rps
                images = f"{rps * batch:.0f}" if batch != "-" else "-"
                rows.append([label, path, batch, c, len(lat), f"{p50:.1f}", f"{p99:.1f}", f"{rps:.0f}", images,
                             f"{cpu * 1e3:.2f}" if math.isfinite(cpu) else "-"])
            (base, (base_p99, base_rps)), *others = figures.items()
            ratios.extend([label, base, path, batch, c, f"{p99 / base_p99:.2f}", f"{rps / base_rps:.2f}"]
                          for label, (p99, rps) in others)


def replicas(app: str = "bench") -> int:
    (status,) = serve.status().applications[app].deployments.values()
    return status.replica_states.get("RUNNING", 0)


def autoscale(run_dir: Path, options: dict, seconds: float) -> list[str]:
    """Predict load at concurrency 8 against 1..2 replicas scaling to 1 request in flight each: the
    replica count over time."""
    options = {**{k: v for k, v in options.items() if k != "num_replicas"}, "autoscaling_config": {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 1,
        "downscale_delay_s": 60, "look_back_period_s": 2, "metrics_interval_s": 0.5}}
    host, port, _ = start_serve(run_dir, options)
    payloads = bodies("1", 64, random.Random(1))
    done = threading.Event()
    load = threading.Thread(target=lambda: (run_cell(host, port, "/v1/predict", payloads, 8, 10**9, seconds),
                                            done.set()))
    t0 = time.perf_counter()
    load.start()
    timeline = [f"{0:.0f} s: {replicas()} replica(s)"]
    last = replicas()
    while not done.wait(0.5):
        now = replicas()
        if now != last:
            timeline.append(f"{time.perf_counter() - t0:.0f} s: {now} replicas")
            last = now
    load.join()
    return timeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", nargs="?", help="run directory holding final/ (default: build one)")
    parser.add_argument("--requests", type=int, default=400, help="timed requests per cell and turn (default 400)")
    parser.add_argument("--seconds", type=float, default=5.0, help="time limit per cell and turn (default 5)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="turns each server takes per cell, alternating with the others (default 3)")
    parser.add_argument("--servers", nargs="+", choices=["uvicorn", *SERVE_MODES], default=["uvicorn", "serve"],
                        help="serve: Ray's high-throughput mode (HAProxy); serve-proxy: Serve's default proxy")
    parser.add_argument("--batch-waits", nargs="+", type=float, metavar="S",
                        help="Ray Serve: batch_wait_s values (user_config) to run the predict cells with "
                             "(default: the deployment's)")
    parser.add_argument("--replicas", type=int, default=1, help="Ray Serve replicas (default 1)")
    parser.add_argument("--autoscale", action="store_true",
                        help="then show Ray Serve adding a replica under load (target_ongoing_requests 1)")
    args = parser.parse_args()

    rows: list = []
    ratios: list = []
    timeline: list[str] = []
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp, contextlib.ExitStack() as stack:
        run_dir = Path(args.run_dir) if args.run_dir else build_run(Path(tmp) / "run")
        uvicorn = {}
        if "uvicorn" in args.servers:
            proc, host, port = start_server(run_dir, Path(tmp) / "server.log")
            stack.callback(proc.wait, timeout=30)
            stack.callback(proc.terminate)
            uvicorn = {"uvicorn": (host, port, lambda: [proc.pid])}
        options = fixed_options(args.replicas)
        modes = [m for m in SERVE_MODES if m in args.servers]
        if not modes and uvicorn:
            bench(uvicorn, args, rows, ratios)
        for mode in modes + (["serve"] if args.autoscale and "serve" not in modes else []):
            with serve_running(mode):
                for wait in (args.batch_waits or [None]) if mode in modes else []:
                    config = {} if wait is None else {"user_config": {"batch_wait_s": wait}}
                    label = mode if wait is None else f"{mode}, wait {wait * 1e3:g} ms"
                    bench({**uvicorn, label: start_serve(run_dir, {**options, **config})}, args, rows, ratios)
                    serve.delete("bench")
                if args.autoscale and mode == "serve":
                    timeline = autoscale(run_dir, options, max(30.0, 6 * args.seconds))
    print(machine_note())
    print(f"uvicorn: fedrod-ray serve (access log on); serve: Ray Serve in Ray's high-throughput mode "
          f"({' '.join(f'{k}={v}' for k, v in HIGH_THROUGHPUT_ENV.items())}: HAProxy to the replicas), "
          f"serve-proxy: Ray Serve with its default Python proxy; both {args.replicas} replica(s), {SERVE_CONFIG.name}'s "
          f"deployment options; client: {sys.executable} threads, one keep-alive connection each, on the "
          f"same machine; the servers take turns {args.repeats} times per cell (uvicorn runs beside each Ray "
          f"Serve configuration: its rows repeat)\n")
    print(md_table("server|endpoint|batch|concurrency|requests|p50 ms|p99 ms|requests/s|images/s|server CPU ms/request",
                   rows, right=[False, False, True, True, True, True, True, True, True, True]))
    if ratios:
        print("\nRatios to the server measured beside it (p99: lower is better; requests/s: higher is better)\n")
        print(md_table("server|beside|endpoint|batch|concurrency|p99 ratio|requests/s ratio", ratios,
                       right=[False, False, False, True, True, True, True]))
    if timeline:
        print("\nAutoscaling (high-throughput mode, 1..2 replicas, target_ongoing_requests 1, predict at "
              "concurrency 8): " + "; ".join(timeline))


if __name__ == "__main__":
    main()
