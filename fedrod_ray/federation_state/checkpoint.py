"""Checkpoints of a federation's ``Snapshot`` that hold everything needed to resume a run exactly, written
incrementally.

Layout under ``<run_dir>/checkpoints/``:

    round_000007/global.safetensors   global weights, the generic rule's, the personalization method's
                                      and client-level DP's server state, FedBuff's updates in flight
    round_000007/manifest.json        config, round, rule, and for every client the file holding its state
    clients/<save>.safetensors        the states of the clients that changed since the save before
    clients/store-<id>.safetensors    states the client store wrote when its cache overflowed
    latest                            the name of the newest complete round folder

A client's state changes only when it trains, so a save writes the round's clients, not all of them,
and the manifest points every other client at the file an earlier save, or the client store
(``client_store``), wrote. When the files still
referenced hold more than ``COMPACT_RATIO`` times the live states (old versions of clients that trained
again), the next save writes every client afresh and the old files go.

A save commits in two steps, so that an interrupted one never hides the previous checkpoint: the round
folder becomes complete, then ``latest`` names it. Where the filesystem renames (local disk), the folder
is written under a temporary name and renamed when complete. An object store cannot rename a folder
(S3; GCS only copies), so there the files go in place under the round's prefix and ``manifest.json``,
written last, is the round's commit point: readers ignore a round folder without it, and the next save
removes what an interrupted one left (a round folder without a manifest, a temporary folder, client files
no kept manifest names). Tensors are safetensors and the rest JSON: loading never unpickles code.

A run saves off the round's critical path (``BackgroundSaves``): the save of round N's snapshot runs on
a thread of its own while round N+1 trains, at most one at a time.

The run's randomness is a pure function of (seed, round, client id) (client sampling, shuffling,
augmentation, initialisation), so the seed in the saved config *is* the RNG state to restore.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import uuid

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..clients.client import ClientState
from ..config import config_from_record
from ..outputs.storage import RunStorage
from .client_store import CLIENTS_DIR, Entry, Segment, StoredClients
from .state import Arrival, Snapshot

# 1: fedrod-ray 0.1 (FedDyn's state in fixed fields); 2: rule state named by its rule; 3: client states
# in files shared between saves (format 2 is still read).
FORMAT_VERSION = 3
READABLE = (2, 3)
KEEP = 2
COMPACT_RATIO = 3
SEGMENT_CLIENTS = 256  # client states per file a save writes: what it holds in memory at once
PRIVACY = "privacy"  # client-level DP's server state, in global.safetensors (absent: it keeps none)
ARRIVAL = "arrival"  # FedBuff's clients in flight, in global.safetensors: arrival/<send-out>/{delta,state}/<key>


class CheckpointFormatError(ValueError):
    """A checkpoint this version cannot read."""


def _name(rounds_done: int) -> str:
    return f"round_{rounds_done:06d}"


class CheckpointWriter:
    """Saves a federation's snapshots into one run directory, each writing only what changed.

    A client's state is unchanged when it is the same ``client_store.Entry`` (the store replaces an entry
    whenever the state changes) as this writer saved last time, or when it is already in a file of this
    run directory (the store's own files, which the checkpoint names instead of writing them again). A
    snapshot of states in memory only (not a ``StoredClients``) is saved whole.
    """

    def __init__(self, storage: RunStorage):
        self.storage = storage
        self.saved: dict[int, tuple[Entry, Segment]] = {}  # client -> (entry saved, the file holding it)

    # size: one atomic save: every file written before the manifest that commits them, in this order
    def save(self, snap: Snapshot) -> str:
        storage = self.storage
        name = _name(snap.rounds_done)
        self._remove_leftovers()
        clients = StoredClients.of(snap.clients)
        federation = isinstance(clients.ids, range) and clients.ids.start == 0
        files: dict[int, Segment] = {}
        changed = []
        for cid, entry in clients.entries.items():
            if not entry.tensors:
                continue
            if entry.segment is not None and entry.segment.in_clients_dir(storage):
                files[cid] = entry.segment
            elif cid in self.saved and self.saved[cid][0] is entry:
                files[cid] = self.saved[cid][1]
            else:
                changed.append(cid)
        live = len(files) + len(changed)
        if sum(s.size for s in set(files.values())) + len(changed) > COMPACT_RATIO * max(live, 1):
            changed, files = sorted([*files, *changed]), {}
        written: dict[int, tuple[Entry, Segment]] = {}
        for start in range(0, len(changed), SEGMENT_CLIENTS):
            states = {cid: clients[cid] for cid in changed[start:start + SEGMENT_CLIENTS]}
            segment = Segment.write(storage, f"{name}-{uuid.uuid4().hex[:8]}", states)
            written.update({cid: (clients.entries[cid], segment) for cid in states})
        files.update({cid: segment for cid, (_, segment) in written.items()})
        self.saved = {cid: (clients.entries[cid], segment) for cid, segment in files.items()}

        # Written in place on an object store (the manifest last), else renamed into place when complete.
        folder = f"checkpoints/{name}"
        if not storage.object_store:
            folder = f"checkpoints/.{name}.tmp-{uuid.uuid4().hex[:8]}"
        rule = snap.config.train.generic_rule
        global_tensors = {f"global/{k}": v.contiguous() for k, v in snap.global_shared.items()}
        global_tensors.update({f"server/{rule}/{k}": v.contiguous() for k, v in snap.server_state.items()})
        head = snap.config.train.head
        global_tensors.update({f"method/{head}/{k}": v.contiguous() for k, v in snap.method_state.items()})
        global_tensors.update({f"{PRIVACY}/{k}": v.contiguous() for k, v in snap.privacy_state.items()})
        global_tensors.update(_arrival_tensors(snap.in_flight))
        manifest = {
            "format_version": FORMAT_VERSION,
            "round": snap.rounds_done,
            "rule": rule,
            "config": snap.config.to_dict(),
            "estimate_offset": snap.estimate_offset,
            "clock": {"virtual_time": snap.virtual_time, "dispatches": snap.dispatches,
                      "in_flight": [_arrival_meta(a) for a in snap.in_flight]},
            # Clients 0 .. num_clients - 1, of which those with a state are listed (any other client's is the
            # default); a snapshot of other ids lists every one.
            "clients": {str(cid): {"rounds_trained": e.rounds_trained if (e := clients.entries.get(cid)) else 0,
                                   "file": files[cid].file if cid in files else None}
                        for cid in (sorted(clients.entries) if federation else sorted(clients.ids))},
        }
        if federation:
            manifest["num_clients"] = len(clients.ids)
        if snap.sites:
            manifest["sites"] = snap.sites
        self._discard(name)  # a complete folder of this round that ``latest`` never named (a resumed run)
        storage.write_bytes(f"{folder}/global.safetensors", st_save(global_tensors))
        # Compact: an indented dump goes through json's pure-Python encoder, slow at 10,000 clients.
        storage.write_bytes(f"{folder}/manifest.json", json.dumps(manifest, separators=(",", ":")).encode())
        if folder != f"checkpoints/{name}":
            storage.move_dir(folder, f"checkpoints/{name}")
        storage.write_bytes("checkpoints/latest", name.encode())
        clients.written(storage, written)
        self._retain(clients)
        return name

    def _remove_leftovers(self) -> None:
        """What an interrupted save left behind: never loaded (no manifest, or ``latest`` never named it).
        Its client files go in ``_retain``, which keeps only those a complete round's manifest names."""
        for leftover in self.storage.list_dirs("checkpoints"):
            temporary = leftover.startswith(".") and ".tmp-" in leftover
            if temporary or (leftover.startswith("round_") and not _complete(self.storage, leftover)):
                self.storage.delete_dir(f"checkpoints/{leftover}")

    def _discard(self, name: str) -> None:
        """Delete a round folder, its manifest first: a deletion cut short leaves an incomplete folder,
        never a manifest naming files that are gone."""
        self.storage.delete_file(f"checkpoints/{name}/manifest.json")
        self.storage.delete_dir(f"checkpoints/{name}")

    def _retain(self, clients: StoredClients) -> None:
        """Keep the newest KEEP round folders and the client files their manifests name or the client store
        reads from now."""
        rounds = [d for d in self.storage.list_dirs("checkpoints")
                  if d.startswith("round_") and _complete(self.storage, d)]
        for old in rounds[:-KEEP]:
            self._discard(old)
        files = self.storage.list_files(CLIENTS_DIR)
        # After the listing: a file the store writes meanwhile is either not listed or already live.
        needed = clients.live_files(self.storage)
        for kept in rounds[-KEEP:]:
            manifest = _read_manifest(self.storage, kept)
            needed |= {c.get("file") for c in manifest.get("clients", {}).values()}
        for file in files:
            if file not in needed and ".tmp-" not in file:
                self.storage.delete_file(f"{CLIENTS_DIR}/{file}")


class CheckpointSaveError(RuntimeError):
    """A save that ran in the background failed (raised by the next save, or when the run waits for it)."""


class _Save(threading.Thread):
    """One save on a thread of its own, keeping its outcome for whoever waits. Not a daemon: a process
    that exits with a save in flight finishes it first."""

    def __init__(self, writer: CheckpointWriter, snap: Snapshot):
        super().__init__(name=f"checkpoint-{_name(snap.rounds_done)}")
        self.writer, self.snap = writer, snap
        self.what = f"round {snap.rounds_done}'s checkpoint into {writer.storage.uri}/checkpoints"
        self.saved: str | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.saved = self.writer.save(self.snap)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits, never lost with the thread
            self.error = e
        self.snap = None  # the states it held may go as soon as they are written


class BackgroundSaves:
    """Checkpoint saves off the round's critical path: ``save`` hands a snapshot to a thread of its own and
    returns; ``wait`` blocks until that save is committed. At most one save is in flight: the next
    ``save`` waits for the one before, and raises its error if it failed (as ``wait`` does), so a failed
    save stops the run at the next checkpoint at the latest.

    The snapshot is handed over uncopied: the federation never writes into its state but replaces it (the
    global weights and server state each round, a client's ``ClientState`` when it trains), and
    ``Federation.snapshot`` copies the dicts that hold them, so the next round cannot change what is being
    written.
    """

    def __init__(self) -> None:
        self._in_flight: _Save | None = None
        self.committed: str | None = None  # the newest checkpoint a save committed

    def save(self, writer: CheckpointWriter, snap: Snapshot) -> None:
        self.wait()
        self._in_flight = _Save(writer, snap)
        self._in_flight.start()

    def wait(self) -> str | None:
        """The name of the checkpoint the save in flight committed (None: there was none)."""
        if self._in_flight is None:
            return None
        save = self._in_flight
        save.join()  # interrupted (Ctrl-C), the save stays in flight for the next wait
        self._in_flight = None
        error = save.error
        if error is not None:
            raise CheckpointSaveError(f"saving {save.what} failed: {type(error).__name__}: {error}") from error
        self.committed = save.saved
        return save.saved


def save_checkpoint(storage: RunStorage, snap: Snapshot) -> str:
    """A full save (every client's state) of ``snap``; runs save through a ``CheckpointWriter``."""
    return CheckpointWriter(storage).save(snap)


def _complete(storage: RunStorage, name: str) -> bool:
    return storage.exists(f"checkpoints/{name}/manifest.json")


def _read_manifest(storage: RunStorage, name: str) -> dict:
    return json.loads(storage.read_bytes(f"checkpoints/{name}/manifest.json"))


def latest_checkpoint_name(storage: RunStorage) -> str | None:
    if not storage.exists("checkpoints/latest"):
        return None
    return storage.read_bytes("checkpoints/latest").decode().strip()


def load_checkpoint(storage: RunStorage, name: str | None = None) -> Snapshot:
    name = name or latest_checkpoint_name(storage)
    if name is None:
        raise FileNotFoundError(f"no checkpoint in {storage.uri}/checkpoints")
    if not _complete(storage, name):
        raise FileNotFoundError(f"checkpoint {storage.uri}/checkpoints/{name} is incomplete (no manifest.json): "
                                "its save was interrupted")
    manifest = _read_manifest(storage, name)
    version = manifest.get("format_version")
    if version not in READABLE:
        raise CheckpointFormatError(
            f"checkpoint {storage.uri}/checkpoints/{name} has format version {version}; this version of "
            f"fedrod-ray reads formats {READABLE} (format 1 was written by fedrod-ray 0.1, before "
            "generic rules became plug-ins): start a new run, or resume it with the version that wrote it")
    tensors = st_load(storage.read_bytes(f"checkpoints/{name}/global.safetensors"))
    global_shared = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("global/")}
    server_prefix = f"server/{manifest['rule']}/"
    server = {k[len(server_prefix):]: v for k, v in tensors.items() if k.startswith(server_prefix)}
    config = config_from_record(manifest["config"])
    method_prefix = f"method/{config.train.head}/"
    method = {k[len(method_prefix):]: v for k, v in tensors.items() if k.startswith(method_prefix)}
    privacy = {k[len(PRIVACY) + 1:]: v for k, v in tensors.items() if k.startswith(f"{PRIVACY}/")}
    # Format 2 kept every client's state in the round folder; format 3 names a shared file per client. The
    # states are read from them when asked for (``client_store.StoredClients``).
    segments: dict[str, Segment] = {}
    entries: dict[int, Entry] = {}
    for cid, meta in manifest["clients"].items():
        rel = (f"checkpoints/{name}/clients.safetensors" if version == 2
               else f"{CLIENTS_DIR}/{meta['file']}" if meta["file"] else None)
        if rel is not None or meta["rounds_trained"]:
            segment = segments.setdefault(rel, Segment(storage, rel)) if rel is not None else None
            entries[int(cid)] = Entry(meta["rounds_trained"], segment, rel is not None, None if rel else False)
    ids = (range(manifest["num_clients"]) if "num_clients" in manifest
           else sorted(int(cid) for cid in manifest["clients"]))
    clients = StoredClients(ids, entries, {})
    # A checkpoint of a version before the estimate's offset (or the virtual clock) holds none: the next exact
    # evaluation sets it (the clock starts at zero).
    clock = manifest.get("clock", {})
    return Snapshot(manifest["round"], config, global_shared, server, clients,
                    {str(k): float(v) for k, v in manifest.get("estimate_offset", {}).items()}, method, privacy,
                    float(clock.get("virtual_time", 0.0)), int(clock.get("dispatches", 0)),
                    [_arrival(meta, tensors) for meta in clock.get("in_flight", [])], manifest.get("sites", {}))


def _arrival_tensors(in_flight: list[Arrival]) -> dict[str, torch.Tensor]:
    out = {}
    for a in in_flight:
        parts = {"delta": a.delta or {}, "state": a.state.tensors() if a.state is not None else {}}
        out.update({f"{ARRIVAL}/{a.dispatch}/{part}/{k}": v.contiguous()
                    for part, tensors in parts.items() for k, v in tensors.items()})
    return out


def _arrival_meta(a: Arrival) -> dict:
    """An arrival's fields but its tensors (``_arrival_tensors``): whether it has them, and its state's rounds."""
    meta = {f.name: getattr(a, f.name) for f in dataclasses.fields(Arrival) if f.name not in ("delta", "state")}
    return meta | {"trained": a.delta is not None,
                   "rounds_trained": a.state.rounds_trained if a.state is not None else None}


def _arrival(meta: dict, tensors: dict[str, torch.Tensor]) -> Arrival:
    prefix = f"{ARRIVAL}/{meta['dispatch']}/"
    parts: dict[str, dict[str, torch.Tensor]] = {"delta": {}, "state": {}}
    for k, v in tensors.items():
        if k.startswith(prefix):
            part, name = k[len(prefix):].split("/", 1)
            parts[part][name] = v
    fields = {k: v for k, v in meta.items() if k not in ("trained", "rounds_trained")}
    state = (ClientState.from_tensors(parts["state"], meta["rounds_trained"])
             if meta["rounds_trained"] is not None else None)
    return Arrival(**fields, delta=parts["delta"] if meta["trained"] else None, state=state)
