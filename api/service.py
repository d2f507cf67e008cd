"""The served model and what the routes do with it, apart from HTTP: heads, predictions, reload."""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedrod_ray.data.transforms import normalize
from fedrod_ray.models.export import FINAL_DIR, ExportError, ServedModel, load_final
from fedrod_ray.outputs.storage import RunStorage

from .errors import ApiError, Conflict, NotFound
from .heads import HeadCache, class_dist
from .schemas import DISTRIBUTION_FIELDS, PredictRequest


@dataclass(frozen=True)
class Loaded:
    """One model version and its zero-shot heads: a reload swaps both at once, and a request holds on to
    the one it started with."""

    served: ServedModel
    heads: HeadCache
    # Clients whose stored head is not all zero: one that never trained (or was held out) keeps its zero
    # phi, and its personalized predictions are the generic ones.
    trained_clients: frozenset[int]


@dataclass(frozen=True)
class Personal:
    """The personalized head a predict request chose, and how."""

    by: str
    head: torch.Tensor
    head_id: str | None = None
    client_id: int | None = None


def load(model_dir: str, head_cache_size: int, allowed_factories: Collection[str] = ()) -> Loaded:
    """The final/ of ``model_dir``, checked to give finite predictions; an ExportError saying why not.

    Whatever loading raises becomes an ExportError, SystemExit and KeyboardInterrupt included: an allowed
    factory is still code the directory chose to run, and it must not take the server down. Only opening
    the storage (an unknown URI scheme: ValueError, OSError) is left to the caller."""
    storage = RunStorage(model_dir)
    where = storage.path(FINAL_DIR)
    try:
        served = load_final(storage, allowed_factories)
        _check_finite(served, where)
    except ExportError:
        raise
    except BaseException as e:  # noqa: BLE001 - see the docstring
        raise ExportError(f"{where}: loading it raised {type(e).__name__}: {e}") from None
    trained = frozenset(cid for cid, head in served.personal_heads.items() if head.any())
    return Loaded(served, HeadCache(head_cache_size), trained)


@torch.inference_mode()
def _check_finite(served: ServedModel, where: str) -> None:
    """A diverged run's NaN weights, or a crafted final/, would make predictions NaN, which JSON cannot
    carry (the response would say null): the normalisation, the tensors and a forward of a probe batch (black,
    white and noise images) through every head the model serves must all be finite."""
    meta = served.meta
    for name, values in (("mean", meta.mean), ("std", meta.std)):
        if not all(map(math.isfinite, values)) or (name == "std" and min(values) <= 0):
            raise ExportError(f"{where}/meta.json: {name} is {values}; the normalisation needs finite values "
                              f"and a std > 0 (it divides the pixels)")
    tensors = {**served.model.state_dict(), **{f"client {k}": v for k, v in served.personal_heads.items()}}
    for name, t in tensors.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ExportError(f"{where}: {name} has non-finite values (a diverged run?)")
    c, h, w = meta.image_shape
    noise = torch.randint(0, 256, (1, c, h, w), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    probe = torch.cat([torch.zeros_like(noise), torch.full_like(noise, 255), noise])
    model = served.model
    z = model.features(normalize(probe, meta.mean, meta.std).contiguous(memory_format=torch.channels_last))
    logits = {"generic head": model.generic_logits(z)}
    if meta.head == "hyper":
        n = meta.num_classes
        for a, what in [(torch.full((n,), 1 / n), "uniform"), *((row, f"class {i}") for i, row in enumerate(torch.eye(n)))]:
            logits[f"hypernetwork's head for the {what} distribution"] = F.linear(z, served.zero_shot_head(a))
    for cid, head in served.personal_heads.items():
        logits[f"client {cid}'s head"] = F.linear(z, head)
    for name, value in logits.items():
        if not torch.isfinite(value).all():
            raise ExportError(f"{where}: the {name} gives non-finite logits for a probe batch of black, white "
                              f"and noise images (weights too large?)")


def _need_head(loaded: Loaded, want: str, field: str) -> None:
    meta = loaded.served.meta
    have = meta.head
    if have == want:
        return
    if want == "hyper" and meta.new_client in ("data", "training"):
        what = {"data": "forward passes over its own examples", "training": "training steps on its own examples"}
        raise Conflict(field, f"method '{meta.method}' personalizes a new client from its data "
                              f"({what[meta.new_client]}), not from a class distribution: this service takes no "
                              f"client data; the client runs that step itself (GET /v1/model: new_client)")
    hint = {"hyper": "it has no hypernetwork to make a head from a class distribution",
            "linear": "it stores no per-client heads"}[want]
    raise Conflict(field, f"needs a model trained with head '{want}', but this one has head '{have}': {hint}")


def request_dist(loaded: Loaded, req) -> tuple[str, torch.Tensor] | None:
    """(field, a) from class_distribution or class_counts, or None when neither is given."""
    for field in DISTRIBUTION_FIELDS:
        values = getattr(req, field)
        if values is not None:
            _need_head(loaded, "hyper", field)
            return field, class_dist(values, loaded.served.meta.class_names, field)
    return None


def zero_shot(loaded: Loaded, a: torch.Tensor) -> tuple[str, torch.Tensor]:
    """(head_id, H(a; nu)), from the cache when this distribution was seen before."""
    key = loaded.heads.key(loaded.served.version_id, a)
    return key, loaded.heads.get_or_make(key, a, loaded.served.zero_shot_head)


def cached_head(loaded: Loaded, key: str, field: str = "head_id") -> tuple[torch.Tensor, torch.Tensor]:
    _need_head(loaded, "hyper", field)
    found = loaded.heads.get(key)
    if found is None:
        raise NotFound(field, f"no head {key} for model version {loaded.served.version_id}: it was made "
                              f"for another version, evicted (the cache keeps {loaded.heads.size}), or "
                              f"never made; POST the distribution to /v1/heads again")
    return found


def personal_head(loaded: Loaded, req: PredictRequest) -> Personal | None:
    if req.client_id is not None:
        _need_head(loaded, "linear", "client_id")
        try:
            return Personal("client_id", loaded.served.personal_head(req.client_id), client_id=req.client_id)
        except KeyError:  # who took part is not said: the client lists are the admin's
            raise NotFound("client_id", f"no client {req.client_id} in this model") from None
    if req.head_id is not None:
        return Personal("head_id", cached_head(loaded, req.head_id)[1], head_id=req.head_id)
    found = request_dist(loaded, req)
    if found is None:
        return None
    field, a = found
    key, head = zero_shot(loaded, a)
    return Personal(field, head, head_id=key)


def zero_head_note(personal: Personal) -> str | None:
    """Why a personalized prediction is the generic one, or None when its head does something."""
    if personal.head.any():
        return None
    if personal.by == "client_id":
        why = f"client {personal.client_id}'s head is all zero (the client never trained, or was held out)"
    else:
        why = "the hypernetwork makes an all-zero head for this distribution (is the model trained?)"
    return f"{why}: the personalized predictions are the generic ones"


@torch.inference_mode()
def probabilities(loaded: Loaded, requests: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
                  ) -> list[tuple[torch.Tensor, ...]]:
    """For each (images, P-head or None) of ``requests``: softmax of the generic logits and, with a P-head,
    of the personalized ones h_G(z) + h_P(z). One pass of the extractor over all their images, so requests
    batched together (Ray Serve) cost one forward."""
    model = loaded.served.model
    sizes = [len(x) for x, _ in requests]
    x = torch.cat([x for x, _ in requests]) if len(requests) > 1 else requests[0][0]
    z = model.features(x.contiguous(memory_format=torch.channels_last))
    generic = model.generic_logits(z)
    out = []
    for (_, head), zi, gi in zip(requests, z.split(sizes), generic.split(sizes)):
        # The head comes from the cache or a client's stored phi_m, not the model's own P-head, hence not
        # model.personal_logits; the sum is the same.
        out.append((gi.softmax(1),) if head is None else (gi.softmax(1), (gi + F.linear(zi, head)).softmax(1)))
    return out


def batched_probabilities(requests: Sequence[tuple[Loaded, torch.Tensor, torch.Tensor | None]],
                          ) -> list[tuple[torch.Tensor, ...]]:
    """``probabilities`` of requests that may hold different model versions (a reload came between them):
    one pass per version, answers in the requests' order."""
    by_version: dict[int, list[int]] = {}
    for i, (loaded, _, _) in enumerate(requests):
        by_version.setdefault(id(loaded), []).append(i)
    out: list = [None] * len(requests)
    for indices in by_version.values():
        loaded = requests[indices[0]][0]
        for i, probs in zip(indices, probabilities(loaded, [requests[i][1:] for i in indices])):
            out[i] = probs
    return out


class ModelService:
    """Holds the current ``Loaded`` and swaps it on reload; a failed reload leaves it as it was.

    A reload loads on a thread of its own, not the request pool, one at a time, and is answered within
    ``reload_timeout_s``: a final/ that hangs the loader (a remote store that stops answering, an allowed
    factory that never returns) costs that one thread, never a worker that requests need. While a reload is
    running, even one whose answer has timed out, another is refused rather than queued."""

    def __init__(self, model_dir: str, head_cache_size: int, allowed_factories: Collection[str] = (),
                 reload_timeout_s: float = 60.0):
        self.model_dir = model_dir
        self.head_cache_size = head_cache_size
        self.allowed_factories = allowed_factories
        self.reload_timeout_s = reload_timeout_s
        self.current = load(model_dir, head_cache_size, allowed_factories)
        self._reloading: asyncio.Future | None = None  # on the event loop only: no lock
        self._reload_started = 0.0

    async def reload(self, model_dir: str | None) -> tuple[Loaded, Loaded]:
        """(previous, now); raises Conflict naming the problem if the final/ cannot be served."""
        loop = asyncio.get_running_loop()
        if self._reloading is not None and not self._reloading.done():
            running = loop.time() - self._reload_started
            raise Conflict("model_dir", f"a reload is running (for {running:.0f} s): retry once it has ended")
        target = model_dir or self.model_dir
        previous = self.current
        still = f"still serving version {previous.served.version_id}"
        self._reloading, self._reload_started = loop.create_future(), loop.time()
        # A daemon thread: one that never returns must not hold up the process's exit either.
        threading.Thread(target=_load_into, args=(loop, self._reloading, target, self.head_cache_size,
                                                  self.allowed_factories),
                         name="fedrod-reload", daemon=True).start()
        try:
            loaded = await asyncio.wait_for(asyncio.shield(self._reloading), self.reload_timeout_s)
        except asyncio.TimeoutError:
            raise Conflict("model_dir", f"loading {target!r} did not end within {self.reload_timeout_s:g} s; "
                                        f"{still} (another reload is refused until it ends)") from None
        except ExportError as e:
            raise Conflict("model_dir", f"{e}; {still}") from None
        except (ValueError, OSError) as e:  # e.g. a URI scheme pyarrow does not know
            raise ApiError("model_dir", f"cannot open {target!r}: {e}") from None
        # The same version keeps its cache of heads.
        if loaded.served.version_id != previous.served.version_id:
            self.current = loaded
        self.model_dir = target
        return previous, self.current


def _load_into(loop: asyncio.AbstractEventLoop, future: asyncio.Future, *args) -> None:
    """``load(*args)``, its result or exception set on ``future`` (of ``loop``)."""
    try:
        result, error = load(*args), None
    except BaseException as e:  # noqa: BLE001 - load makes what it can an ExportError; the rest is passed on
        result, error = None, e

    def settle():
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    with contextlib.suppress(RuntimeError):  # the loop has closed (the server stopped): no one waits
        loop.call_soon_threadsafe(settle)
