"""A request's images, as nested arrays or base64 PNGs, into the model's normalised N x C x H x W batch."""

from __future__ import annotations

import numpy as np
import torch

from fedrod_ray.data.transforms import normalize
from fedrod_ray.models.export import ModelMeta

from . import arrays, png
from .errors import ApiError

# Normalised input may carry float rounding from the client's own normalisation: a thousandth of a
# normalised unit is well under one 8-bit pixel step (1 / 255 / std).
NORMALIZED_TOLERANCE = 1e-3


def png_mode(meta: ModelMeta) -> str:
    return png.MODES[meta.image_shape[0]]


def _first_bad(bad: torch.Tensor) -> str:
    return "".join(f"[{int(i)}]" for i in bad.nonzero()[0])


def from_arrays(images: list, pixels: str, meta: ModelMeta) -> torch.Tensor:
    x = torch.from_numpy(arrays.as_array(images, meta.image_shape))
    if pixels == "raw":
        bad = (x < 0) | (x > 255)
        if bad.any():
            where = _first_bad(bad)
            raise ApiError(f"images{where}", f"raw pixel {x[bad][0].item():g} is outside 0..255 (send "
                                             f"pixels: normalized with already normalised values)")
        return normalize(x, meta.mean, meta.std)
    mean = torch.tensor(meta.mean).view(-1, 1, 1)
    std = torch.tensor(meta.std).view(-1, 1, 1)
    lo, hi = (0 - mean) / std - NORMALIZED_TOLERANCE, (1 - mean) / std + NORMALIZED_TOLERANCE
    bad = (x < lo) | (x > hi)
    if bad.any():
        where = _first_bad(bad)
        c = int(bad.nonzero()[0][1])
        raise ApiError(f"images{where}", f"normalised value {x[bad][0].item():g} is outside "
                                         f"[{lo[c].item():.4f}, {hi[c].item():.4f}], what pixels in 0..1 "
                                         f"give with mean {meta.mean[c]} and std {meta.std[c]}")
    return x


def from_pngs(pngs: list[str] | np.ndarray, meta: ModelMeta) -> torch.Tensor:
    """``pngs`` decoded (or their N x C x H x W uint8 pixels, as a parse worker decoded them), normalised."""
    x = pngs if isinstance(pngs, np.ndarray) else arrays.from_pngs(pngs, meta.image_shape)
    return normalize(torch.from_numpy(x), meta.mean, meta.std)


def decode(images: list | np.ndarray | arrays.Deferred | None, pixels: str,
           pngs: list[str] | np.ndarray | arrays.Deferred | None, meta: ModelMeta, max_batch: int) -> torch.Tensor:
    """The normalised float32 batch; exactly one of ``images`` and ``pngs`` is given (the schema checks), as
    the request has them or as a parse worker made them (``arrays.convert``)."""
    for given in (images, pngs):
        if isinstance(given, arrays.Deferred):
            raise given.error
    field, items = ("images", images) if images is not None else ("images_png", pngs)
    error = arrays.count_error(field, len(items), max_batch)
    if error:
        raise error
    return from_arrays(images, pixels, meta) if images is not None else from_pngs(pngs, meta)
