"""A fault hook for tests only: one given call on a Ray client actor hangs until the actor is killed, so that
a test kills the actor while exactly that call runs (tests/test_ray_runtime.py).

Inert unless ``FEDROD_TEST_FAULT`` is set, which only the tests do: unset, an actor holds ``None`` and a
call costs one comparison. The variable holds a JSON object naming the call:

    {"call": "train" | "evaluate", "client": <id>, "round_idx": <0-based round, train only; optional>,
     "marker": "<path>"}

The first such call (``train`` of that client, or the ``evaluate`` chunk that holds it) writes ``marker``
(JSON: the call, its clients, its round and the pid of the actor's process), and then blocks for good,
at its start, before it has read anything: where in the call the kill lands changes nothing, since an
actor holds no client state. A call that hung for a while and then went on would let a test pass with
the kill landing after it, so the block has no timeout. The marker is created exclusively, so the fault
fires once: the same call sent again to the restarted actor, and every later one, runs normally.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

ENV = "FEDROD_TEST_FAULT"
CALLS = ("train", "evaluate")


@dataclass(frozen=True)
class Fault:
    call: str
    client: int
    marker: str
    round_idx: int | None = None

    def reached(self, call: str, clients: Sequence[int], round_idx: int | None = None) -> None:
        """Hang for good if this is the faulty call and the fault has not fired yet; else return at once."""
        if call != self.call or self.client not in clients or self.round_idx not in (None, round_idx):
            return
        # Written aside, then linked into place: the link fails if the marker exists (the fault fired),
        # and whoever reads the marker reads it whole.
        staged = f"{self.marker}.{os.getpid()}"
        with open(staged, "w") as f:
            json.dump({"call": call, "clients": list(clients), "round_idx": round_idx, "pid": os.getpid()}, f)
        try:
            os.link(staged, self.marker)
        except FileExistsError:
            return
        finally:
            os.unlink(staged)
        threading.Event().wait()


def from_env() -> Fault | None:
    """The fault that ``FEDROD_TEST_FAULT`` names; None when it is unset (always, outside the tests)."""
    text = os.environ.get(ENV)
    if not text:
        return None
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{ENV} is not JSON: {e}") from None
    if not isinstance(spec, dict):
        raise TypeError(f"{ENV} must be a JSON object, got {text!r}")
    unknown = sorted(set(spec) - {"call", "client", "round_idx", "marker"})
    if unknown:
        raise ValueError(f"{ENV}: unknown field(s) {unknown}")
    if spec.get("call") not in CALLS:
        raise ValueError(f"{ENV}: call must be one of {list(CALLS)}, got {spec.get('call')!r}")
    for key in ("client", "round_idx"):
        if not isinstance(spec.get(key, 0), int) or isinstance(spec.get(key), bool):
            raise TypeError(f"{ENV}: {key} must be an integer, got {spec[key]!r}")
    if "client" not in spec:
        raise ValueError(f"{ENV}: client is required")
    if "round_idx" in spec and spec["call"] != "train":
        raise ValueError(f"{ENV}: round_idx applies to train only (evaluate is not told its round)")
    if not isinstance(spec.get("marker"), str) or not spec["marker"]:
        raise ValueError(f"{ENV}: marker must be a file path, got {spec.get('marker')!r}")
    return Fault(**spec)


def runtime_env() -> dict | None:
    """Ray's ``runtime_env`` that hands ``FEDROD_TEST_FAULT`` to the actors an executor starts, and to the
    coordinator that a Ray run's driver starts (their workers would otherwise see the environment their node
    had when Ray started); None when it is unset."""
    text = os.environ.get(ENV)
    return {"env_vars": {ENV: text}} if text else None
