"""Reader for the IDX format of MNIST, Fashion-MNIST and EMNIST (gzip-compressed, big-endian header)."""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np

from .files import DatasetFormatError

_UINT8 = 0x08


def read_idx(path: Path, ndim: int) -> np.ndarray:
    """Read a gzip IDX file of unsigned bytes with ``ndim`` dimensions, checking header and size."""
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as e:
        raise DatasetFormatError(f"{path}: not a readable gzip file ({e}); delete it and fetch it again") from None
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DatasetFormatError(f"{path}: truncated IDX header ({len(raw)} bytes)")
    magic = int.from_bytes(raw[:4], "big")
    expected_magic = (_UINT8 << 8) | ndim  # 2049 for labels, 2051 for images
    if magic != expected_magic:
        raise DatasetFormatError(f"{path}: IDX magic number {magic}, expected {expected_magic}")
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    size = int(np.prod(dims, dtype=np.int64))
    if len(raw) - header != size:
        raise DatasetFormatError(
            f"{path}: header says {dims} = {size} bytes of data but the file holds {len(raw) - header}"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def read_idx_pair(
    images: Path, labels: Path, num_classes: int, transpose: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Images as N x 1 x H x W uint8 and labels as int64, checked against each other.

    ``transpose`` is for EMNIST, whose images are stored column-major relative to MNIST.
    """
    x = read_idx(images, 3)
    y = read_idx(labels, 1).astype(np.int64)
    if len(x) != len(y):
        raise DatasetFormatError(f"{images} holds {len(x)} images but {labels} holds {len(y)} labels")
    if len(y) and y.max() >= num_classes:
        raise DatasetFormatError(f"{labels}: label {y.max()} outside 0..{num_classes - 1}")
    if transpose:
        x = x.transpose(0, 2, 1)
    # A copy, because frombuffer's view of the gzip bytes is read-only and torch wants writable memory.
    return np.array(x[:, None], order="C"), y
