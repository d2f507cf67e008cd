"""The server's own check of what a client sends before it is summed: it does not rest on the client's code.

An honest client never sends a non-finite update (it fails instead) and, under client-level DP, clips its update
to the clip norm before it leaves (``clients.client.clipped``). A client that does not, or a runtime between
it and the server that changed it, would make the global model non-finite, or break the sensitivity that epsilon
is accounted at. The server refuses such an upload: the client counts as failed, and nothing of it is summed.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .aggregate import StateDict
from .privacy import update_norm


def upload_problem(shared: StateDict, others: Iterable[StateDict], anchor: StateDict,
                   clip_norm: float | None) -> str | None:
    """Why the server refuses a client's upload (None: it is summed): a non-finite value in its ``shared``
    weights or in its ``others`` (the rule's and the method's uploads), or, with a ``clip_norm``, an update
    from the ``anchor`` it was sent that is longer than the clip norm (the client's clipping makes it at most
    that, bit for bit: ``privacy.clip_update``)."""
    for part in (shared, *others):
        if (key := non_finite(part)) is not None:
            return f"its upload is not finite ({key})"
    if clip_norm is not None:
        norm = update_norm(shared, anchor)
        if norm > clip_norm:
            return f"its update's L2 norm {norm:.6g} is over the clip norm {clip_norm:.6g} (privacy.clip_norm)"
    return None


def non_finite(state: StateDict) -> str | None:
    """The first key of ``state`` whose floating-point tensor holds a NaN or an infinity (None: none does)."""
    return next((k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())), None)
