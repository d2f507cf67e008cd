"""A request's images, as nested arrays or base64 PNGs, into the model's normalised N x C x H x W batch."""

from __future__ import annotations

import base64
import binascii
import io

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from fedrod_ray.data.transforms import normalize
from fedrod_ray.models.export import ModelMeta

from . import arrays, png
from .errors import ApiError

PNG_MODES = {1: "L", 3: "RGB"}
# Normalised input may carry float rounding from the client's own normalisation: a thousandth of a
# normalised unit is well under one 8-bit pixel step (1 / 255 / std).
NORMALIZED_TOLERANCE = 1e-3


def png_mode(meta: ModelMeta) -> str:
    return PNG_MODES[meta.image_shape[0]]


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


def _decode_png(data: str, meta: ModelMeta, field: str) -> torch.Tensor:
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(field, "is not valid base64") from None
    broken = png.structure_error(raw)
    if broken:
        raise ApiError(field, broken)
    c, h, w = meta.image_shape
    try:
        with Image.open(io.BytesIO(raw), formats=["PNG"]) as im:
            # Checked before decoding the pixels, so a small PNG of a huge image costs nothing.
            size, mode = im.size, im.mode
            pixels = im.tobytes() if (size, mode) == ((w, h), png_mode(meta)) else None
    except UnidentifiedImageError:  # its message names the BytesIO object, at its memory address
        raise ApiError(field, "is not an image Pillow can read (its IHDR names no supported PNG format)") from None
    except Exception as e:  # noqa: BLE001 - Pillow raises OSError, SyntaxError, zlib.error... for a broken file
        raise ApiError(field, f"cannot be decoded as PNG: its image data is corrupt ({e})") from None
    if size != (w, h):
        raise ApiError(field, f"is {size[0]}x{size[1]} pixels; this model takes {w}x{h}")
    if mode != png_mode(meta):
        raise ApiError(field, f"has PIL mode {mode}; this model takes {c}-channel 8-bit images, mode "
                              f"{png_mode(meta)}")
    return torch.frombuffer(bytearray(pixels), dtype=torch.uint8).view(h, w, c).permute(2, 0, 1)


def from_pngs(pngs: list[str], meta: ModelMeta) -> torch.Tensor:
    x = torch.stack([_decode_png(s, meta, f"images_png[{i}]") for i, s in enumerate(pngs)])
    return normalize(x, meta.mean, meta.std)


def decode(images: list | np.ndarray | arrays.Deferred | None, pixels: str, pngs: list[str] | None,
           meta: ModelMeta, max_batch: int) -> torch.Tensor:
    """The normalised float32 batch; exactly one of ``images`` (nested lists, or what a parse worker made of
    them: ``arrays.convert``) and ``pngs`` is given (the schema checks)."""
    if isinstance(images, arrays.Deferred):
        raise images.error
    field, items = ("images", images) if images is not None else ("images_png", pngs)
    error = arrays.count_error(field, len(items), max_batch)
    if error:
        raise error
    return from_arrays(images, pixels, meta) if images is not None else from_pngs(pngs, meta)
