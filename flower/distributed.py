"""Distributed DP on Flower's SecAgg+ (``privacy.mechanism: distributed_dgauss``; docs/privacy.md, "Distributed
DP"): each SuperNode noises its share in the integers before SecAgg+ masks it, so the server unmasks a noised sum.

The mechanism's math is ``fedrod_ray.server_math.distributed_dp``'s; this only carries its integers through
SecAgg+. A node's vector is the ring vector of its clients' clipped updates (``encode``), then the round's
losses (diagnostics, summed but not noised, as in the central mechanism) in fixed point, as base-B digits whose
sums never carry; each entry z in [0, m). SecAgg+ is run with modulus m, quantization range T = m - 1 and clipping range c = (m - 1) / 2: each
node sends z - c, which SecAgg+'s quantization maps back to z exactly (its grid step 2c / T is 1), and the masks
and the sum are mod m. The server inverts SecAgg+'s dequantization of the total (``ring_total``) to the sum
mod m, then ``decode``s it. Who took part, and so the sample counts, the server knows from the nodes' reports."""

from __future__ import annotations

import math

import numpy as np
import torch

from fedrod_ray.client_update.local import LocalResult, derived_seed
from fedrod_ray.config import ConfigError, ExperimentConfig
from fedrod_ray.server_math.aggregate import StateDict, WeightedSum
from fedrod_ray.server_math.distributed_dp import DistributedRound, Encoding, decode, encode, wrap
from fedrod_ray.server_math.privacy import SecureNoise, SeededNoise
from fedrod_ray.server_math.sums import Losses, RoundSums

LOSSES = 2  # the round's loss and personal loss, each summed as n * loss / samples over the node's clients
FIXED = 2**20  # the losses' fixed point: a node's sum in units of 2^-20
LARGEST = 2**40  # and at most 2^40 units (a loss sum of 2^20): it travels as base-B digits that never carry


def check_settings(cfg: ExperimentConfig, reconstruction_threshold: int) -> None:
    """SecAgg+ completes a round with as few as its reconstruction threshold of nodes: the sum then holds that
    many nodes' noise, which must be at least what the accountant assumed (``privacy.min_participants``)."""
    if reconstruction_threshold < cfg.privacy.min_participants:
        raise ConfigError(f"privacy.min_participants: {cfg.privacy.min_participants} is more than run config "
                          f"secagg-reconstruction-threshold ({reconstruction_threshold}), with which SecAgg+ "
                          "completes a round whose sum holds fewer participants' noise")


def workflow_ranges(dround: DistributedRound) -> tuple[float, int, int]:
    """SecAgg+'s (clipping_range, quantization_range, modulus_range) that carry the ring's integers exactly."""
    m = dround.encoding.modulus
    return (m - 1) / 2, m - 1, m


def _digits(dround: DistributedRound, participants: int) -> tuple[int, int]:
    """(B, digits): the base of the losses' digits, so that ``participants`` nodes' digits sum below m / 2 (no
    wrap, no carry), and how many digits a sum up to ``LARGEST`` needs."""
    base = dround.encoding.modulus // (2 * participants)
    return base, math.ceil(math.log(LARGEST) / math.log(base))


def _to_digits(value: float, base: int, digits: int) -> list[int]:
    v = min(max(round(value * FIXED), 0), LARGEST - 1)
    return [(v // base**j) % base for j in range(digits)]


def node_vector(results: list[LocalResult], anchor: StateDict, keys: list[str], dround: DistributedRound,
                samples: float, participants: int, first_client: int) -> np.ndarray:
    """A node's vector for SecAgg+: its clients' clipped updates (each ``results``' shared weights less
    ``anchor``, flattened over ``keys``) encoded with its noise, and the losses in fixed point (``samples``: the
    round's total sample count), as the float64 values SecAgg+ quantizes back to the ring's integers.
    ``participants``: the most nodes in a sum (the losses' range); ``first_client``: the node's first client,
    which tells its seeded noise (``noise_seed``) from the other nodes'."""
    enc = dround.encoding
    noise = SecureNoise() if dround.noise_seed is None else SeededNoise(derived_seed(dround.noise_seed, first_client))
    updates = [torch.cat([(r.shared[k].to(torch.float64) - anchor[k].to(torch.float64)).reshape(-1) for k in keys])
               for r in results]
    ring = encode(updates, enc, dround.signs(), noise)
    base, digits = _digits(dround, participants)
    losses = [sum(r.num_samples * r.loss for r in results) / max(samples, 1.0),
              sum(r.num_samples * (r.personal_loss or 0.0) for r in results) / max(samples, 1.0)]
    fixed = torch.tensor([d for v in losses for d in _to_digits(v, base, digits)], dtype=torch.int64)
    return torch.cat([ring, fixed]).numpy().astype(np.float64) - (enc.modulus - 1) / 2


def ring_total(mean: np.ndarray, nodes: int, dround: DistributedRound) -> torch.Tensor:
    """The sum mod m of the ``nodes`` vectors in SecAgg+'s sum, from the workflow's result ``mean``: SecAgg+
    returns ((S mod m) - nodes c) T / ((nodes T) mod m) for the sum S of the quantized vectors (its weight
    factor is summed mod m too), which is inverted here and rounded to the integers it came from."""
    c, t, m = workflow_ranges(dround)
    total = mean * ((nodes * t) % m) / t + nodes * c
    return wrap(torch.from_numpy(np.rint(total)).to(torch.int64), m)


def round_sums(total: torch.Tensor, keys: list[str], anchor: StateDict, dround: DistributedRound, done: int,
               samples: float, done_samples: float, participants: int,
               has_personal_loss: bool) -> tuple[RoundSums, Losses]:
    """The round's sums from the ring's ``total``: the noised sum of the ``done`` clients' clipped updates,
    added back to ``anchor`` as the sum of their clipped uploads (``RoundSums.clipped``; with its noise even
    where no client finished, as the accountant assumes), and their losses (``samples``: the total the nodes
    divided by; ``done_samples``: the finished clients')."""
    enc = dround.encoding
    noised = decode(total[:enc.padded], enc, dround.signs())
    out, i = {}, 0
    for k in keys:
        n = anchor[k].numel()
        out[k] = noised[i:i + n].reshape(anchor[k].shape) + done * anchor[k].to(torch.float64)
        i += n
    clipped = WeightedSum(out, float(done), done, {k: anchor[k].dtype for k in keys})
    base, digits = _digits(dround, participants)
    tail = [int(v) for v in total[enc.padded:]]
    loss, personal = (sum(d * base**j for j, d in enumerate(tail[i * digits:(i + 1) * digits])) / FIXED * samples
                      / max(done_samples, 1.0) for i in range(LOSSES))
    losses = Losses(done, loss if done else math.nan, personal if done and has_personal_loss else None)
    none = WeightedSum(None, 0.0, 0)
    return RoundSums(none, none, none, clipped, 0), losses


def to_header(dround: DistributedRound, participants: int) -> dict:
    """The round's mechanism as the nodes' instructions carry it (JSON)."""
    enc = dround.encoding
    return {"gamma": enc.gamma, "modulus": enc.modulus, "local_sigma": enc.local_sigma, "bound": enc.bound,
            "dim": enc.dim, "rotation_seed": dround.rotation_seed, "noise_seed": dround.noise_seed,
            "participants": participants}


def node_vector_for(head: dict, results: list[LocalResult], anchor: StateDict, keys: list[str],
                    first_client: int) -> np.ndarray:
    """``node_vector`` from a node's instructions ``head`` (``to_header`` under its ``distributed``)."""
    d = head["distributed"]
    dround = DistributedRound(Encoding(d["gamma"], d["modulus"], d["local_sigma"], d["bound"], d["dim"]),
                              d["rotation_seed"], d["noise_seed"])
    return node_vector(results, anchor, keys, dround, head["scales"][1], d["participants"], first_client)
