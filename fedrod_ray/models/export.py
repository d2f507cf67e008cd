"""Save and load a run's ``final/`` directory: the model the HTTP service serves.

``final/`` holds
  model.safetensors     theta, psi and (hyper) nu, keyed as in ``FedModel.state_dict()``
  personal.safetensors  (linear head only) every client's phi_m, keyed by ``str(client_id)``, (C, feature_dim)
  meta.json             format and format_version, the ``ModelMeta`` fields (``privacy``: the client-level DP
                        guarantee, or null), num_classes, ``files`` (the sha256 of each file above) and
                        ``version_id``

The tensor files are written first and meta.json last, and meta.json pins every file by its hash, so a
reader racing a writer, or finding a crashed save, gets either a consistent model or an ExportError (and
can retry), never a silent mix of two saves. ``version_id`` is the first 16 hex digits of the sha256 of
the rest of meta.json as canonical JSON (``sort_keys=True, separators=(",", ":")``): it changes exactly
when what is served changes, so it can serve as a cache key or ETag.

The HTTP service imports only this module and ``fedrod_ray.models``, never Ray or the training code:
serving stays small and quick to start, and a refactor of training cannot break it. The hashes and
``version_id`` catch accidental damage only: anyone who can write final/ can recompute them. What keeps a
crafted final/ from running code is that tensors are read with safetensors (never pickle) and that
``load_final`` builds only the archs its caller allows (``check_arch``): the built-ins, the
``fedrod_ray.models`` plug-ins of installed packages, and the ``package.module:factory`` paths the caller
names; any other ``arch`` is refused before anything is imported (docs/security.md).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from dataclasses import asdict, dataclass, field, fields

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from fedrod_ray.config.values import is_import_path, plugin_names
from fedrod_ray.models import READOUTS, FedModel, build_model
from fedrod_ray.outputs.storage import RunStorage
from fedrod_ray.specs.methods import NEW_CLIENT_NEEDS
from fedrod_ray.specs.models import ARCHS, MODEL_PLUGINS

__all__ = ["FORMAT_VERSION", "ExportError", "ModelMeta", "Privacy", "ServedModel", "check_arch", "load_final",
           "save_final"]

FORMAT = "fedrod-ray/final"
FORMAT_VERSION = 1
FINAL_DIR = "final"
MODEL_FILE = "model.safetensors"
PERSONAL_FILE = "personal.safetensors"
META_FILE = "meta.json"
VARIANTS = ("none", "linear", "hyper")  # the served model's personalized part (FedModel.variant, or none)
GENERIC_MODELS = ("global", "mean of personalized models")


# What load_final reads of each file at most (a regular file only: RunStorage.read_file). meta.json is a few
# KiB (thousands of class names fit); the tensor files are the model's weights.
MAX_FILE_BYTES = {META_FILE: 4 * 2**20, MODEL_FILE: 4 * 2**30, PERSONAL_FILE: 4 * 2**30}


def head_new_client(head: str) -> str:
    """What a new client gives for the zero-shot model of a final/ written before ``ModelMeta.new_client``:
    its class counts for the hyper head, else nothing."""
    return "class_counts" if head == "hyper" else "none"


class ExportError(ValueError):
    """A final/ that cannot be served: missing, half-written, corrupt, or of another format version."""


# Privacy.noise: where a private run's noise and client sampling came from.
NOISE_SOURCES = ("secure", "seeded")


@dataclass
class Privacy:
    """The client-level differential-privacy guarantee of a privately trained model (docs/privacy.md): it is
    (epsilon, delta)-DP with respect to any one client's whole contribution, after ``ModelMeta.round`` rounds."""

    epsilon: float | None  # None: no finite bound (trained without noise)
    delta: float
    noise_multiplier: float  # sigma: the noise's std over the clip norm
    clip_norm: float | None  # S (adaptive clipping: the first); None: not clipped (only without noise)
    adaptive_clip: bool
    sampling: str  # "poisson" | "fixed": how each round's clients were drawn
    sampling_rate: float  # q: poisson, each client's chance per round; fixed, the fraction drawn
    accountant: str  # "rdp" | "pld" (Google's dp_accounting)
    # Where the noise and the sampling came from: "secure", the OS's CSPRNG; "seeded", the run's seed, so the
    # guarantee does not hold against anyone who knows the seed (a final/ written before this field: seeded).
    noise: str = "seeded"


@dataclass
class ModelMeta:
    dataset: str
    class_names: list[str]
    image_shape: list[int]  # [C, H, W]
    mean: list[float]  # per channel, pixels in [0, 1] units
    std: list[float]
    arch: str  # a built-in ("mnist_cnn", "cifar_cnn", "resnet20"), a plug-in's name or package.module:factory
    head: str  # "none" | "linear" | "hyper"
    hyper_hidden: int
    rule: str  # generic-FL rule, e.g. "fedavg"
    balanced_loss: str
    round: int  # completed rounds when saved
    metrics: dict[str, float] = field(default_factory=dict)
    privacy: Privacy | None = None  # None: trained without client-level DP
    # The personalization method that trained it (train.head; a final/ of an earlier version: its head) and
    # what the served generic model is: the method's global model, or, for a method without one, the mean of
    # the clients' personalized models.
    method: str = ""  # "": the head's
    generic_model: str = "global"
    # What a new client must give for the method's zero-shot model (``NEW_CLIENT_NEEDS``): "class_counts" is
    # what this service serves (hyper: POST /v1/heads); "data" and "training" it cannot ("": the head's).
    new_client: str = ""

    def __post_init__(self):
        self.method = self.method or self.head
        self.new_client = self.new_client or head_new_client(self.head)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)


@dataclass
class ServedModel:
    meta: ModelMeta
    version_id: str
    model: FedModel  # eval mode, on CPU
    personal_heads: dict[int, torch.Tensor] = field(default_factory=dict)  # linear only

    @torch.no_grad()
    def zero_shot_head(self, class_dist: torch.Tensor) -> torch.Tensor:
        """H(a; nu_bar), the P-head for a client described only by its class distribution a (C,)."""
        if self.meta.head != "hyper":
            raise ValueError(f"a zero-shot head needs the hyper head, not {self.meta.head!r}")
        a = torch.as_tensor(class_dist, dtype=torch.float32)
        # The hypernetwork would fail with an opaque matmul error on a wrong-sized input.
        if a.shape != (self.meta.num_classes,):
            raise ValueError(f"class_dist must have shape ({self.meta.num_classes},), got {tuple(a.shape)}")
        return self.model.personal_weight(a)  # what training's global-reading PMs use

    def personal_head(self, client_id: int) -> torch.Tensor:
        """The stored phi_m of a training client (linear head only)."""
        if self.meta.head != "linear":
            raise ValueError(f"only the linear head stores per-client heads, not {self.meta.head!r}")
        if client_id not in self.personal_heads:
            raise KeyError(f"no personal head for client {client_id}; there are {len(self.personal_heads)}")
        return self.personal_heads[client_id]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _version_id(doc: dict) -> str:
    rest = {k: v for k, v in doc.items() if k != "version_id"}
    return _sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode())[:16]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true must not pass for 1


def _is_num(v) -> bool:
    return _is_int(v) or isinstance(v, float)


def _is_list(v, item_ok, length: int | None = None) -> bool:
    return isinstance(v, list) and bool(v) and (length is None or len(v) == length) and all(map(item_ok, v))


def _meta_from_doc(doc: dict, where: str) -> ModelMeta:
    def need(name: str, ok, expected: str) -> None:
        if name not in doc or not ok(doc[name]):
            raise ExportError(f"{where}: {name} must be {expected}, got {doc.get(name)!r}")

    for name in ("dataset", "arch", "rule", "balanced_loss"):
        need(name, lambda v: isinstance(v, str), "a string")
    need("head", lambda v: v in VARIANTS, f"one of {VARIANTS}")
    need("class_names", lambda v: _is_list(v, lambda s: isinstance(s, str)), "a non-empty list of strings")
    need("num_classes", lambda v: _is_int(v) and v == len(doc["class_names"]), "the number of class names")
    need("image_shape", lambda v: _is_list(v, lambda n: _is_int(n) and n > 0, 3), "[C, H, W], all > 0")
    channels = doc["image_shape"][0]
    for name in ("mean", "std"):
        need(name, lambda v: _is_list(v, _is_num, channels), f"{channels} number(s), one per channel")
    need("hyper_hidden", lambda v: _is_int(v) and v > 0, "a positive integer")
    need("round", lambda v: _is_int(v) and v >= 0, "a non-negative integer")
    need("metrics", lambda v: isinstance(v, dict) and all(map(_is_num, v.values())), "an object of numbers")
    # Written before these fields existed: the head's method, its global model, no client-level DP.
    doc = {"method": doc["head"], "generic_model": "global", "privacy": None,
           "new_client": head_new_client(doc["head"]), **doc}
    need("method", lambda v: isinstance(v, str) and v, "a non-empty string")
    need("generic_model", lambda v: v in GENERIC_MODELS, f"one of {GENERIC_MODELS}")
    need("new_client", lambda v: v in NEW_CLIENT_NEEDS, f"one of {NEW_CLIENT_NEEDS}")
    values = {f.name: doc[f.name] for f in fields(ModelMeta)}
    values.update(mean=[float(x) for x in values["mean"]], std=[float(x) for x in values["std"]],
                  metrics={k: float(v) for k, v in values["metrics"].items()},
                  privacy=None if doc["privacy"] is None else _privacy_from_doc(doc["privacy"], where))
    return ModelMeta(**values)


def _privacy_from_doc(doc, where: str) -> Privacy:
    names = [f.name for f in fields(Privacy)]
    if isinstance(doc, dict):
        doc = {"noise": "seeded", **doc}
    if not isinstance(doc, dict) or sorted(doc) != sorted(names):
        raise ExportError(f"{where}: privacy must be null or an object of {names}, got {doc!r}")
    for name, ok in (("epsilon", lambda v: v is None or (_is_num(v) and v >= 0)), ("delta", _is_num),
                     ("noise_multiplier", _is_num), ("clip_norm", lambda v: v is None or _is_num(v)),
                     ("adaptive_clip", lambda v: isinstance(v, bool)), ("sampling", lambda v: isinstance(v, str)),
                     ("sampling_rate", _is_num), ("accountant", lambda v: isinstance(v, str)),
                     ("noise", lambda v: v in NOISE_SOURCES)):
        if not ok(doc[name]):
            raise ExportError(f"{where}: privacy.{name} is not valid, got {doc[name]!r}")
    return Privacy(**doc)


def _meta_to_doc(meta: ModelMeta) -> dict:
    # Through JSON and back, so that what is saved is exactly what load_final returns (tuples become
    # lists; default=float takes numpy or 0-d tensor metrics).
    doc = json.loads(json.dumps(asdict(meta), default=float))
    doc["num_classes"] = meta.num_classes
    return doc


def _assemble(meta: ModelMeta, weights: dict[str, torch.Tensor], heads: dict[str, torch.Tensor],
              where: str) -> tuple[FedModel, dict[int, torch.Tensor]]:
    """The model built from meta with the weights loaded, and the personal heads keyed by client id.

    The weights' shapes are checked against the model's before it is built, on torch's meta device (shapes,
    no memory): a one-line edit of meta.json (an image_shape of 2000 x 2000, a hyper_hidden of 10**9) would
    otherwise allocate gigabytes before the mismatch is found."""

    def build():
        return build_model(meta.arch, meta.num_classes, tuple(meta.image_shape),
                           None if meta.head == "none" else meta.head, meta.hyper_hidden, seed=0,
                           readout=meta.method if meta.method in READOUTS else None)

    try:
        with torch.device("meta"):
            skeleton = build()
    except ValueError as e:
        raise ExportError(f"{where}: {e}") from e
    except Exception:  # noqa: BLE001 - a plug-in that needs real tensors to build: checked once built
        skeleton = None
    if skeleton is not None:
        _check_weights(skeleton, weights, where)
    try:
        model = build()
    except ValueError as e:
        raise ExportError(f"{where}: {e}") from e
    if skeleton is None:
        _check_weights(model, weights, where)
    model.load_partial(weights)
    model.eval()
    # A meta whose image size does not fit the arch builds fine but fails on the first request.
    try:
        with torch.no_grad():
            model(torch.zeros(1, *meta.image_shape))
    except RuntimeError as e:
        raise ExportError(f"{where}: arch {meta.arch} cannot take images of shape {meta.image_shape}") from e

    out = {}
    head_shape = (meta.num_classes, model.feature_dim)
    for key, t in heads.items():
        if not (key.isascii() and key.isdigit()):
            raise ExportError(f"{where}/{PERSONAL_FILE}: key {key!r} is not a client id")
        if t.shape != head_shape or not t.is_floating_point():
            raise ExportError(f"{where}/{PERSONAL_FILE}: client {key} has a {t.dtype} head of shape "
                              f"{tuple(t.shape)}, expected a float {head_shape}")
        out[int(key)] = t.to(model.generic_head.weight.dtype)
    return model, out


def _check_weights(model: FedModel, weights: dict[str, torch.Tensor], where: str) -> None:
    # The linear P-head is per client and served separately; the model's own stays at zero. A readout's
    # personal entries (GPFL's, FedCP's) are each client's: the served GM reads none of them.
    kept = set(model.readout_personal_keys())
    expected = {k: v.shape for k, v in model.state_dict().items()
                if not k.startswith("personal_head.") and k not in kept}
    missing, extra = sorted(expected.keys() - weights.keys()), sorted(weights.keys() - expected.keys())
    if missing or extra:
        raise ExportError(f"{where}/{MODEL_FILE} does not fit the model in meta.json: "
                          f"missing {missing}, extra {extra}")
    for k, shape in expected.items():
        if weights[k].shape != shape:
            raise ExportError(f"{where}/{MODEL_FILE}: {k} has shape {tuple(weights[k].shape)}, "
                              f"the model needs {tuple(shape)}")


def save_final(storage: RunStorage, meta: ModelMeta, weights: dict[str, torch.Tensor],
               personal_heads: dict[int, torch.Tensor] | None = None) -> str:
    """Write final/ (tensor files first, meta.json last) and return its version id.

    Everything load_final checks is checked here first, so a run never ends with an unservable final/.
    """
    where = f"cannot save {storage.path(FINAL_DIR)}"
    meta = _meta_from_doc(_meta_to_doc(meta), where)  # validated, and ints in float fields made floats
    doc = {"format": FORMAT, "format_version": FORMAT_VERSION, **_meta_to_doc(meta)}
    if (meta.head == "linear") != (personal_heads is not None):
        raise ValueError("personal_heads are required for, and only for, head 'linear'")
    # safetensors refuses non-contiguous tensors, and the channels_last conv weights are not.
    tensors = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
    heads = {}
    for cid, t in (personal_heads or {}).items():
        if not _is_int(cid) or cid < 0:
            raise ValueError(f"client ids must be non-negative ints, got {cid!r}")
        heads[str(cid)] = t.detach().cpu().contiguous()
    _assemble(meta, tensors, heads, where)

    blobs = {MODEL_FILE: _st_save(tensors)}
    if meta.head == "linear":
        blobs[PERSONAL_FILE] = _st_save(heads)
    for name, data in blobs.items():
        storage.write_bytes(f"{FINAL_DIR}/{name}", data)
    doc["files"] = {name: _sha256(data) for name, data in blobs.items()}
    doc["version_id"] = _version_id(doc)
    storage.write_bytes(f"{FINAL_DIR}/{META_FILE}", json.dumps(doc, sort_keys=True, indent=1).encode())
    return doc["version_id"]


def _read(storage: RunStorage, name: str, where: str) -> bytes:
    if not storage.exists(f"{FINAL_DIR}/{name}"):
        raise ExportError(f"{where}/{name} does not exist")
    try:
        return storage.read_file(f"{FINAL_DIR}/{name}", MAX_FILE_BYTES[name])
    except OSError as e:
        raise ExportError(f"{where}/{name} cannot be read: {e}") from e


def _tensors(data: bytes, where: str) -> dict[str, torch.Tensor]:
    try:
        return _st_load(data)
    except Exception as e:  # the safetensors error types differ between versions
        raise ExportError(f"{where} is not a valid safetensors file: {e}") from e


def check_arch(arch: str, allowed_factories: Collection[str], where: str) -> None:
    """An ExportError unless building ``arch`` imports only code the caller allows: a built-in, a plug-in
    that an installed package registers under ``fedrod_ray.models``, or one of ``allowed_factories``
    (``package.module:factory`` paths). Checked before anything is imported: building an arch calls it."""
    if is_import_path(arch):  # resolved as an import path even if a plug-in had that name (models.extractors)
        if arch in allowed_factories:
            return
    elif arch in ARCHS or arch in plugin_names(MODEL_PLUGINS):
        return
    allowed = ", ".join(sorted(allowed_factories)) or "none"
    raise ExportError(f"{where}: arch {arch!r} is not one this loader may build: not a built-in "
                      f"({', '.join(ARCHS)}), not a plug-in an installed package registers under {MODEL_PLUGINS}, "
                      f"and not an allowed factory (allowed: {allowed}; fedrod-ray serve --allow-factory)")


def load_final(source: str | RunStorage, allowed_factories: Collection[str] = ()) -> ServedModel:
    """Load and verify the final/ of a run directory (a path or URI) or of its storage.

    Its arch must be one ``check_arch`` allows with ``allowed_factories``: the directory's contents choose
    what is built, so only the caller may widen what that can import."""
    storage = source if isinstance(source, RunStorage) else RunStorage(source)
    where = storage.path(FINAL_DIR)
    raw = _read(storage, META_FILE, where)
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"{where}/{META_FILE} is not valid JSON: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ExportError(f"{where}/{META_FILE} is not a {FORMAT} meta.json")
    if doc.get("format_version") != FORMAT_VERSION:
        raise ExportError(f"{where}/{META_FILE} has format_version {doc.get('format_version')!r}; "
                          f"this fedrod_ray reads format_version {FORMAT_VERSION}")
    if doc.get("version_id") != _version_id(doc):
        raise ExportError(f"{where}/{META_FILE}: version_id does not match its contents (edited by hand?)")
    meta = _meta_from_doc(doc, f"{where}/{META_FILE}")
    check_arch(meta.arch, allowed_factories, f"{where}/{META_FILE}")

    # Only the expected names are read, so meta.json cannot point the reader elsewhere.
    names = {MODEL_FILE, PERSONAL_FILE} if meta.head == "linear" else {MODEL_FILE}
    files = doc.get("files")
    if not isinstance(files, dict) or set(files) != names:
        raise ExportError(f"{where}/{META_FILE}: files must list exactly {sorted(names)}, got {files!r}")
    blobs = {}
    for name in sorted(names):
        blobs[name] = _read(storage, name, where)
        if _sha256(blobs[name]) != files[name]:
            raise ExportError(f"{where}/{name}: sha256 differs from meta.json's (half-written or mixed save)")
    weights = _tensors(blobs[MODEL_FILE], f"{where}/{MODEL_FILE}")
    heads = _tensors(blobs[PERSONAL_FILE], f"{where}/{PERSONAL_FILE}") if PERSONAL_FILE in blobs else {}
    model, personal = _assemble(meta, weights, heads, where)
    return ServedModel(meta, doc["version_id"], model, personal)
