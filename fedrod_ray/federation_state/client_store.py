"""The client store: every client's committed state, the few most recently used in memory, the rest in
safetensors files read lazily, so that a federation's memory grows with its round and its cache, not with
its clients (docs/design.md, "The client store").

A client that never trained has no entry at all: its state is the default ``ClientState()``. One that has
a state has an ``Entry`` (its rounds, and the *segment* holding its tensors once they are on disk). A
segment is a safetensors file of client states keyed ``<client>/<part>/<name>`` under
``checkpoints/clients/``: the checkpoint's own client files, which the store reads a client at a time
(ranged reads of the file, through the run directory's filesystem), and the files the store writes itself
when its cache overflows with states that no file holds yet. A checkpoint names segments for every client
it does not write, so a state is on disk once, whoever wrote it (``checkpoint.CheckpointWriter``).

States are never written into, only replaced, so an entry and its cached state stay valid for any snapshot
(``StoredClients``) that took them; the store is thread-safe for the background save that reads them.
"""

from __future__ import annotations

import copy
import json
import operator
import struct
import tempfile
import threading
import uuid
from collections import Counter, OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

import torch
from safetensors.torch import save as st_save

from ..clients.client import ClientState
from ..outputs.storage import RunStorage
from ..server_math.aggregate import StateDict

CLIENTS_DIR = "checkpoints/clients"
# safetensors' dtype names (its format's header) and torch's.
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


class Segment:
    """One safetensors file of client states, read a client at a time: its header (which tensor lies where)
    is read once, then a client's tensors with one ranged read per contiguous run of them."""

    def __init__(self, storage: RunStorage, rel: str, header: bytes | None = None, owner: object = None):
        """``rel``: the file's path in ``storage``; ``header``: its first bytes, when known (just written);
        ``owner``: kept alive with the segment (the temporary directory it lies in)."""
        self.storage, self.rel, self.owner = storage, rel, owner
        self._index: dict[int, list[tuple[str, str, list[int], int, int]]] | None = None
        self._data_start = 0
        if header is not None:
            self._parse(header)

    @property
    def file(self) -> str:
        """Its name in ``CLIENTS_DIR`` (what a manifest names)."""
        return self.rel.rsplit("/", 1)[-1]

    def in_clients_dir(self, storage: RunStorage) -> bool:
        return self.storage.uri == storage.uri and self.rel == f"{CLIENTS_DIR}/{self.file}"

    @classmethod
    def write(cls, storage: RunStorage, name: str, states: Mapping[int, ClientState], owner: object = None) -> Segment:
        """Write ``states`` (each with tensors) as ``CLIENTS_DIR/<name>.safetensors``."""
        data = st_save({f"{cid}/{k}": v.contiguous() for cid, st in states.items() for k, v in st.tensors().items()})
        rel = f"{CLIENTS_DIR}/{name}.safetensors"
        storage.write_bytes(rel, data)
        return cls(storage, rel, data, owner)

    def _parse(self, head: bytes) -> None:
        (n,) = struct.unpack("<Q", head[:8])
        header = json.loads(head[8:8 + n])
        index: dict[int, list] = {}
        for key, info in header.items():
            if key == "__metadata__":
                continue
            cid, name = key.split("/", 1)
            index.setdefault(int(cid), []).append((name, info["dtype"], info["shape"], *info["data_offsets"]))
        for tensors in index.values():
            tensors.sort(key=lambda t: t[3])
        self._data_start, self._index = 8 + n, index

    @property
    def index(self) -> dict[int, list[tuple[str, str, list[int], int, int]]]:
        if self._index is None:
            with self.storage.open_random(self.rel) as f:
                (n,) = struct.unpack("<Q", f.read_at(8, 0))
                self._parse(f.read_at(8 + n, 0))
        return self._index

    @property
    def size(self) -> int:
        """How many client states it holds (current or superseded)."""
        return len(self.index)

    def has_model(self, cid: int) -> bool:
        """Whether client ``cid``'s state here has a model of its own (a local model or a personal part)."""
        return any(name.startswith(("personal/", "local_model/")) for name, *_ in self.index.get(cid, []))

    def read(self, cid: int) -> dict[str, torch.Tensor]:
        """Client ``cid``'s tensors, keyed ``<part>/<name>`` (``ClientState.from_tensors``)."""
        tensors = self.index.get(cid, [])
        out = {}
        with self.storage.open_random(self.rel) as f:
            i = 0
            while i < len(tensors):  # one read per run of adjacent tensors
                j = i + 1
                while j < len(tensors) and tensors[j][3] == tensors[j - 1][4]:
                    j += 1
                start = tensors[i][3]
                raw = f.read_at(tensors[j - 1][4] - start, self._data_start + start)
                for name, dtype, shape, begin, end in tensors[i:j]:
                    out[name] = _tensor(raw[begin - start:end - start], DTYPES[dtype], shape)
                i = j
        return out

    def __getstate__(self) -> dict:
        # Sent to another process (a Ray coordinator resuming a run) as where it is, nothing more.
        return {"storage": self.storage, "rel": self.rel}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["storage"], state["rel"])


def _index(cid: object) -> int | None:
    """A client id as a plain int (a numpy integer too, which ``range`` would compare one by one), else None."""
    try:
        return operator.index(cid)
    except TypeError:
        return None


def _tensor(raw: bytes, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


@dataclass(frozen=True, slots=True, eq=False)
class Entry:
    """A client with a state: how many rounds it trained and, once its tensors are on disk, the segment
    holding them. Replaced whenever the state changes, so an entry's identity is the state's version."""

    rounds_trained: int
    segment: Segment | None = None  # None: in memory only (changed since last written), or no tensors
    tensors: bool = True  # it has tensors (a state may have none and still count its rounds)
    model: bool | None = None  # it has a model of its own (None: the segment's index says)

    def has_model(self, cid: int) -> bool:
        """Whether client ``cid``'s state has a model of its own (a local model or a personal part)."""
        if self.model is None:
            return self.segment is not None and self.segment.has_model(cid)
        return self.model

    def load(self, cid: int) -> ClientState:
        tensors = self.segment.read(cid) if self.segment is not None and self.tensors else {}
        return ClientState.from_tensors(tensors, self.rounds_trained)


def entry_of(state: ClientState) -> Entry | None:
    """A new state's entry, still in memory only (None: the default state, which needs none)."""
    tensors = bool(state.tensors())
    if not tensors and state.rounds_trained == 0:
        return None
    return Entry(state.rounds_trained, None, tensors, state.local_model is not None or state.personal is not None)


class StoredClients(Mapping[int, ClientState]):
    """Every client's state at one moment (``Snapshot.clients``): the states then in memory, and where the
    others are. Reading a client not in memory reads its segment; a client without an entry has the
    default state."""

    def __init__(self, ids: range | list[int], entries: dict[int, Entry], memory: dict[int, ClientState],
                 store: ClientStore | None = None):
        self.ids, self.entries, self.memory, self.store = ids, entries, memory, store
        self._members = ids if isinstance(ids, range) else frozenset(ids)

    @classmethod
    def of(cls, clients: Mapping[int, ClientState]) -> StoredClients:
        """A view of states all in memory (a snapshot made by hand)."""
        if isinstance(clients, StoredClients):
            return clients
        entries = {cid: e for cid, st in clients.items() if (e := entry_of(st)) is not None}
        return cls(sorted(clients), entries, dict(clients))

    def __getitem__(self, cid: int) -> ClientState:
        if cid in self.memory:
            return self.memory[cid]
        entry = self.entries.get(cid)
        if entry is not None:
            return entry.load(cid)
        if cid in self:
            return ClientState()
        raise KeyError(cid)

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids)

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, cid: object) -> bool:
        return (i := _index(cid)) is not None and i in self._members

    def __deepcopy__(self, memo: dict) -> StoredClients:
        """A copy of every state, in memory, apart from the store."""
        return StoredClients.of({cid: copy.deepcopy(self[cid], memo) for cid in self.ids})

    def written(self, storage: RunStorage, saved: dict[int, tuple[Entry, Segment]]) -> None:
        """A checkpoint wrote these entries' states into these segments (the store learns where they are)."""
        if self.store is not None:
            self.store.written(storage, saved)

    def live_files(self, storage: RunStorage) -> set[str]:
        """The files in ``storage``'s ``CLIENTS_DIR`` that the store reads from now."""
        return self.store.live_files(storage) if self.store is not None else set()


class ClientStore(Mapping[int, ClientState]):
    """Clients ``0 .. n-1``'s committed states (``Federation.clients``), at most ``capacity`` of them in memory.

    ``store[c]`` reads client c's state (from memory, or its segment, then kept in memory as the most recently
    used), ``store[c] = state`` and ``update`` commit new ones. When more than ``capacity`` are in memory the
    least recently used go; those no file holds yet are written first, together, as one segment into
    ``storage`` (the run directory; a temporary directory until ``attach`` names it).
    """

    def __init__(self, num_clients: int, capacity: int, storage: RunStorage | None = None):
        self.ids = range(num_clients)
        self.capacity = capacity
        self._storage = storage
        self._temp: tempfile.TemporaryDirectory | None = None
        self._entries: dict[int, Entry] = {}
        self._cache: OrderedDict[int, ClientState] = OrderedDict()
        self._live: Counter[Segment] = Counter()  # segment -> entries pointing at it
        self._lock = threading.RLock()

    @property
    def storage(self) -> RunStorage:
        if self._storage is None:
            self._temp = tempfile.TemporaryDirectory(prefix="fedrod-clients-")
            self._storage = RunStorage(self._temp.name)
        return self._storage

    def attach(self, storage: RunStorage) -> None:
        """Write segments into ``storage`` (the run directory) from now on."""
        self._storage = storage

    @property
    def in_memory(self) -> int:
        """How many states are in memory."""
        return len(self._cache)

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids)

    def __contains__(self, cid: object) -> bool:
        return (i := _index(cid)) is not None and i in self.ids

    def __getitem__(self, cid: int) -> ClientState:
        with self._lock:
            state = self._cache.get(cid)
            if state is not None:
                self._cache.move_to_end(cid)
                return state
            entry = self._entries.get(cid)
            if entry is None:
                if cid not in self:
                    raise KeyError(cid)
                return ClientState()
            state = entry.load(cid)
            self._cache[cid] = state
            self._evict()
            return state

    def rounds_trained(self, cid: int) -> int:
        entry = self._entries.get(cid)
        return 0 if entry is None else entry.rounds_trained

    def has_model(self, cid: int) -> bool:
        """Whether client ``cid`` has a model of its own (a local model or a personal part), read without
        loading its state."""
        entry = self._entries.get(cid)
        return entry is not None and entry.has_model(cid)

    def __setitem__(self, cid: int, state: ClientState) -> None:
        self.update({cid: state})

    def update(self, states: Mapping[int, ClientState]) -> None:
        """Commit new states (then, if the cache overflows, write the oldest ones out together)."""
        with self._lock:
            for cid, state in states.items():
                if cid not in self:
                    raise KeyError(f"client {cid} is not in this federation of {len(self.ids)}")
                self._set(cid, entry_of(state))
                self._cache[cid] = state
                self._cache.move_to_end(cid)
            self._evict()

    def _set(self, cid: int, entry: Entry | None) -> None:
        old = self._entries.pop(cid, None)
        if old is not None and old.segment is not None:
            self._live[old.segment] -= 1
            if not self._live[old.segment]:
                del self._live[old.segment]
        if entry is not None:
            self._entries[cid] = entry
            if entry.segment is not None:
                self._live[entry.segment] += 1

    def _evict(self) -> None:
        over = len(self._cache) - self.capacity
        if over <= 0:
            return
        victims = [self._cache.popitem(last=False) for _ in range(over)]
        unwritten = {cid: st for cid, st in victims if (e := self._entries.get(cid)) is not None
                     and e.segment is None and e.tensors}
        if not unwritten:
            return
        try:
            segment = Segment.write(self.storage, f"store-{uuid.uuid4().hex[:12]}", unwritten, self._temp)
        except BaseException:
            self._cache.update(victims)  # nothing lost: they stay in memory, over the bound
            for cid, _ in victims:
                self._cache.move_to_end(cid, last=False)
            raise
        for cid in unwritten:
            self._set(cid, replace(self._entries[cid], segment=segment))

    def snapshot(self) -> StoredClients:
        """Every client's state as of now; stays valid while the store goes on."""
        with self._lock:
            return StoredClients(self.ids, dict(self._entries), dict(self._cache), self)

    def restore(self, clients: Mapping[int, ClientState]) -> None:
        """Replace every state by ``clients``' (a snapshot, or states in memory). A snapshot's segments in
        another directory are copied into this store's, so that it never reads a folder it does not own."""
        clients = StoredClients.of(clients)
        unknown = sorted(cid for cid in clients if cid not in self)
        if unknown:
            raise ValueError(f"the snapshot holds clients this federation does not have: {unknown[:10]}")
        with self._lock:
            self._entries.clear()
            self._cache.clear()
            self._live.clear()
            copies: dict[Segment, Segment] = {}
            for cid, entry in clients.entries.items():
                segment = entry.segment
                if segment is not None and not segment.in_clients_dir(self.storage):
                    if segment not in copies:
                        name = segment.file if segment.rel.startswith(f"{CLIENTS_DIR}/") else (
                            f"restored-{uuid.uuid4().hex[:12]}.safetensors")
                        self.storage.write_bytes(f"{CLIENTS_DIR}/{name}", segment.storage.read_bytes(segment.rel))
                        copies[segment] = Segment(self.storage, f"{CLIENTS_DIR}/{name}", owner=self._temp)
                    entry = replace(entry, segment=copies[segment])
                self._set(cid, entry)
                if entry.segment is None and entry.tensors:
                    self._cache[cid] = clients.memory[cid]
            self._evict()

    def written(self, storage: RunStorage, saved: dict[int, tuple[Entry, Segment]]) -> None:
        """A checkpoint into ``storage`` wrote these entries' states into these segments: where the store
        writes, an entry still current is now on disk, and leaving memory costs it nothing."""
        with self._lock:
            if self._storage is None or storage.uri != self._storage.uri:
                return
            for cid, (entry, segment) in saved.items():
                if self._entries.get(cid) is entry and entry.segment is None:
                    self._set(cid, replace(entry, segment=segment))

    def live_files(self, storage: RunStorage) -> set[str]:
        with self._lock:
            return {s.file for s in self._live if s.in_clients_dir(storage)}

    def local_models(self, num_clients: int) -> LocalModels:
        return LocalModels(self, num_clients)


class LocalModels(Mapping[int, StateDict | None]):
    """Every training client's last upload (None: it never trained), read from the store on access only:
    what ``Personalization.messages`` and ``server_update`` receive."""

    def __init__(self, clients: Mapping[int, ClientState], num_clients: int):
        self.clients, self.num_clients = clients, num_clients

    def __getitem__(self, cid: int) -> StateDict | None:
        if not 0 <= cid < self.num_clients:
            raise KeyError(cid)
        return self.clients[cid].local_model

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.num_clients))

    def __len__(self) -> int:
        return self.num_clients
