"""The user's own images before they become an ``ImageDataset``: the arrays every loader of data.path
(folder, arrays) produces, and the checks they share."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .files import DatasetFormatError


@dataclass
class RawImages:
    train_x: np.ndarray  # uint8 N x C x H x W
    train_y: np.ndarray  # int64 N
    test_x: np.ndarray
    test_y: np.ndarray
    classes: tuple[str, ...]  # label c's name
    # Natural clients: the client index (into client_names) of each training example, or None.
    train_clients: np.ndarray | None = None
    client_names: tuple[str, ...] = ()
    # Their own test sets: the client index of each test example (the test set is the union of theirs), or None.
    test_clients: np.ndarray | None = None


def to_nchw(x: np.ndarray, where: str) -> np.ndarray:
    """uint8 N x C x H x W from N x H x W (one channel), N x H x W x C or N x C x H x W.

    The layout is read from where the channel axis (1 or 3 entries) is: a shape that has one in both
    places (e.g. N x 3 x 8 x 3) is ambiguous and refused rather than guessed.
    """
    if x.dtype != np.uint8:
        raise DatasetFormatError(f"{where}: images must be uint8 (0..255), got {x.dtype}")
    layout = image_layout(x.shape, where)
    if layout == "NHW":
        return np.ascontiguousarray(x[:, None])
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2) if layout == "NHWC" else x)


def image_layout(shape: tuple[int, ...], where: str) -> str:
    """NHW, NHWC or NCHW: the layout of images of ``shape`` (``to_nchw``)."""
    if len(shape) == 3:
        return "NHW"
    if len(shape) != 4:
        raise DatasetFormatError(f"{where}: images must be N x H x W, N x H x W x C or N x C x H x W, "
                                 f"got shape {shape}")
    first, last = shape[1] in (1, 3), shape[3] in (1, 3)
    if first and last:
        raise DatasetFormatError(f"{where}: shape {shape} is ambiguous: axis 1 and axis 3 could both be "
                                 "the channels (1 or 3); store it as N x H x W x C with H, W not 1 or 3, "
                                 "or transpose it yourself")
    if last:
        return "NHWC"
    if first:
        return "NCHW"
    raise DatasetFormatError(f"{where}: shape {shape} has no channel axis of 1 or 3 entries (grey or RGB) "
                             "at axis 1 (N x C x H x W) or 3 (N x H x W x C)")


def chw(shape: tuple[int, ...], where: str) -> tuple[int, int, int]:
    """C x H x W of one image, from the shape of a stack of them in any layout ``to_nchw`` reads."""
    layout = image_layout(shape, where)
    if layout == "NHW":
        return 1, shape[1], shape[2]
    return (shape[3], shape[1], shape[2]) if layout == "NHWC" else (shape[1], shape[2], shape[3])


def check_labels(y: np.ndarray, n: int, num_classes: int, where: str) -> np.ndarray:
    """int64 labels, one per image, each in 0..num_classes-1."""
    if y.ndim != 1 or len(y) != n:
        raise DatasetFormatError(f"{where}: expected {n} labels (one per image), got shape {y.shape}")
    if not np.issubdtype(y.dtype, np.integer):
        raise DatasetFormatError(f"{where}: labels must be integers, got {y.dtype}")
    if n and (y.min() < 0 or y.max() >= num_classes):
        raise DatasetFormatError(f"{where}: labels must lie in 0..{num_classes - 1}, got {y.min()}..{y.max()}")
    return y.astype(np.int64)
