"""A real final/ for the HTTP API's tests, saved with fedrod_ray.models.export from a freshly built model."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from fedrod_ray.models import build_model
from fedrod_ray.models.export import ModelMeta, _version_id, save_final
from fedrod_ray.outputs.storage import RunStorage

REPO = Path(__file__).resolve().parents[1]
SHAPE = [1, 28, 28]
MEAN, STD = [0.1307], [0.3081]
CLIENT_IDS = (0, 1, 5)  # not contiguous, like a linear run's clients after some never trained
# A process started with `&` by a non-interactive shell (a CI harness) inherits SIGINT as ignored, and so
# would a CLI a test starts, which then never sees Ctrl-C: the child puts Python's own action back before
# running the CLI.
CLI_WITH_SIGINT = [sys.executable, "-c", ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                                         "from fedrod_ray.cli import main; sys.exit(main(sys.argv[1:]))")]


def make_final(run_dir, head: str = "hyper", seed: int = 1, zero_clients: tuple[int, ...] = (),
               zero_hypernet: bool = False) -> str:
    """Save an MNIST-shaped model with random weights to run_dir/final/; returns its version id.

    ``zero_clients`` (linear): more clients, with the all-zero head of one that never trained;
    ``zero_hypernet`` (hyper): the hypernetwork's output layer as initialised, zero, as before training.
    """
    model = build_model("mnist_cnn", 10, tuple(SHAPE), None if head == "none" else head, 16, seed)
    g = torch.Generator().manual_seed(seed)
    if head == "hyper" and not zero_hypernet:
        # The hypernetwork's output layer starts at zero, which would make every generated head zero.
        with torch.no_grad():
            out = model.hypernet.net[2].weight
            out.copy_(torch.randn(out.shape, generator=g) * 0.1)
    weights = {k: v for k, v in model.state_dict().items() if not k.startswith("personal_head.")}
    heads = None
    if head == "linear":
        heads = {cid: torch.randn(10, 50, generator=g) for cid in CLIENT_IDS}
        heads.update({cid: torch.zeros(10, 50) for cid in zero_clients})
    meta = ModelMeta(dataset="mnist", class_names=[str(i) for i in range(10)], image_shape=SHAPE, mean=MEAN,
                     std=STD, arch="mnist_cnn", head=head, hyper_hidden=16, rule="fedavg",
                     balanced_loss="bsm", round=5, metrics={"gfl_gm": 0.5, "pfl_pm": 0.75})
    return save_final(RunStorage(str(run_dir)), meta, weights, heads)


def client_tokens(path, client_ids=CLIENT_IDS) -> dict[int, str]:
    """Write the token file of ``--client-tokens`` (client id -> sha256 hex of its token) to ``path``, as an
    operator does; returns each client's token, which only that client would know."""
    tokens = {cid: f"client-{cid}-{secrets.token_urlsafe(16)}" for cid in client_ids}
    Path(path).write_text(json.dumps({str(cid): hashlib.sha256(t.encode()).hexdigest() for cid, t in tokens.items()}))
    return tokens


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def edit_meta(run_dir, **changes) -> None:
    """Change final/meta.json's fields and recompute its version_id with the project's own helper, as anyone
    who can write the directory can: the checks that remain are the loader's own."""
    path = Path(run_dir) / "final" / "meta.json"
    doc = {**json.loads(path.read_text()), **changes}
    doc["version_id"] = _version_id(doc)
    path.write_text(json.dumps(doc))


# A package whose import and whose factories each write a marker file (MARKER_ENV names it) before doing
# what their names say: a crafted final/'s arch that ran leaves the marker behind.
MARKING_PACKAGE = """
import os, pathlib, sys
from torch import nn

def _mark(what):
    with open(os.environ["FEDROD_TEST_MARKER"], "a") as f:
        f.write(what + "\\n")

_mark("imported")

def net(shape):
    _mark("net")
    return nn.Sequential(nn.Flatten(), nn.Linear(shape[0] * shape[1] * shape[2], 8))

def exits(shape):
    _mark("exits")
    sys.exit(3)

def interrupts(shape):
    _mark("interrupts")
    raise KeyboardInterrupt
"""
MARKER_ENV = "FEDROD_TEST_MARKER"


def marking_package(root) -> Path:
    """Write the package ``fedrodmarker`` (MARKING_PACKAGE) under ``root``; returns the folder to put on
    sys.path / PYTHONPATH."""
    folder = Path(root) / "marking"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "fedrodmarker.py").write_text(MARKING_PACKAGE)
    return folder


@contextlib.contextmanager
def uvicorn_server(run_dir, *flags: str, env: dict | None = None):
    """``fedrod-ray serve run_dir --port 0 *flags`` in a subprocess; yields (process, base URL, output lines).

    Stopped with Ctrl-C (SIGINT) at the end if still running, killed if that does not stop it.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "fedrod_ray.cli", "serve", str(run_dir), "--port", "0", *flags],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        deadline, first = time.monotonic() + 120, ""
        while "serving" not in first:
            assert time.monotonic() < deadline and proc.poll() is None, "the server did not start"
            first = lines.get(timeout=120)
        assert first.startswith(f"fedrod-ray: serving {run_dir} "), first
        yield proc, first.split(" at ")[1].split()[0], lines
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
