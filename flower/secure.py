"""Secure aggregation of the shared part with Flower's SecAgg+ (its ``SecAggPlusWorkflow`` on the server, its
``secaggplus_mod`` on each SuperNode): the server learns the sum over the round's participants of what its step
reads, never one client's or one node's.

Each SuperNode trains its sampled clients and sums what the round's server step reads of them
(``round_sums.RoundSums``) into one flat vector (``node_vector``): theta and psi's updates under the rule's
weights, the other shared weights' by sample count, the rule's uploads, and their counts and losses (with
client-level DP: the clipped updates and how many were within the clip norm). Every entry is divided by a
public scale that the server sends (``Scales``), so that it lies within SecAgg+'s clipping range. SecAgg+ masks,
quantizes and sums the nodes' vectors, recovering the masks of a node that drops mid-round from the others'
shares; the server turns the sum back into the round's sums (``round_sums``), and fedrod-ray's own server step
(``round_sums.shared_update``) does the rest. docs/flower.md says what each party learns and who must be
trusted for client-level DP's epsilon.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from fedrod_ray.algorithms import GenericRule
from fedrod_ray.client_update.local import LocalResult
from fedrod_ray.config import ConfigError
from fedrod_ray.federation_state.setup import Setup
from fedrod_ray.personalization import build_method
from fedrod_ray.server_math.aggregate import StateDict, WeightedSum
from fedrod_ray.server_math.sums import Losses, RoundSums

SECURE = "secure-aggregation"
# SecAgg+'s settings in the app's run config, with the name of each in Flower's workflow.
SETTINGS = {"secagg-num-shares": "num_shares", "secagg-reconstruction-threshold": "reconstruction_threshold",
            "secagg-clipping-range": "clipping_range", "secagg-quantization-range": "quantization_range"}
MIN_SAMPLED = "secagg-min-sampled-nodes"
MODULUS = 2**32  # SecAgg+'s modulus_range (Flower's default and largest): the sum of the quantized vectors wraps at it


@dataclass(frozen=True)
class SecAggSettings:
    """SecAgg+'s parameters (``flwr.server.workflow.SecAggPlusWorkflow``): each node's secrets are split into
    ``num_shares`` shares, ``reconstruction_threshold`` of which recover them; every entry of a node's vector
    is clipped to [-``clipping_range``, ``clipping_range``] and quantized to ``quantization_range`` levels."""

    num_shares: int
    reconstruction_threshold: int
    clipping_range: float
    quantization_range: int
    # The fewest SuperNodes whose clients a round's secure sum may hold (``secagg-min-sampled-nodes``): a sum
    # over fewer is one node's sum (one client's, where the node hosts one), so such a round is skipped.
    min_sampled_nodes: int = 2

    def quantum(self) -> float:
        """The width of one quantization level: each node's entry is rounded (stochastically) by less."""
        return 2 * self.clipping_range / self.quantization_range


def settings_from(run_config: Mapping) -> SecAggSettings | None:
    """SecAgg+'s settings from the app's run config (None: ``secure-aggregation`` is off); a setting that is
    missing, out of range or without effect is a ConfigError naming it."""
    on = run_config.get(SECURE, False)
    if not isinstance(on, bool):
        raise ConfigError(f"run config {SECURE}: must be true or false, got {on!r}")
    values = {key: run_config.get(key, 0) for key in SETTINGS}
    spread = run_config.get(MIN_SAMPLED, 2)
    if not on:
        given = [key for key, v in values.items() if v] + ([MIN_SAMPLED] if MIN_SAMPLED in run_config else [])
        if given:
            raise ConfigError(f"run config {given[0]}: has no effect without {SECURE}=true")
        return None
    for key, v in values.items():
        kind = float if key == "secagg-clipping-range" else int
        if isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int) or v <= 0:
            raise ConfigError(f"run config {key}: {SECURE}=true needs a positive "
                              f"{'number' if kind is float else 'integer'}, got {v!r}")
    if isinstance(spread, bool) or not isinstance(spread, int) or spread < 1:
        raise ConfigError(f"run config {MIN_SAMPLED}: must be a positive integer (1 accepts a round whose sampled "
                          f"clients sit on one SuperNode, whose sum is that node's), got {spread!r}")
    s = SecAggSettings(**{name: values[key] for key, name in SETTINGS.items()}, min_sampled_nodes=spread)
    if s.num_shares < 3:
        raise ConfigError(f"run config secagg-num-shares: SecAgg+ needs at least 3, got {s.num_shares}")
    if not 2 <= s.reconstruction_threshold < s.num_shares:
        raise ConfigError(f"run config secagg-reconstruction-threshold: must be at least 2 and below "
                          f"secagg-num-shares ({s.num_shares}), got {s.reconstruction_threshold}")
    if s.quantization_range < 2 or s.quantization_range >= MODULUS // 2:
        raise ConfigError(f"run config secagg-quantization-range: must be within [2, 2**31), got "
                          f"{s.quantization_range}")
    if not math.isfinite(s.clipping_range):
        raise ConfigError("run config secagg-clipping-range: must be finite")
    min_nodes = int(run_config.get("min-nodes", 0))
    if min_nodes < s.reconstruction_threshold:
        raise ConfigError(f"run config min-nodes: SecAgg+ needs at least secagg-reconstruction-threshold "
                          f"({s.reconstruction_threshold}) SuperNodes in every round, got {min_nodes}")
    return s


def check_secure(setup: Setup) -> None:
    """What secure aggregation cannot run, as ConfigErrors naming the field: a method whose server step reads
    each client's own result (the server learns only sums)."""
    t = setup.cfg.train
    if build_method(t.head, t.head_params).server_reads_clients:
        raise ConfigError(f"train.head: {t.head}'s server step reads each client's own result or upload, which "
                          f"run config {SECURE}=true hides from the server (it learns only their sum)")


@dataclass(frozen=True)
class Layout:
    """Where each of the round's sums lies in the flat vector SecAgg+ sums: (name, shape, dtype) entries, in
    order. Names: ``generic/<key>``, ``generic_weight``, ``rest/<key>``, ``upload/<key>`` (without DP) or
    ``clipped/<key>``, ``unclipped`` (with it), and ``count``, ``samples``, ``loss``, ``personal_loss``."""

    entries: tuple[tuple[str, tuple[int, ...], str], ...]

    @classmethod
    def of(cls, shared: StateDict, generic_keys: set[str], upload: StateDict, dp: bool) -> Layout:
        """The layout of a model's shared weights ``shared`` and the rule's ``upload`` (its shapes)."""
        def entry(name: str, v: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
            return name, tuple(v.shape), str(v.dtype).removeprefix("torch.")

        scalar = torch.zeros((), dtype=torch.float64)
        if dp:
            parts = [entry(f"clipped/{k}", v) for k, v in shared.items()] + [entry("unclipped", scalar)]
        else:
            parts = ([entry(f"generic/{k}", v) for k, v in shared.items() if k in generic_keys]
                     + [entry("generic_weight", scalar)]
                     + [entry(f"rest/{k}", v) for k, v in shared.items() if k not in generic_keys]
                     + [entry(f"upload/{k}", v) for k, v in upload.items()])
        return cls(tuple(parts + [entry(n, scalar) for n in ("count", "samples", "loss", "personal_loss")]))

    @property
    def dp(self) -> bool:
        return any(name == "unclipped" for name, _, _ in self.entries)

    def keys(self, section: str) -> list[str]:
        return [name.split("/", 1)[1] for name, _, _ in self.entries if name.startswith(f"{section}/")]

    def dtype(self, name: str) -> torch.dtype:
        return next(getattr(torch, d) for n, _, d in self.entries if n == name)

    def pack(self, parts: dict[str, torch.Tensor]) -> np.ndarray:
        """One float64 vector of ``parts`` (float64 tensors by entry name; a missing one is zeros)."""
        return np.concatenate([parts[name].reshape(-1).numpy() if name in parts else np.zeros(math.prod(shape))
                               for name, shape, _ in self.entries])

    def unpack(self, vector: np.ndarray) -> dict[str, torch.Tensor]:
        out, i = {}, 0
        for name, shape, _ in self.entries:
            n = math.prod(shape)
            out[name] = torch.from_numpy(np.asarray(vector[i:i + n], dtype=np.float64).copy()).reshape(shape)
            i += n
        if i != len(vector):
            raise ValueError(f"a vector of {len(vector)} entries for a layout of {i}")
        return out

    def to_json(self) -> list:
        return [list(e) for e in self.entries]

    @classmethod
    def from_json(cls, entries: list) -> Layout:
        return cls(tuple((name, tuple(shape), dtype) for name, shape, dtype in entries))


@dataclass(frozen=True)
class Scales:
    """The public numbers each node divides its sums by, so that they lie within SecAgg+'s clipping range: the
    round's sampled clients' total aggregation weight (``generic``), total sample count (``samples``) and
    number (``count``), as the server knows them from the partition."""

    generic: float
    samples: float
    count: float

    @classmethod
    def of(cls, ids: list[int], sizes, rule: GenericRule) -> Scales:
        return cls(sum(rule.aggregation_weight(int(sizes[c])) for c in ids), float(sum(int(sizes[c]) for c in ids)),
                   float(len(ids)))


def node_vector(results: list[LocalResult], anchor: StateDict, layout: Layout, scales: Scales,
                weight: Callable[[int], float], clipping_range: float) -> np.ndarray:
    """A node's contribution to the round's secure sum: what ``round_sums`` reads, summed over its clients'
    ``results`` (each update taken from the round's global weights ``anchor``) and divided by ``scales``.
    Raises ValueError if an entry falls outside SecAgg+'s clipping range (it would be clipped silently)."""
    parts: dict[str, torch.Tensor] = {}

    def add(name: str, value) -> None:
        value = torch.as_tensor(value, dtype=torch.float64)
        parts[name] = parts[name] + value if name in parts else value

    for res in results:
        n = res.num_samples
        add("count", 1 / scales.count)
        add("samples", n / scales.samples)
        add("loss", n * res.loss / scales.samples)
        if res.personal_loss is not None:
            add("personal_loss", n * res.personal_loss / scales.samples)
        delta = {k: res.shared[k].to(torch.float64) - anchor[k].to(torch.float64) for k in res.shared}
        if layout.dp:
            for k in layout.keys("clipped"):
                add(f"clipped/{k}", delta[k] / scales.count)
            add("unclipped", float(not res.clipped) / scales.count)
        else:
            a = weight(n)
            add("generic_weight", a / scales.generic)
            for k in layout.keys("generic"):
                add(f"generic/{k}", delta[k] * (a / scales.generic))
            for k in layout.keys("rest"):
                add(f"rest/{k}", delta[k] * (n / scales.samples))
            for k in layout.keys("upload"):
                add(f"upload/{k}", res.upload[k].to(torch.float64) / scales.count)
    vector = layout.pack(parts)
    largest = float(np.abs(vector).max(initial=0.0))
    if not largest <= clipping_range:
        raise ValueError(f"an entry of this node's sums is {largest:.4g}, beyond run config secagg-clipping-range "
                         f"({clipping_range:g}): SecAgg+ would clip it")
    return vector


def round_sums(vector: np.ndarray, layout: Layout, scales: Scales, anchor: StateDict,
               has_personal_loss: bool) -> tuple[RoundSums, int, Losses]:
    """The round's sums, its number of participants and their losses from the securely summed ``vector``
    of every node's ``node_vector``: each scale multiplied back, each update added back to ``anchor``."""
    parts = layout.unpack(vector)
    count = round(float(parts["count"]) * scales.count)
    none = WeightedSum(None, 0.0, 0)

    def weighted(section: str, scale: float, weight: float) -> WeightedSum:
        keys = layout.keys(section)
        if count == 0:
            return none
        total = {k: parts[f"{section}/{k}"] * scale + anchor[k].to(torch.float64) * weight for k in keys}
        return WeightedSum(total, weight, count, {k: anchor[k].dtype for k in keys})

    samples = float(parts["samples"])
    if layout.dp:
        sums = RoundSums(none, none, none, weighted("clipped", scales.count, float(count)),
                         round(float(parts["unclipped"]) * scales.count))
    else:
        upload_keys = layout.keys("upload")
        uploads = none if count == 0 else WeightedSum(
            {k: parts[f"upload/{k}"] * scales.count for k in upload_keys}, float(count), count,
            {k: layout.dtype(f"upload/{k}") for k in upload_keys})
        sums = RoundSums(weighted("generic", scales.generic, float(parts["generic_weight"]) * scales.generic),
                         weighted("rest", scales.samples, samples * scales.samples), uploads, none)
    losses = Losses(count, float(parts["loss"]) / samples if count else math.nan,
                    float(parts["personal_loss"]) / samples if count and has_personal_loss else None)
    return sums, count, losses


def too_few_nodes(by_node: dict[int, list[int]], settings: SecAggSettings) -> str | None:
    """Why a round whose sampled clients sit on the SuperNodes of ``by_node`` (node -> its sampled clients) is
    not summed securely (None: it is): their sum would be over fewer nodes than ``secagg-min-sampled-nodes``,
    and a sum over one node is that node's sum, whatever SecAgg+ masks."""
    holding = sum(1 for cids in by_node.values() if cids)
    if holding >= settings.min_sampled_nodes:
        return None
    clients = sum(len(cids) for cids in by_node.values())
    return (f"its {clients} sampled client(s) sit on {holding} SuperNode(s), fewer than run config {MIN_SAMPLED}="
            f"{settings.min_sampled_nodes}: their secure sum would reveal a single node's sum")
