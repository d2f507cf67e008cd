"""The served model and ``fedrod-ray serve`` for the HTTP benchmarks (serve_latency.py, availability.py),
without Ray: a benchmark of uvicorn alone does not import it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build_run(root: Path) -> Path:
    """A final/ of an MNIST-shaped hyper model, as training would save it."""
    import torch

    from fedrod_ray.models import build_model
    from fedrod_ray.models.export import ModelMeta, save_final
    from fedrod_ray.outputs.storage import RunStorage

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
