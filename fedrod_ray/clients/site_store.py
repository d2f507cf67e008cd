"""A site's store: its clients' states, kept at the site (docs/sites.md), written and read by its actors only.

Each state is a safetensors file ``<client>/<version>.safetensors`` in the site's storage (a directory its
nodes see, or an object-store URI), its version the rounds its client has trained, which is what the server
knows of it, with the file's sha256. Writing a version again (a round trained again after a resume) replaces
it; the server names the version and hash it committed, and a state whose file does not have that hash is
refused (``SiteStateError``), never mixed into the run. Versions older than any a kept checkpoint can name
are deleted as the run goes (``prune``). The ``capacity`` most recently used states stay in
memory, as in the server's client store (``federation_state.client_store``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..outputs.storage import RunStorage
from .client import ClientState


class SiteStateError(RuntimeError):
    """A site's store does not hold the state the server committed for one of its clients."""


class SiteStore:
    """One site's client states by (client name, version), with their sha256."""

    def __init__(self, uri: str, capacity: int):
        self.storage = RunStorage(uri)
        self.capacity = capacity
        self._cache: OrderedDict[tuple[str, int], tuple[str, ClientState]] = OrderedDict()

    @staticmethod
    def _rel(name: str, version: int) -> str:
        return f"{name}/{version}.safetensors"

    def save(self, name: str, state: ClientState) -> str:
        """Write client ``name``'s state as its version ``state.rounds_trained``; returns the file's sha256."""
        data = st_save({k: v.contiguous() for k, v in state.tensors().items()})
        digest = hashlib.sha256(data).hexdigest()
        self.storage.write_bytes(self._rel(name, state.rounds_trained), data)
        self._keep((name, state.rounds_trained), digest, state)
        return digest

    def load(self, name: str, version: int, digest: str | None) -> ClientState:
        """Client ``name``'s state at ``version`` (0: the initial state, which has no file), which must have the
        sha256 ``digest`` the server committed."""
        if version == 0:
            return ClientState()
        cached = self._cache.get((name, version))
        if cached is not None and cached[0] == digest:
            self._cache.move_to_end((name, version))
            return cached[1]
        rel = self._rel(name, version)
        if not self.storage.exists(rel):
            raise SiteStateError(f"site store {self.storage.uri}: client {name} has no state of version {version} "
                                 "(the rounds it trained), which the server committed; this is not the store the "
                                 "run wrote")
        data = self.storage.read_bytes(rel)
        found = hashlib.sha256(data).hexdigest()
        if found != digest:
            raise SiteStateError(f"site store {self.storage.uri}: client {name}'s state of version {version} has "
                                 f"sha256 {found[:12]}..., the server committed {str(digest)[:12]}...: refusing to "
                                 "mix another run's (or a changed) state into this one")
        state = ClientState.from_tensors(st_load(data), version)
        self._keep((name, version), digest, state)
        return state

    def check(self, committed: dict[str, tuple[int, str]]) -> list[str]:
        """What of ``committed`` (client name -> (version, sha256)) this store does not hold as committed: one
        line per client, empty when it holds every one."""
        problems = []
        for name, (version, digest) in sorted(committed.items()):
            try:
                self.load(name, version, digest)
            except SiteStateError as e:
                problems.append(str(e))
        return problems

    def prune(self, floor: dict[str, int]) -> int:
        """Delete each client's versions older than ``floor[name]`` (versions no kept checkpoint can name);
        returns how many files went."""
        gone = 0
        for name, oldest in floor.items():
            for file in self.storage.list_files(name):
                version = file.removesuffix(".safetensors")
                if version.isdigit() and int(version) < oldest:
                    self.storage.delete_file(f"{name}/{file}")
                    self._cache.pop((name, int(version)), None)
                    gone += 1
        return gone

    def _keep(self, key: tuple[str, int], digest: str, state: ClientState) -> None:
        self._cache[key] = (digest, state)
        self._cache.move_to_end(key)
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
