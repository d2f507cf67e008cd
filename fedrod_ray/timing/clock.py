"""The virtual clock (``rounds``, docs/rounds.md): how long each client's local update would take on its own
device, simulated as FedScale does while the real computation runs as fast as it can.

A client has a fixed speed in examples per second, drawn once from the run's seed (or read from a trace);
its update takes its work (examples x local epochs) over its speed, plus the model's trip down and up at
``rounds.bandwidth``. Which clients make a deadline and how long a round lasts follow from those durations
alone, before anything trains. Pure functions of their arguments: no torch, no Ray.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

SPEED_TAG = 21  # the seed's stream of client speeds, apart from every other draw of the run


def client_speeds(distribution: str, num_clients: int, seed: int, speed: float, sigma: float, shape: float,
                  trace: np.ndarray | None = None) -> np.ndarray:
    """Every client's speed in examples per second (``rounds.speeds``).

    lognormal: ``speed * exp(sigma * z)``, z standard normal (``speed`` is the median); pareto: ``speed / x``
    with x Pareto(``shape``) on [1, inf) (``speed`` is the fastest, slow clients form a heavy tail); constant:
    ``speed`` for all; trace: client c runs at ``trace[c mod len(trace)]`` (a trace's devices cycled over the
    clients, as FedScale maps them)."""
    if distribution == "trace":
        if trace is None or len(trace) == 0:
            raise ValueError("a trace of client speeds needs at least one speed")
        return np.asarray(trace, dtype=np.float64)[np.arange(num_clients) % len(trace)]
    rng = np.random.default_rng([seed, SPEED_TAG])
    if distribution == "lognormal":
        return speed * np.exp(sigma * rng.standard_normal(num_clients))
    if distribution == "pareto":
        return speed / (1.0 + rng.pareto(shape, num_clients))
    if distribution == "constant":
        return np.full(num_clients, float(speed))
    raise ValueError(f"unknown speed distribution {distribution!r}")


def read_trace(path: str) -> np.ndarray:
    """The speeds of a trace file: one positive number (examples per second) a line; blank lines and lines
    starting with ``#`` are skipped."""
    lines = [line.strip() for line in Path(path).read_text().splitlines()]
    speeds = np.array([float(line) for line in lines if line and not line.startswith("#")], dtype=np.float64)
    if speeds.size == 0 or not np.all(np.isfinite(speeds) & (speeds > 0)):
        raise ValueError(f"{path}: a trace needs one positive, finite speed (examples per second) a line")
    return speeds


def communication_seconds(model_bytes: int, bandwidth: float | None) -> float:
    """The model's trip down to a client and its update's back up, at ``bandwidth`` MB/s each way (None: free)."""
    return 0.0 if bandwidth is None else 2 * model_bytes / (bandwidth * 1e6)


def durations(speeds: np.ndarray, examples: np.ndarray, epochs: int, comm_seconds: float) -> np.ndarray:
    """Each client's local update in virtual seconds: examples x epochs over its speed, plus communication."""
    return np.asarray(examples, dtype=np.float64) * epochs / speeds + comm_seconds


def over_selected(per_round: int, over_selection: float, num_clients: int) -> int:
    """``ceil((1 + over_selection) * per_round)`` clients, at most all of them; rounded to 9 digits first, so
    that 1.3 * 10 (13.000000000000002 in floats) asks for 13."""
    return min(num_clients, math.ceil(round((1 + over_selection) * per_round, 9)))


def deadline_round(times: np.ndarray, deadline: float, min_clients: int) -> tuple[list[int], float]:
    """The positions of the clients whose update counts, and when the round closes, under a deadline.

    Those finishing within ``deadline`` count; the round closes at the deadline if any missed it, else when the
    last arrives. Fewer than ``min_clients`` (at most all) in time, the server waits for the fastest
    ``min_clients`` instead, and the round closes when the last of them arrives."""
    times = np.asarray(times, dtype=np.float64)
    need = min(min_clients, len(times))
    made = np.flatnonzero(times <= deadline)
    if len(made) >= need:
        return [int(i) for i in made], float(deadline if len(made) < len(times) else times.max(initial=0.0))
    fastest = np.argsort(times, kind="stable")[:need]
    return sorted(int(i) for i in fastest), float(times[fastest].max())
