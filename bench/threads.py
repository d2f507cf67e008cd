"""Torch threads of the in-process runtime on a busy machine: the candidates for ``runtime.torch_threads``'s
default, timed on the quickstart job's local update with the machine as found and with busy-loop processes
that this script starts itself.

Each measurement is a fresh subprocess (an OpenMP wait policy is read when torch's thread pool starts) that
trains ``--rounds`` rounds of ``configs/quickstart.yaml`` in-process, one client a round
(``train.client_fraction=0.1``, no evaluation), and reports the mean training time of the rounds after the
first (which warms up). The candidates:

- ``default``: torch's own default, one thread per core (the runtime's default before ``auto``);
- ``one``: one thread;
- ``passive``: the default thread count with ``OMP_WAIT_POLICY=PASSIVE`` (idle threads sleep, not spin);
- ``auto``: what ``runtime.torch_threads: null`` chooses from the load average at the job's start
  (``fedrod_ray.drivers.threads``): idle, torch's default; busy, ``passive``.

A measurement still training ``--timeout`` seconds after its setup is stopped: its time is a lower bound
(``>``), the mean time of its rounds so far (the first too), the one in hand counted as finished.

Other work on the machine drifts, so the conditions and candidates are interleaved: every ``--reps`` pass
runs each condition, and within it every candidate in a shuffled order, and each time is divided by the
time of ``one`` in the same pass and condition. The table gives the median of those ratios and of the times.

    FEDROD_DATA_DIR=../shared/data python bench/threads.py                 # 2 passes, 2 busy loops
    FEDROD_DATA_DIR=../shared/data python bench/threads.py --reps 3 --load 2 4
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CANDIDATES = ("default", "one", "passive", "auto")
BUSY_LOOP = "while True: pass"
SETUP_TIMEOUT = 600  # seconds a worker may take to import torch and load the data


def worker(candidate: str, rounds: int) -> None:
    """Train ``rounds`` rounds in this process with ``candidate``'s threads; print the result as JSON."""
    load = os.getloadavg()[0]  # before torch's import adds its own
    from fedrod_ray.drivers.threads import choose_threads, passive_if_busy

    if candidate == "auto":
        assert "torch" not in sys.modules, "auto must choose before torch loads, as the command line does"
        passive_if_busy()
    import torch

    from fedrod_ray.config import load_config
    from fedrod_ray.executors.in_process import InProcessExecutor
    from fedrod_ray.federation_state.setup import make_host, prepare
    from fedrod_ray.round_loop.federation import Federation

    if candidate == "one":
        torch.set_num_threads(1)
    elif candidate == "auto":
        torch.set_num_threads(choose_threads(None)[0])
    cfg = load_config(REPO / "configs" / "quickstart.yaml", [
        f"train.rounds={rounds}", "train.client_fraction=0.1", "eval.eval_every=1000000", "eval.at_end=false",
        "runtime.mode=local"])
    setup = prepare(cfg)
    fed = Federation(setup, InProcessExecutor(make_host(setup)), log=lambda line: None)
    print(json.dumps({"seconds": 0.0, "end": time.time(), "threads": torch.get_num_threads(), "load": load}),
          flush=True)
    for r in range(rounds):
        seconds = fed.step(r)["train_seconds"]
        print(json.dumps({"seconds": seconds, "end": time.time(), "threads": torch.get_num_threads(),
                          "load": load}), flush=True)


def measure(candidate: str, rounds: int, timeout: float) -> dict:
    """The mean time of rounds 2.. in a fresh process. A process still training ``timeout`` seconds after
    its setup (the import of torch, the data) is stopped, and the time is a lower bound (``over``)."""
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if candidate == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    proc = subprocess.Popen([sys.executable, __file__, "--worker", candidate, "--rounds", str(rounds)],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            if line.startswith("{"):
                lines.put(json.loads(line))
        lines.put(None)  # the worker ended

    threading.Thread(target=read, daemon=True).start()
    try:
        ready = lines.get(timeout=SETUP_TIMEOUT)  # the setup is not what is measured
        done, deadline = [], time.time() + timeout
        while ready is not None and len(done) < rounds:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                # Every round so far, the one in hand counted as done now: a lower bound of their mean.
                return {**ready, "seconds": (time.time() - ready["end"]) / (len(done) + 1), "over": True}
            if line is None:
                break
            done.append(line)
    finally:
        proc.kill()
        proc.wait()
    if ready is None or len(done) < rounds:
        raise RuntimeError(f"{candidate}: the worker failed")
    later = done[1:] or done
    return {**done[-1], "seconds": sum(r["seconds"] for r in later) / len(later), "over": False}


def ratio_mark(r: dict, o: dict) -> str:
    """A ratio's bound: ``>`` when its numerator is a lower bound, ``<`` its denominator, ``?`` both."""
    if r is o:
        return ""
    return {(True, False): "> ", (False, True): "< ", (True, True): "? "}.get((r["over"], o["over"]), "")


def over_mark(censored: bool) -> str:
    return "> " if censored else ""


def start_load(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(n)]


def stop_load(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=2, help="passes over every condition and candidate")
    p.add_argument("--load", type=int, nargs="+", default=[2], help="busy-loop processes of the loaded conditions")
    p.add_argument("--rounds", type=int, default=2, help="rounds per measurement (the first warms up)")
    p.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=CANDIDATES)
    p.add_argument("--timeout", type=float, default=60,
                   help="seconds a measurement may train (after its setup); past it, its round time is a lower bound (>)")
    p.add_argument("--seed", type=int, default=0, help="of the candidates' shuffled order")
    p.add_argument("--worker", choices=CANDIDATES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.rounds)
        return
    from _common import machine_note, md_table  # imports torch: not in a worker, whose candidate comes first

    print(machine_note(), flush=True)
    rng = random.Random(args.seed)
    conditions = [0] + args.load
    results: dict[tuple[int, str], list[dict]] = {}
    started = time.perf_counter()
    for rep in range(args.reps):
        for busy in conditions:
            procs = start_load(busy)
            try:
                order = rng.sample(args.candidates, len(args.candidates))
                for candidate in order:
                    r = measure(candidate, args.rounds, args.timeout)
                    results.setdefault((busy, candidate), []).append(r)
                    print(f"pass {rep + 1}, {busy} busy loops, {candidate}: {over_mark(r['over'])}{r['seconds']:.2f} s a round, "
                          f"{r['threads']} threads (load {r['load']:.2f})", flush=True)
            finally:
                stop_load(procs)
    print(f"\n{args.reps} passes in {time.perf_counter() - started:.0f} s; the time of a round's local update "
          f"(one client, 1 epoch), median (the lower of the middle two) over passes; x one: median of the ratios to "
          f"`one` in the same pass; > a lower bound (stopped after {args.timeout:.0f} s), < an upper bound, "
          f"? unknown (both stopped)\n")
    rows = []
    for candidate in args.candidates:
        row = [candidate]
        for busy in conditions:
            runs = results[(busy, candidate)]
            # A bound counts as its value; a median that is one is marked.
            ratios = sorted((r["seconds"] / o["seconds"], ratio_mark(r, o)) for r, o in zip(runs, results[(busy, "one")]))
            times = sorted((r["seconds"], r["over"]) for r in runs)
            threads = sorted({r["threads"] for r in runs})
            mid_t, mid_r = times[(len(times) - 1) // 2], ratios[(len(ratios) - 1) // 2]
            row += [f"{over_mark(mid_t[1])}{mid_t[0]:.2f} s ({'/'.join(map(str, threads))} thr)",
                    f"{mid_r[1]}{mid_r[0]:.2f}"]
        rows.append(row)
    headers = ["candidate"]
    for busy in conditions:
        name = "as found" if busy == 0 else f"+{busy} busy loops"
        headers += [name, "x one"]
    print(md_table(headers, rows))


if __name__ == "__main__":
    main()
