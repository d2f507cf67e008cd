"""Availability under hostile load (issue 49): each attack, for a few seconds, against ``fedrod-ray serve``
(uvicorn) and Ray Serve (one replica with deploy/serve_config.yaml's options, behind HAProxy), while a
legitimate client polls GET /healthz and a one-image POST /v1/predict, one after the other on a keep-alive
connection.

    python bench/availability.py [--seconds 5] [--servers uvicorn serve] [--attacks ...]

Each row: the legitimate requests' p50/p99 latency during the attack against the same without it (measured
just before, on the same server), how many of them failed (no 200 within 30 s), and the peak resident memory
of the server's processes (uvicorn; the replica and HAProxy) above what they held before the attack. The
attacks (docs/security.md says what bounds each):

- invalid-items: 4 clients looping on an 800 KB predict body of 200,000 invalid items (422);
- declared-length: connections declaring 16 MiB bodies and sending nothing, as many as the body budget holds
  plus 2;
- big-headers: 4 clients looping on requests with 64 KB of headers in one write (431);
- slowloris: 200 connections trickling a request's headers a byte every 2 s;
- bodies: 60 concurrent 16 MiB bodies of PNG strings (peak memory against the default 256 MiB budget);
- largest-body: 4 clients looping on the largest body the value bound lets through, 12 MiB of ~400,000
  long numbers (512 images, a 422 once parsed: over max_batch).

The peak memory includes the server's parse worker processes.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import json
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

from _common import machine_note, md_table
from _served import build_run, start_server
from fedrod_ray_api.schemas import EXAMPLE_PNG

MIB = 2**20
LIMIT, BUDGET = 16 * MIB, 256 * MIB  # the default body limit and budget
TIMEOUT = 30  # seconds a legitimate request may take before it counts as failed
PREDICT = json.dumps({"images_png": [EXAMPLE_PNG]}).encode()
INVALID = b'{"images": [[[[' + b",".join([b'"a"'] * 200_000) + b"]]]]}"
# 256 strings of 64 KiB, valid base64 but no PNG: the body is parsed, each string held, the first refused.
PNG_STRINGS = json.dumps({"images_png": [base64.b64encode(b"x" * 49_000).decode()] * 256}).encode()
_ROW = "[" + ",".join(f"{i * 9.87654321012345678:.22e}" for i in range(28)) + "]"
LARGEST = ('{"images": [' + ",".join(["[[" + ",".join([_ROW] * 28) + "]]"] * 512) + "]}").encode()


def _connect(address: tuple[str, int]) -> socket.socket:
    return socket.create_connection(address, timeout=TIMEOUT)


def _post(address, path: str, body: bytes) -> None:
    conn = http.client.HTTPConnection(*address, timeout=TIMEOUT)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        conn.getresponse().read()
    except OSError:
        pass
    finally:
        conn.close()


def _loop(stop: threading.Event, send: Callable[[], None]) -> None:
    while not stop.is_set():
        send()


def _declared_length(address, stop: threading.Event) -> None:
    with contextlib.suppress(OSError), _connect(address) as sock:
        sock.sendall(b"POST /v1/heads HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % LIMIT)
        stop.wait()


def _big_headers(address) -> None:
    with contextlib.suppress(OSError), _connect(address) as sock:
        pad = b"".join(b"X-Pad: %s\r\n" % (b"a" * 1000) for _ in range(64))
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: bench\r\n" + pad + b"\r\n")
        while sock.recv(65536):
            pass


def _slowloris(address, stop: threading.Event) -> None:
    with contextlib.suppress(OSError), _connect(address) as sock:
        for byte in b"GET /healthz HTTP/1.1\r\nHost: bench\r\n" * 100:
            sock.sendall(bytes([byte]))
            if stop.wait(2):
                return


def attack(name: str, address) -> Iterator[Callable[[threading.Event], None]]:
    """The attackers of ``name``: callables run on threads of their own until the event is set."""
    if name == "invalid-items":
        return (lambda stop: _loop(stop, lambda: _post(address, "/v1/predict", INVALID)) for _ in range(4))
    if name == "declared-length":
        return (lambda stop: _declared_length(address, stop) for _ in range(BUDGET // LIMIT + 2))
    if name == "big-headers":
        return (lambda stop: _loop(stop, lambda: _big_headers(address)) for _ in range(4))
    if name == "slowloris":
        return (lambda stop: _slowloris(address, stop) for _ in range(200))
    if name == "bodies":
        return (lambda stop: _post(address, "/v1/predict", PNG_STRINGS) for _ in range(60))
    if name == "largest-body":
        return (lambda stop: _loop(stop, lambda: _post(address, "/v1/predict", LARGEST)) for _ in range(4))
    raise ValueError(name)


ATTACKS = ("invalid-items", "declared-length", "big-headers", "slowloris", "bodies", "largest-body")


def probe(address, seconds: float) -> tuple[list[float], list[float], int]:
    """(healthz latencies, predict latencies, failed requests) of a legitimate client for ``seconds``."""
    healthz, predict, failed = [], [], 0
    conn = http.client.HTTPConnection(*address, timeout=TIMEOUT)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for method, path, body, into in (("GET", "/healthz", None, healthz),
                                         ("POST", "/v1/predict", PREDICT, predict)):
            t0 = time.perf_counter()
            try:
                conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
                response = conn.getresponse()
                response.read()
                ok = response.status == 200
            except OSError:
                ok = False
            if ok:
                into.append(time.perf_counter() - t0)
            else:
                failed += 1
                conn.close()
                conn = http.client.HTTPConnection(*address, timeout=TIMEOUT)
    conn.close()
    return healthz, predict, failed


def rss(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) * 1024
    return total


def with_workers(pids: Callable[[], list[int]]) -> Callable[[], list[int]]:
    """``pids`` and their children (a server's parse worker processes)."""

    def found() -> list[int]:
        listed = pids()
        children = []
        for pid in listed:
            for task in Path(f"/proc/{pid}/task").glob("*"):
                with contextlib.suppress(OSError):
                    children += [int(c) for c in (task / "children").read_text().split()]
        return listed + children

    return found


def measure(address, pids: Callable[[], list[int]], name: str, seconds: float) -> list:
    idle_h, idle_p, _ = probe(address, seconds)
    before, peak = rss(pids()), [0]
    stop = threading.Event()
    threads = [threading.Thread(target=a, args=(stop,), daemon=True) for a in attack(name, address)]
    for t in threads:
        t.start()
    sampler_stop = threading.Event()

    def sample():
        while not sampler_stop.wait(0.05):
            peak[0] = max(peak[0], rss(pids()))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    time.sleep(0.5)  # the attack under way
    hot_h, hot_p, failed = probe(address, seconds)
    stop.set()
    for t in threads:
        t.join(TIMEOUT)
    sampler_stop.set()
    sampler.join()

    def ms(xs: list[float], q: int) -> str:
        if not xs:
            return "-"
        value = statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]
        return f"{1000 * value:.1f}"

    return [name, f"{ms(idle_h, 50)} / {ms(idle_h, 99)}", f"{ms(hot_h, 50)} / {ms(hot_h, 99)}",
            f"{ms(idle_p, 50)} / {ms(idle_p, 99)}", f"{ms(hot_p, 50)} / {ms(hot_p, 99)}", failed,
            f"{max(peak[0] - before, 0) / MIB:.0f}"]


@contextlib.contextmanager
def serve_running() -> Iterator[None]:
    """A private local Ray with Ray Serve as ``fedrod-ray serve --ray`` starts it (HAProxy's limits from the
    default Connections), listening on SERVE_PORT; Ray is imported here, so that --servers uvicorn runs
    without it."""
    import ray
    from fedrod_ray_api.serve import LOCAL_RAY_ENV, haproxy_env, http_options
    from fedrod_ray_api.settings import Connections
    from ray import serve
    from serve_latency import SERVE_PORT

    env = {**LOCAL_RAY_ENV, **haproxy_env(Connections()), "RAY_AUTH_MODE": "disabled"}
    with mock.patch.dict("os.environ", env):
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            serve.start(http_options=http_options("127.0.0.1", SERVE_PORT, Connections()))
            yield
        finally:
            serve.shutdown()
            ray.shutdown()


HEADERS = ("attack|/healthz idle p50 / p99 ms|/healthz attacked|predict idle p50 / p99 ms|predict attacked|"
           "failed|peak RSS + MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5, help="per measurement (idle, then attacked)")
    parser.add_argument("--servers", nargs="+", default=["uvicorn", "serve"], choices=["uvicorn", "serve"])
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=ATTACKS)
    args = parser.parse_args()
    print(machine_note())
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = build_run(Path(tmp) / "run")
        for server in args.servers:
            rows = []
            if server == "uvicorn":
                proc, host, port = start_server(run_dir, Path(tmp) / "uvicorn.log")
                try:
                    for name in args.attacks:
                        rows.append(measure((host, port), with_workers([proc.pid].copy), name, args.seconds))
                finally:
                    proc.terminate()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(30)
            else:
                with serve_running():
                    from serve_latency import fixed_options, start_serve

                    host, port, pids = start_serve(run_dir, fixed_options(1))
                    for name in args.attacks:
                        rows.append(measure((host, port), with_workers(pids), name, args.seconds))
            print(f"\n{server} (uvicorn: the process; Ray Serve: the replica and HAProxy)\n")
            print(md_table(HEADERS, rows))


if __name__ == "__main__":
    main()
