"""Checkpoints that hold everything needed to resume a run exactly.

Layout under ``<run_dir>/checkpoints/``: one folder per saved round (``round_000007/`` with
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

FORMAT_VERSION = 1
KEEP = 2


@dataclass
class Checkpoint:
    round_idx: int  # the last completed round
    config: ExperimentConfig
    global_shared: StateDict
    server_state: StateDict | None  # FedDyn's h, when used
    clients: dict[int, ClientState]


def _name(round_idx: int) -> str:
    return f"round_{round_idx:06d}"


def save_checkpoint(storage: RunStorage, ckpt: Checkpoint) -> str:
    name = _name(ckpt.round_idx)
    tmp = f"checkpoints/.{name}.tmp-{uuid.uuid4().hex[:8]}"
    global_tensors = {f"global/{k}": v.contiguous() for k, v in ckpt.global_shared.items()}
    global_tensors.update({f"server/{k}": v.contiguous() for k, v in (ckpt.server_state or {}).items()})
    client_tensors = {f"{cid}/{k}": v.contiguous() for cid, st in ckpt.clients.items() for k, v in st.tensors().items()}
    manifest = {
        "format_version": FORMAT_VERSION,
        "round": ckpt.round_idx,
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


def load_checkpoint(storage: RunStorage, name: str | None = None) -> Checkpoint:
    name = name or latest_checkpoint_name(storage)
    if name is None:
        raise FileNotFoundError(f"no checkpoint in {storage.uri}/checkpoints")
    manifest = json.loads(storage.read_bytes(f"checkpoints/{name}/manifest.json"))
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {name}: unsupported format version {manifest.get('format_version')}")
    tensors = st_load(storage.read_bytes(f"checkpoints/{name}/global.safetensors"))
    global_shared = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("global/")}
    server = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("server/")}
    per_client: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in st_load(storage.read_bytes(f"checkpoints/{name}/clients.safetensors")).items():
        cid, rest = k.split("/", 1)
        per_client.setdefault(int(cid), {})[rest] = v
    clients = {
        int(cid): ClientState.from_tensors(per_client.get(int(cid), {}), meta["rounds_trained"])
        for cid, meta in manifest["clients"].items()
    }
    return Checkpoint(manifest["round"], config_from_dict(manifest["config"]), global_shared, server or None, clients)


def save_final(storage: RunStorage, global_shared: StateDict, meta: dict) -> None:
    """The model the HTTP service loads: shared weights plus what is needed to rebuild the network."""
    storage.write_bytes("final/model.safetensors", st_save({k: v.contiguous() for k, v in global_shared.items()}))
    storage.write_bytes("final/meta.json", json.dumps(meta, indent=1).encode())
