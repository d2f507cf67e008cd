"""A run at two sites on a real multi-node local Ray cluster (``ray.cluster_utils.Cluster``): a head with no CPU
and no data, and one worker node per site, labelled fedrod.site=a / b, each site its own directory of real MNIST
clients (tests/sites_data.py). Run by tests/test_sites.py as ``python tests/sites_cluster.py ROOT``; prints one
``RESULT <json>`` line of what the test checks.

In order: the same federations in this process (Fed-RoD hyper and Ditto); then, with every file this driver and
every Ray worker opens under the sites' directories recorded (an audit hook), the runs at the sites; a site store
altered behind the run's back, then resumed; a driver killed by SIGKILL after its first checkpoint, then
resumed with ``--resume``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import ray
import torch
from ray.cluster_utils import Cluster
from safetensors.torch import load_file
from sites_data import SITES, make_sites, memory_config, sites_config

from fedrod_ray.config import config_from_dict
from fedrod_ray.drivers.ray_runtime import run_ray
from fedrod_ray.drivers.runner import run_local
from fedrod_ray.outputs.storage import RunStorage

KEYS = ("round", "clients", "clients_done", "clients_failed", "train_loss", "personal_loss", "gfl_gm", "pfl_gm",
        "pfl_pm", "pfl_pm_global", "pm_eval_failed", "gfl_at", "pfl_at")


def audit_hook(log: str, roots: tuple[str, ...], who: str):
    """An audit hook that appends "<who> <path>" to ``log`` for every file opened under ``roots``."""

    def hook(event: str, args: tuple) -> None:
        if event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        path = os.path.abspath(os.fsdecode(args[0]))
        if path.startswith(roots):
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.write(fd, f"{who} {path}\n".encode())
            os.close(fd)

    return hook


def worker_audit() -> None:
    """Every Ray worker's setup hook: record its opens, named by its node."""
    sys.addaudithook(audit_hook(os.environ["SITES_AUDIT_LOG"], tuple(os.environ["SITES_AUDIT_ROOTS"].split(":")),
                                ray.get_runtime_context().get_node_id()))


def weights(run: Path) -> dict:
    return load_file(run / "final" / "model.safetensors")


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def main(root: Path) -> None:
    data = Path(os.environ.get("FEDROD_TEST_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
    paths = make_sites(root, data)
    torch.set_num_threads(1)
    out: dict = {}

    def config(head: str, run: str, **extra) -> dict:
        cfg = sites_config(paths, head, **extra)
        for site in cfg["sites"]:
            site["store"] = str(root / "stores" / run / site["name"])
        return cfg

    memory = {}
    for head in ("hyper", "ditto"):
        memory[head] = run_local(config_from_dict(memory_config(paths, head)), RunStorage(str(root / f"mem-{head}")),
                                 log=lambda s: None)

    # From here on, no process of the head node may open a file of the sites' data.
    audit = root / "audit.log"
    os.environ.update(SITES_AUDIT_LOG=str(audit), SITES_AUDIT_ROOTS=f"{paths['a']}:{paths['b']}")
    head_data = root / "head-data"
    os.environ["FEDROD_DATA_DIR"] = str(head_data)
    sys.addaudithook(audit_hook(str(audit), (str(paths["a"]), str(paths["b"])), "driver"))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        nodes = {name: cluster.add_node(num_cpus=1, labels={"fedrod.site": name}).node_id for name in SITES}
        ray.init(address=cluster.address, log_to_driver=False, runtime_env={"worker_process_setup_hook": worker_audit})
        out["head"] = cluster.head_node.node_id
        out["nodes"] = nodes
        at_sites = {}
        for head in ("hyper", "ditto"):
            run = root / f"sites-{head}"
            at_sites[head] = run_ray(config_from_dict(config(head, head)), RunStorage(str(run)), log=lambda s: None)
            out[f"{head}_records"] = [[{k: r.get(k) for k in KEYS} for r in rs] for rs in (memory[head], at_sites[head])]
            a, b = weights(root / f"mem-{head}"), weights(run)
            out[f"{head}_weights_equal"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        out["audit"] = audit.read_text().splitlines() if audit.exists() else []
        out["head_data_exists"] = head_data.exists()

        run = root / "sites-hyper"
        ckpt = run / "checkpoints"
        out["checkpoint_files"] = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file())
        manifest = json.loads((ckpt / "round_000003" / "manifest.json").read_text())
        out["manifest_sites"] = manifest["sites"]
        out["manifest_clients"] = manifest["clients"]
        stores = root / "stores" / "hyper"
        out["stores"] = {name: sorted(p.name for p in (stores / name).iterdir()) for name in SITES}
        out["store_versions"] = {name: {p.name: sorted(int(f.stem) for f in p.iterdir())
                                        for p in (stores / name).iterdir()} for name in SITES}
        out["kept_manifest_sites"] = [json.loads((ckpt / r / "manifest.json").read_text())["sites"]
                                      for r in ("round_000002", "round_000003")]

        # The driver killed by SIGKILL after its first checkpoint, then resumed: the uninterrupted run's weights.
        killed = root / "killed"
        cfg_file = root / "killed.yaml"
        cfg_file.write_text(json.dumps(config("hyper", "killed")))
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        cli = [sys.executable, "-m", "fedrod_ray.cli", "train", "--address", cluster.address]
        proc = subprocess.Popen([*cli, "--config", str(cfg_file), "--run-dir", str(killed)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        latest = killed / "checkpoints" / "latest"
        deadline = time.monotonic() + 240
        while not latest.is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        out["killed_before_end"] = proc.poll() is None and latest.is_file()
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        out["killed_at"] = latest.read_text() if latest.is_file() else None
        resumed = subprocess.run([*cli, "--resume", str(killed)], check=False, env=env, capture_output=True,
                                 text=True, timeout=300)
        out["resumed_rc"] = resumed.returncode
        out["resumed_err"] = resumed.stderr[-2000:]
        if resumed.returncode == 0:
            a, b = weights(root / "sites-hyper"), weights(killed)
            out["resumed_weights_equal"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            out["resumed_records"] = [[{k: r.get(k) for k in KEYS} for r in records(p)]
                                      for p in (root / "sites-hyper", killed)]
        # A site's store altered behind the run's back: the resume is refused, nothing of it mixed in.
        name, (version, _) = min(manifest["sites"]["b"]["clients"].items())
        victim = stores / "b" / name / f"{version}.safetensors"
        saved = victim.read_bytes()
        victim.write_bytes(saved[:-4] + bytes(b ^ 0xFF for b in saved[-4:]))
        before = (run / "metrics.jsonl").read_bytes(), (run / "final" / "model.safetensors").read_bytes()
        refused = subprocess.run([*cli, "--resume", str(run)], check=False, env=env, capture_output=True, text=True,
                                 timeout=300)
        out["tampered"] = [refused.returncode, [ln for ln in refused.stderr.splitlines() if "fedrod-ray:" in ln]]
        # A config that miscounts the sites' clients: the one-line error the CLI gives its own config errors.
        wrong = subprocess.run([*cli, "--config", str(cfg_file), "--run-dir", str(root / "wrong"), "--set",
                                "data.num_clients=5"], check=False, env=env, capture_output=True, text=True,
                               timeout=300)
        out["miscounted"] = [wrong.returncode, [ln for ln in wrong.stderr.splitlines() if "fedrod-ray:" in ln]]
        after = (run / "metrics.jsonl").read_bytes(), (run / "final" / "model.safetensors").read_bytes()
        out["tampered_run_unchanged"] = before == after
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    target = Path(sys.argv[1])
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    main(target)
