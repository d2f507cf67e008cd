"""Latency and throughput of the HTTP API: ``fedrod-ray serve`` (uvicorn) on loopback, driven by client
threads on keep-alive connections.

    python bench/serve_latency.py [RUN_DIR] [--requests 400] [--seconds 5]

Without RUN_DIR it serves a freshly built MNIST-shaped hyper model (random weights: the latency does not
depend on them). Cells: POST /v1/heads (a new class distribution each request, so every head is computed)
and POST /v1/predict with 1 and 64 raw-pixel images plus class_counts (generic and personalized
predictions), each at concurrency 1, 8 and 32. A cell stops after --requests requests or --seconds
seconds, whichever comes first. The client runs on the same cores as the server.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import machine_note, md_table

REPO = Path(__file__).resolve().parents[1]
CONCURRENCY = (1, 8, 32)
WARMUP = 5  # requests per connection before timing


def build_run(root: Path) -> Path:
    """A final/ of an MNIST-shaped hyper model, as training would save it."""
    import torch

    from fedrod_ray.export import ModelMeta, save_final
    from fedrod_ray.models import build_model
    from fedrod_ray.storage import RunStorage

    model = build_model("mnist_cnn", 10, (1, 28, 28), "hyper", 16, seed=0)
    with torch.no_grad():  # a non-zero hypernetwork output layer, as after training
        model.hypernet.net[2].weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    meta = ModelMeta(dataset="mnist", class_names=[str(i) for i in range(10)], image_shape=[1, 28, 28],
                     mean=[0.1307], std=[0.3081], arch="mnist_cnn", head="hyper", hyper_hidden=16,
                     rule="fedavg", balanced_loss="bsm", round=0)
    save_final(RunStorage(str(root)), meta, model.state_dict())
    return root


def start_server(run_dir: Path, log: Path) -> tuple[subprocess.Popen, str, int]:
    """``fedrod-ray serve`` on a free port; its output goes to ``log`` (a pipe could fill and block it)."""
    out = log.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "fedrod_ray.cli", "serve", str(run_dir), "--port", "0",
                             "--max-batch", "64"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        for line in log.read_text().splitlines():
            if line.startswith("fedrod-ray: serving"):
                host_port = line.split(" at http://")[1].split()[0]
                host, port = host_port.rsplit(":", 1)
                return proc, host, int(port)
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"the server did not start:\n{log.read_text()}")


def bodies(kind: str, n: int, rng: random.Random) -> list[bytes]:
    if kind == "heads":
        return [json.dumps({"class_counts": [rng.randrange(0, 500) for _ in range(9)] + [1]}).encode()
                for _ in range(n)]
    batch = int(kind)
    images = [[[[rng.randrange(256) for _ in range(28)] for _ in range(28)]] for _ in range(batch)]
    return [json.dumps({"images": images, "class_counts": [120, 0, 3, 0, 0, 45, 0, 310, 0, 2]}).encode()]


def run_cell(host: str, port: int, path: str, payloads: list[bytes], concurrency: int, max_requests: int,
             max_seconds: float) -> tuple[list[float], float]:
    """Latencies (s) of up to max_requests requests from `concurrency` connections, and the wall time."""
    latencies: list[float] = []
    lock = threading.Lock()
    errors: list[str] = []
    start_gate = threading.Barrier(concurrency + 1)
    state = {"deadline": 0.0}

    def worker(offset: int) -> None:
        conn = http.client.HTTPConnection(host, port, timeout=60)
        headers = {"Content-Type": "application/json"}

        def call(i: int) -> float:
            body = payloads[i % len(payloads)]
            t0 = time.perf_counter()
            conn.request("POST", path, body=body, headers=headers)
            resp = resp_data = conn.getresponse()
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
    state["deadline"] = t0 + max_seconds
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"{path}: {len(errors)} failed requests, e.g. {errors[0]}")
    return latencies, time.perf_counter() - t0


def percentile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", nargs="?", help="run directory holding final/ (default: build one)")
    parser.add_argument("--requests", type=int, default=400, help="timed requests per cell (default 400)")
    parser.add_argument("--seconds", type=float, default=5.0, help="time limit per cell (default 5)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        run_dir = Path(args.run_dir) if args.run_dir else build_run(Path(tmp) / "run")
        proc, host, port = start_server(run_dir, Path(tmp) / "server.log")
        rng = random.Random(0)
        rows = []
        try:
            for path, kind, batch in (("/v1/heads", "heads", "-"), ("/v1/predict", "1", 1),
                                      ("/v1/predict", "64", 64)):
                payloads = bodies(kind, args.requests + max(CONCURRENCY) * (WARMUP + 1), rng)
                for c in CONCURRENCY:
                    lat, wall = run_cell(host, port, path, payloads, c, args.requests, args.seconds)
                    rps = len(lat) / wall
                    images = f"{rps * batch:.0f}" if batch != "-" else "-"
                    rows.append([path, batch, c, len(lat), f"{percentile(lat, 50) * 1e3:.1f}",
                                 f"{percentile(lat, 99) * 1e3:.1f}", f"{rps:.0f}", images])
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(machine_note())
    print(f"server: fedrod-ray serve (uvicorn, access log on) on {host}; client: {sys.executable} threads, "
          f"one keep-alive connection each, on the same machine\n")
    print(md_table("endpoint|batch|concurrency|requests|p50 ms|p99 ms|requests/s|images/s", rows,
                   right=[False, True, True, True, True, True, True, True]))


if __name__ == "__main__":
    main()
