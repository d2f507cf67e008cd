"""A client's class distribution from the request, keyed head ids, and the bounded head cache."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from .errors import ApiError


def class_dist(values: Sequence[float], class_names: Sequence[str], field: str) -> torch.Tensor:
    """The distribution a (float32, summing to 1) from non-negative weights or counts, one per class.

    Normalised in float64 and rounded once to float32, so counts and a distribution that are equal up to
    scale give the same a (and the same head_id); for counts this is exactly training's counts / sum. The
    weights are >= 0 (the schema), so abs() changes only -0.0, into the 0.0 it weighs the same as.
    """
    if len(values) != len(class_names):
        raise ApiError(field, f"has {len(values)} entries; this model has {len(class_names)} classes "
                              f"({', '.join(class_names[:12])}{', ...' if len(class_names) > 12 else ''})")
    a = torch.tensor(values, dtype=torch.float64).abs()
    total = a.sum()
    if total == 0:
        raise ApiError(field, "is all zero; a client needs at least one class")
    if not torch.isfinite(total):
        raise ApiError(field, "sums to more than a float can hold; scale it down")
    return (a / total).to(torch.float32)


def head_id(secret: bytes, version_id: str, a: torch.Tensor) -> str:
    """HMAC-SHA256, keyed by the server's ``secret``, of the model version and a's float32 bytes
    (little-endian), first 32 hex digits. Keyed, so that no one can compute a distribution's id offline
    and ask GET /v1/heads/{id} whether anyone posted that distribution (docs/privacy.md)."""
    data = a.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
    return hmac.new(secret, version_id.encode() + b":" + data, hashlib.sha256).hexdigest()[:32]


class HeadCache:
    """The most recently used zero-shot heads of one model version, at most ``size`` of them, under ids
    keyed by a random secret of its own: drawn from the OS's CSPRNG when the version is loaded, never stored
    or sent, so an id is good only in the process (Ray Serve: the replica) that made it, as its head is."""

    def __init__(self, size: int):
        self.size = size
        self.secret = secrets.token_bytes(32)
        self._heads: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()  # sync routes run on a thread pool

    def key(self, version_id: str, a: torch.Tensor) -> str:
        """The id of ``a``'s head under this cache's secret."""
        return head_id(self.secret, version_id, a)

    def get(self, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(a, head) for a head id, or None if it was never made or has been evicted."""
        with self._lock:
            found = self._heads.get(key)
            if found is not None:
                self._heads.move_to_end(key)
            return found

    def get_or_make(self, key: str, a: torch.Tensor,
                    make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        found = self.get(key)
        if found is not None:
            return found[1]
        head = make(a)  # outside the lock: two racing makers compute the same head
        with self._lock:
            self._heads[key] = (a, head)
            self._heads.move_to_end(key)
            while len(self._heads) > self.size:
                self._heads.popitem(last=False)
        return head

    def __len__(self) -> int:
        return len(self._heads)
