"""Runs at two sites on a real multi-node local Ray cluster (``ray.cluster_utils.Cluster``): a head with no CPU
and no data, and one worker node per site, labelled fedrod.site=a / b, each site its own directory of real MNIST
clients (tests/sites_data.py). Run once by tests/test_sites.py as ``python tests/sites_cluster.py ROOT`` (one
cluster for all its tests: starting one is most of their time); prints one ``RESULT <json>`` line of what the
tests check.

In order: the same federations in this process (Fed-RoD hyper and Ditto); then, with every file this driver and
every Ray worker opens under the sites' directories recorded (an audit hook), the runs at the sites; a driver
killed by SIGKILL after its first checkpoint, then resumed with ``--resume``; a site store altered behind the run's
back, then resumed; a config that miscounts the sites' clients. Last, as it takes the nodes away
(``node_loss``): site a's node removed while one of its clients trains, away a round, then a node with the same
label and directory back; at the end both sites gone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import ray
import torch
from safetensors.torch import load_file
from sites_data import SITES, add_site_node, make_sites, memory_config, site_cluster, sites_config

from fedrod_ray.config import config_from_dict
from fedrod_ray.drivers.ray_runtime import run_ray
from fedrod_ray.drivers.runner import run_local
from fedrod_ray.executors.shared_setup import share
from fedrod_ray.executors.sites import SitesExecutor
from fedrod_ray.federation_state.setup import prepare_server
from fedrod_ray.lifecycle.coordinator import Coordinator
from fedrod_ray.outputs.storage import RunStorage
from fedrod_ray.round_loop.federation import Federation, RoundFailedError

KEYS = ("round", "clients", "clients_done", "clients_failed", "train_loss", "personal_loss", "gfl_gm", "pfl_gm",
        "pfl_pm", "pfl_pm_global", "pm_eval_failed", "gfl_at", "pfl_at")
LOSS_KEYS = ("round", "clients", "clients_done", "clients_failed", "clients_unavailable", "unavailable_ids",
             "pm_eval_unavailable", "pm_eval_failed")


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
    with site_cluster(runtime_env={"worker_process_setup_hook": worker_audit}) as (cluster, site_nodes):
        nodes = {name: node.node_id for name, node in site_nodes.items()}
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

        # A coordinator started again after the last one died, as run_ray starts it (restart 1, which trains rounds
        # 1 and 2 again): at sites too, it marks the records of the rounds it trains again.
        shared = share(prepare_server(config_from_dict(config("hyper", "restarted"))))
        coordinator = Coordinator.options(num_cpus=0).remote(shared, str(root / "restarted"), None, (1, 2))
        out["restart_marks"] = [r.get("coordinator_restart") for r in ray.get(coordinator.train.remote())]
        ray.get(coordinator.close.remote())
        ray.kill(coordinator)

        out["node_loss"] = node_loss(cluster, site_nodes, paths)
    print("RESULT " + json.dumps(out), flush=True)


def is_training(pid: int) -> bool:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().startswith(b"ray::SiteActorImpl.train")


def node_loss(cluster, nodes: dict, paths: dict[str, Path]) -> dict:
    """A site that goes away and comes back (``nodes``: the sites' nodes, which it removes): site a's node removed
    while its actor trains one of its clients, away a round, then a node with its label back; at the end both
    sites removed. What tests/test_sites.py checks of it."""
    cfg = sites_config(paths, "linear", rounds=6, client_fraction=1.0, local_epochs=3)
    cfg["runtime"]["site_wait_s"] = 2.0
    cfg = config_from_dict(cfg)
    out: dict = {}
    executor = SitesExecutor(prepare_server(cfg), log=lambda s: print(s, flush=True))
    fed = Federation(executor.setup, executor, log=lambda s: print(s, flush=True))
    records = [fed.step(0)]

    # Round 2: site a's node goes while its actor trains one of its clients.
    [actor] = [executor.actors[a] for a in executor.site_actors[0]]
    pid = ray.get(actor.ready.remote())["pid"]
    thread = threading.Thread(target=lambda: records.append(fed.step(1)))
    thread.start()
    deadline = time.monotonic() + 120
    while not is_training(pid) and time.monotonic() < deadline:
        time.sleep(0.005)
    out["seen_training"] = is_training(pid)
    cluster.remove_node(nodes["a"])
    thread.join(240)
    out["round_2_ended"] = not thread.is_alive()
    rounds = {cid: fed.clients.rounds_trained(cid) for cid in fed.clients}
    before = executor.kept_states(rounds)["a"]["clients"]
    records.append(fed.step(2))  # site a still away

    # A node with site a's label (and its directory) comes back: its clients rejoin with their state.
    nodes["a"] = add_site_node(cluster, "a")
    records.append(fed.step(3))
    rounds = {cid: fed.clients.rounds_trained(cid) for cid in fed.clients}
    out["before"] = before
    out["after"] = executor.kept_states(rounds)["a"]["clients"]
    out["a_node_back"] = nodes["a"].node_id
    out["a_actor_node"] = ray.get(executor.actors[executor.site_actors[0][0]].ready.remote())["node_id"]
    out["finite"] = all(bool(torch.isfinite(v).all()) for v in fed.global_shared.values())

    # Both sites go: a round whose sampled clients are all away waits runtime.site_wait_s, then stops.
    for node in nodes.values():
        cluster.remove_node(node)
    t0 = time.monotonic()
    try:
        fed.step(4)
        out["all_away"] = None
    except RoundFailedError as e:
        out["all_away"] = str(e)
    out["waited_s"] = time.monotonic() - t0
    out["records"] = [{k: r.get(k) for k in LOSS_KEYS} for r in records]
    executor.close()
    return out


if __name__ == "__main__":
    target = Path(sys.argv[1])
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    main(target)
