"""Checkpoints that hold everything needed to resume a run exactly.

Layout under ``<run_dir>/checkpoints/``: one folder per saved round (``round_000007/`` after round 7, with
``global.safetensors``, ``clients.safetensors`` and ``manifest.json``) and a ``latest`` file naming the
newest complete one. A folder is written under a temporary name and renamed when complete, and
``latest`` is replaced atomically after that, so an interrupted save never hides the previous
checkpoint. Tensors are stored as safetensors and the rest as JSON: loading never unpickles code.

The run's randomness is a pure function of (seed, round, client id) (client sampling, shuffling,
augmentation, initialisation), so the seed in the saved config *is* the RNG state to restore.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .aggregate import StateDict
from .client import ClientState
from .config import ExperimentConfig, config_from_dict
from .storage import RunStorage

# 1: fedrod-ray 0.1 (FedDyn's state in fixed fields); 2: rule state named by its rule.
FORMAT_VERSION = 2
KEEP = 2


class CheckpointFormatError(ValueError):
    """A checkpoint this version cannot read."""


@dataclass
class Snapshot:
    """A federation's full state after a round: what ``Federation.snapshot`` gives and ``restore`` takes."""

    rounds_done: int  # rounds completed: the next round's 0-based index, "round N" for users
    config: ExperimentConfig
    global_shared: StateDict
    server_state: StateDict  # owned by config.train.generic_rule (empty if it keeps none)
    clients: dict[int, ClientState]


def _name(rounds_done: int) -> str:
    return f"round_{rounds_done:06d}"


def save_checkpoint(storage: RunStorage, ckpt: Snapshot) -> str:
    name = _name(ckpt.rounds_done)
    # What an interrupted save left behind: never loaded (``latest`` never named it), removed here.
    for leftover in storage.list_dirs("checkpoints"):
        if leftover.startswith(".") and ".tmp-" in leftover:
            storage.delete_dir(f"checkpoints/{leftover}")
    tmp = f"checkpoints/.{name}.tmp-{uuid.uuid4().hex[:8]}"
    global_tensors = {f"global/{k}": v.contiguous() for k, v in ckpt.global_shared.items()}
    rule = ckpt.config.train.generic_rule
    global_tensors.update({f"server/{rule}/{k}": v.contiguous() for k, v in ckpt.server_state.items()})
    client_tensors = {f"{cid}/{k}": v.contiguous() for cid, st in ckpt.clients.items() for k, v in st.tensors().items()}
    manifest = {
        "format_version": FORMAT_VERSION,
        "round": ckpt.rounds_done,
        "rule": rule,
        "config": ckpt.config.to_dict(),
        "clients": {str(cid): {"rounds_trained": st.rounds_trained} for cid, st in sorted(ckpt.clients.items())},
    }
    storage.write_bytes(f"{tmp}/global.safetensors", st_save(global_tensors))
    storage.write_bytes(f"{tmp}/clients.safetensors", st_save(client_tensors) if client_tensors else st_save({}))
    storage.write_bytes(f"{tmp}/manifest.json", json.dumps(manifest, indent=1).encode())
    storage.delete_dir(f"checkpoints/{name}")
    storage.move_dir(tmp, f"checkpoints/{name}")
    storage.write_bytes("checkpoints/latest", name.encode())
    saved = [d for d in storage.list_dirs("checkpoints") if d.startswith("round_")]
    for old in saved[:-KEEP]:
        storage.delete_dir(f"checkpoints/{old}")
    return name


def latest_checkpoint_name(storage: RunStorage) -> str | None:
    if not storage.exists("checkpoints/latest"):
        return None
    return storage.read_bytes("checkpoints/latest").decode().strip()


def load_checkpoint(storage: RunStorage, name: str | None = None) -> Snapshot:
    name = name or latest_checkpoint_name(storage)
    if name is None:
        raise FileNotFoundError(f"no checkpoint in {storage.uri}/checkpoints")
    manifest = json.loads(storage.read_bytes(f"checkpoints/{name}/manifest.json"))
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointFormatError(
            f"checkpoint {storage.uri}/checkpoints/{name} has format version {version}; this version of "
            f"fedrod-ray reads format {FORMAT_VERSION} only (format 1 was written by fedrod-ray 0.1, before "
            "generic rules became plug-ins): start a new run, or resume it with the version that wrote it")
    tensors = st_load(storage.read_bytes(f"checkpoints/{name}/global.safetensors"))
    global_shared = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("global/")}
    server_prefix = f"server/{manifest['rule']}/"
    server = {k[len(server_prefix):]: v for k, v in tensors.items() if k.startswith(server_prefix)}
    per_client: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in st_load(storage.read_bytes(f"checkpoints/{name}/clients.safetensors")).items():
        cid, rest = k.split("/", 1)
        per_client.setdefault(int(cid), {})[rest] = v
    clients = {
        int(cid): ClientState.from_tensors(per_client.get(int(cid), {}), meta["rounds_trained"])
        for cid, meta in manifest["clients"].items()
    }
    return Snapshot(manifest["round"], config_from_dict(manifest["config"]), global_shared, server, clients)
