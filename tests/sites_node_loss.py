"""A site that goes away and comes back, on a real multi-node local Ray cluster: a head with no CPU, one worker
node per site (fedrod.site=a / b). Site a's node is removed while one of its clients trains, stays away a round,
then a node with the same label and directory comes back; at the end both sites go. Run by tests/test_sites.py
as ``python tests/sites_node_loss.py ROOT``; prints one ``RESULT <json>`` line.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import ray
import torch
from ray.cluster_utils import Cluster
from sites_data import make_sites, sites_config

from fedrod_ray.config import config_from_dict
from fedrod_ray.executors.sites import SitesExecutor
from fedrod_ray.federation_state.setup import prepare_server
from fedrod_ray.round_loop.federation import Federation, RoundFailedError

KEYS = ("round", "clients", "clients_done", "clients_failed", "clients_unavailable", "unavailable_ids",
        "pm_eval_unavailable", "pm_eval_failed")


def is_training(pid: int) -> bool:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().startswith(b"ray::SiteActorImpl.train")


def main(root: Path) -> None:
    data = Path(os.environ.get("FEDROD_TEST_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
    paths = make_sites(root, data)
    torch.set_num_threads(1)
    cfg = sites_config(paths, "linear", rounds=6, client_fraction=1.0, local_epochs=3)
    cfg["runtime"]["site_wait_s"] = 2.0
    cfg = config_from_dict(cfg)
    out: dict = {}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        nodes = {name: cluster.add_node(num_cpus=1, labels={"fedrod.site": name}) for name in ("a", "b")}
        ray.init(address=cluster.address, log_to_driver=False)
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
        before = executor.site_versions(rounds)["a"]["clients"]
        records.append(fed.step(2))  # site a still away

        # A node with site a's label (and its directory) comes back: its clients rejoin with their state.
        nodes["a"] = cluster.add_node(num_cpus=1, labels={"fedrod.site": "a"})
        records.append(fed.step(3))
        rounds = {cid: fed.clients.rounds_trained(cid) for cid in fed.clients}
        out["before"] = before
        out["after"] = executor.site_versions(rounds)["a"]["clients"]
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
        out["records"] = [{k: r.get(k) for k in KEYS} for r in records]
        executor.close()
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    target = Path(sys.argv[1])
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    main(target)
