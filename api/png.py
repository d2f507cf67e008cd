"""A PNG file's chunk structure, checked before Pillow decodes it, so that a client hears what is wrong with a
broken file (truncated, a bad checksum, not an image) rather than Pillow's "cannot identify image file"."""

from __future__ import annotations

import struct
import zlib

SIGNATURE = b"\x89PNG\r\n\x1a\n"
CHUNK_HEAD = struct.Struct(">I4s")  # length, type; the data and a CRC-32 of type + data follow


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
