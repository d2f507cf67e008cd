"""A base64 PNG of a request into its pixels: its chunk structure checked before Pillow decodes it, so that a
client hears what is wrong with a broken file (truncated, a bad checksum, not an image) rather than Pillow's
"cannot identify image file". numpy and Pillow only, so that a parse worker (parse_workers.py) can decode a
request's PNGs without torch and send back their pixels, not their base64."""

from __future__ import annotations

import base64
import binascii
import io
import struct
import zlib
from collections.abc import Sequence

import numpy as np
from PIL import Image, UnidentifiedImageError

from .errors import ApiError

SIGNATURE = b"\x89PNG\r\n\x1a\n"
CHUNK_HEAD = struct.Struct(">I4s")  # length, type; the data and a CRC-32 of type + data follow
MODES = {1: "L", 3: "RGB"}  # the PIL mode of a model's images, by their channels


def structure_error(data: bytes) -> str | None:
    """What is wrong with the chunks of ``data`` (a PNG file, signature included), or None when every chunk
    is whole and its checksum right from IHDR to IEND."""
    if not data.startswith(SIGNATURE):
        return "is not a PNG (no PNG signature after base64 decoding)"
    at, first = len(SIGNATURE), True
    while True:
        if at == len(data):
            return ("is truncated: it holds only the PNG signature" if first
                    else "is truncated: it ends before its IEND chunk")
        if at + CHUNK_HEAD.size > len(data):
            return f"is truncated: it ends inside a chunk's header, at byte {len(data)}"
        length, kind = CHUNK_HEAD.unpack_from(data, at)
        name = kind.decode("latin-1")
        if first and kind != b"IHDR":
            return f"is not a PNG image: its first chunk is {name!r}, not 'IHDR'"
        end = at + CHUNK_HEAD.size + length
        if end + 4 > len(data):
            return f"is truncated: its {name!r} chunk needs {length + 4} bytes after its header, {len(data) - at - 8} follow"
        (crc,) = struct.unpack_from(">I", data, end)
        if zlib.crc32(data[at + 4:end]) != crc:
            return f"has a bad checksum (CRC) in its {name!r} chunk: the file is corrupt"
        if kind == b"IEND":
            return None
        at, first = end + 4, False


def decode(data: str, shape: Sequence[int], field: str) -> np.ndarray:
    """The C x H x W uint8 pixels of the base64 PNG ``data``, which must be an image of ``shape`` [C, H, W]."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(field, "is not valid base64") from None
    broken = structure_error(raw)
    if broken:
        raise ApiError(field, broken)
    c, h, w = shape
    try:
        with Image.open(io.BytesIO(raw), formats=["PNG"]) as im:
            # Checked before decoding the pixels, so a small PNG of a huge image costs nothing.
            size, mode = im.size, im.mode
            pixels = im.tobytes() if (size, mode) == ((w, h), MODES[c]) else None
    except UnidentifiedImageError:  # its message names the BytesIO object, at its memory address
        raise ApiError(field, "is not an image Pillow can read (its IHDR names no supported PNG format)") from None
    except Exception as e:  # noqa: BLE001 - Pillow raises OSError, SyntaxError, zlib.error... for a broken file
        raise ApiError(field, f"cannot be decoded as PNG: its image data is corrupt ({e})") from None
    if size != (w, h):
        raise ApiError(field, f"is {size[0]}x{size[1]} pixels; this model takes {w}x{h}")
    if mode != MODES[c]:
        raise ApiError(field, f"has PIL mode {mode}; this model takes {c}-channel 8-bit images, mode "
                              f"{MODES[c]}")
    return np.frombuffer(pixels, dtype=np.uint8).reshape(h, w, c).transpose(2, 0, 1)
