"""A SuperNode's side: its clients' data (``NodeData``, what ``split`` writes to each participant) and their
state on its own disk (``NodeStates``), which never leaves it, and where both are (``node_paths``)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from fedrod_ray.clients.client import ClientContext, ClientHost, ClientState
from fedrod_ray.config import ExperimentConfig
from fedrod_ray.config.records import fixed_settings
from fedrod_ray.data.transforms import normalize
from fedrod_ray.federation_state.setup import Setup
from fedrod_ray.models.metrics import TestSet

DATA_FILE, META_FILE = "node.safetensors", "node.json"
# The run config keys that place the simulated SuperNodes of Flower's simulation engine (``node_paths``).
SIM_DATA, SIM_STATE = "sim-data-path", "sim-state-path"
_NODE_DIR = re.compile(r"^node\d+$")


def simulated() -> bool:
    """Whether this ClientApp runs on Flower's simulation engine: inside one of its Ray actors (a deployed
    SuperNode runs its ClientApps in processes of its own, without Ray)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def node_paths(node_config: Mapping, run_config: Mapping, in_simulation: bool) -> tuple[Path, Path]:
    """This SuperNode's data folder and the folder of its clients' states.

    A deployed SuperNode names both in its node config (``data-path``, ``state-path``), and never takes them
    from the server's run config. Flower's simulation engine gives its SuperNodes no node config but their
    ``partition-id`` and ``num-partitions``: simulated SuperNode i reads ``node<i>`` of the run config's
    ``sim-data-path`` (what ``split`` wrote, one folder per simulated node) and keeps its clients' states
    under ``node<i>`` of its ``sim-state-path``."""
    if "data-path" in node_config:
        if "state-path" not in node_config:
            raise ValueError("this SuperNode's node config names a data-path but no state-path: add "
                             "state-path=\"...\", the folder where its clients' states stay (docs/flower.md)")
        return Path(str(node_config["data-path"])), Path(str(node_config["state-path"]))
    if not in_simulation:
        raise ValueError("this SuperNode's node config names no data-path: start it with --node-config "
                         "'data-path=\"...\" state-path=\"...\"' (docs/flower.md)")
    data, state = str(run_config.get(SIM_DATA, "")), str(run_config.get(SIM_STATE, ""))
    if not data or not state:
        raise ValueError(f"run config {SIM_DATA} and {SIM_STATE} must name the simulated SuperNodes' data "
                         "(python -m fedrod_ray_flower.split) and their clients' states")
    nodes = sum(1 for f in os.listdir(data) if _NODE_DIR.match(f)) if os.path.isdir(data) else 0
    if nodes != int(node_config["num-partitions"]):
        raise ValueError(f"run config {SIM_DATA}={data!r} holds {nodes} SuperNodes' data, the simulation has "
                         f"{node_config['num-partitions']} (federation config num-supernodes)")
    i = int(node_config["partition-id"])
    return Path(data) / f"node{i}", Path(state) / f"node{i}"


@dataclass
class NodeData:
    """One participant's clients: their training examples (uint8 images, labels) and class counts, and the
    test set their personalized models are scored on, with the normalization every client uses."""

    client_ids: list[int]
    train_x: torch.Tensor
    train_y: torch.Tensor
    offsets: list[int]  # client_ids[i]'s rows: offsets[i]:offsets[i + 1]
    counts: torch.Tensor  # len(client_ids) x classes
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    augment: bool

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file({"train_x": self.train_x.contiguous(), "train_y": self.train_y.contiguous(),
                   "counts": self.counts.contiguous(), "test_x": self.test_x.contiguous(),
                   "test_y": self.test_y.contiguous()}, str(path / DATA_FILE))
        (path / META_FILE).write_text(json.dumps(
            {"client_ids": self.client_ids, "offsets": self.offsets, "num_classes": self.num_classes,
             "mean": list(self.mean), "std": list(self.std), "augment": self.augment}, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> NodeData:
        path = Path(path)
        if not (path / DATA_FILE).is_file() or not (path / META_FILE).is_file():
            raise FileNotFoundError(f"node config data-path={str(path)!r}: no {DATA_FILE} and {META_FILE} there "
                                    "(python -m fedrod_ray_flower.split writes them)")
        meta = json.loads((path / META_FILE).read_text())
        t = load_file(str(path / DATA_FILE))
        return cls(meta["client_ids"], t["train_x"], t["train_y"], meta["offsets"], t["counts"], t["test_x"],
                   t["test_y"], meta["num_classes"], tuple(meta["mean"]), tuple(meta["std"]), meta["augment"])

    @classmethod
    def from_setup(cls, setup: Setup, client_ids: list[int]) -> NodeData:
        """The share of ``client_ids`` of a run's data (``split``: a federation simulated from one dataset)."""
        ds, part = setup.dataset, setup.partition
        if part.test_clients is not None:
            raise ValueError("clients with test sets of their own are not supported on Flower yet")
        rows = [torch.as_tensor(part.client_indices[c], dtype=torch.long) for c in client_ids]
        offsets = np.cumsum([0] + [len(r) for r in rows]).tolist()
        idx = torch.cat(rows) if rows else torch.empty(0, dtype=torch.long)
        return cls(list(client_ids), ds.train_x[idx], ds.train_y[idx], offsets,
                   torch.as_tensor(part.counts[client_ids], dtype=torch.long), ds.test_x, ds.test_y,
                   ds.num_classes, ds.mean, ds.std, setup.augment)

    def host(self, cfg: ExperimentConfig, device: str = "cpu") -> ClientHost:
        """fedrod-ray's client host over this node's clients (the one the in-process and Ray runtimes use)."""
        indices = {c: np.arange(self.offsets[i], self.offsets[i + 1]) for i, c in enumerate(self.client_ids)}
        counts = {c: self.counts[i].numpy() for i, c in enumerate(self.client_ids)}
        test = TestSet(normalize(self.test_x, self.mean, self.std), self.test_y, self.num_classes)
        return ClientHost(cfg, ClientContext(self.train_x, self.train_y, indices, counts, test, self.mean,
                                             self.std, self.augment, device=device))


def run_key(cfg: ExperimentConfig) -> str:
    """The folder of a run's client states under a node's state-path: a hash of the run's config, less what a
    resumed run may change (``fixed_settings``), and of its run directory on the server's machine.

    Flower's run id changes when a killed run is started again, so it cannot name the run: the config and the
    run directory (one ServerApp at a time writes it) do, the same for the resumed run. The node computes the
    name itself from the whole config it trains with, so a server cannot name another run's folder: to reach
    run A's states a run must be A (A's config, A's run directory), and then it trains A's clients as A would."""
    settings = {**fixed_settings(cfg), "run_dir": cfg.run_dir}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()
    return f"run-{digest[:24]}"


_VERSION = re.compile(r"^r(\d+)\.safetensors$")


class NodeStates:
    """Each client's state (``ClientState``: its personal part, its rule's and objective's state, its momentum,
    its last local model) in one run under ``root``/client_<id>/r<round>.safetensors, one file per round it
    trained in; ``root`` is the run's own folder (``run_key``), so nothing here reads or drops another run's.

    A round reads the newest state from before it. The server may resume from a checkpoint a few rounds back
    (a killed ServerApp): a round ``r`` then drops every state from round ``r`` on, which belonged to the
    rounds the server lost, and states older than the server's checkpoint window are removed."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def _dir(self, cid: int) -> Path:
        return self.root / f"client_{cid}"

    def _versions(self, cid: int) -> list[int]:
        d = self._dir(cid)
        if not d.is_dir():
            return []
        return sorted(int(m.group(1)) for f in os.listdir(d) if (m := _VERSION.match(f)))

    def load(self, cid: int, rounds_done: int) -> ClientState:
        """Client ``cid``'s state after the first ``rounds_done`` rounds (empty: it has not trained yet)."""
        before = [v for v in self._versions(cid) if v < rounds_done]
        if not before:
            return ClientState()
        path = self._dir(cid) / f"r{before[-1]}.safetensors"
        tensors = load_file(str(path))
        with open(path, "rb") as f:  # safetensors' header holds the metadata
            n = int.from_bytes(f.read(8), "little")
            meta = json.loads(f.read(n)).get("__metadata__", {})
        return ClientState.from_tensors(tensors, int(meta["rounds_trained"]))

    def save(self, cid: int, round_idx: int, state: ClientState) -> None:
        """Client ``cid``'s state after training in round ``round_idx``, written whole or not at all."""
        d = self._dir(cid)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".r{round_idx}.tmp"
        save_file({k: v.contiguous() for k, v in state.tensors().items()}, str(tmp),
                  metadata={"rounds_trained": str(state.rounds_trained)})
        os.replace(tmp, d / f"r{round_idx}.safetensors")

    def start_round(self, cids: list[int], round_idx: int, keep_rounds: int) -> None:
        """Before round ``round_idx``: drop the states from it on (a resumed server's lost rounds) and those
        older than ``keep_rounds`` rounds back, except each client's newest one from before that."""
        for cid in cids:
            versions = self._versions(cid)
            old = [v for v in versions if v < round_idx - keep_rounds]
            for v in [v for v in versions if v >= round_idx] + old[:-1]:
                (self._dir(cid) / f"r{v}.safetensors").unlink(missing_ok=True)
