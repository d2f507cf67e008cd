"""``data.dataset: arrays``: an .npz already in memory's shape, the fast path for the user's own data.

Keys: ``x_train``, ``y_train``, ``x_test``, ``y_test`` (uint8 images N x H x W x C, N x C x H x W or
N x H x W; integer labels), optionally ``class_names`` (strings, label order) and ``client_train`` (the
natural client of each training example, for ``data.partition: natural``: integers 0..K-1 or strings).
Read with ``allow_pickle=False``: an .npz cannot run code.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from .files import DatasetFormatError, DatasetNotFoundError
from .layout import RawImages, check_labels, to_nchw

REQUIRED = ("x_train", "y_train", "x_test", "y_test")
OPTIONAL = ("class_names", "client_train")


def read_arrays(path: str) -> RawImages:
    p = Path(path).expanduser()
    if not p.is_file():
        raise DatasetNotFoundError(f"data.path: {p} does not exist (data.dataset=arrays reads an .npz file)")
    try:
        with np.load(p, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise DatasetFormatError(f"data.path: {p} is not a readable .npz: {e}") from e
    missing = [k for k in REQUIRED if k not in arrays]
    if missing:
        raise DatasetFormatError(f"data.path: {p} lacks {', '.join(missing)} (needs {', '.join(REQUIRED)})")
    unknown = sorted(set(arrays) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        hint = " (per-client test sets are not supported yet)" if "client_test" in unknown else ""
        raise DatasetFormatError(f"data.path: {p} holds {', '.join(unknown)}, which fedrod-ray does not read"
                                 f"{hint}; it reads {', '.join(REQUIRED + OPTIONAL)}")
    tx, vx = to_nchw(arrays["x_train"], f"{p}: x_train"), to_nchw(arrays["x_test"], f"{p}: x_test")
    if tx.shape[1:] != vx.shape[1:]:
        raise DatasetFormatError(f"{p}: x_train images are {tx.shape[1:]} (C x H x W) but x_test's are "
                                 f"{vx.shape[1:]}")
    classes = _class_names(arrays, p)
    num_classes = len(classes)
    ty = check_labels(arrays["y_train"], len(tx), num_classes, f"{p}: y_train")
    vy = check_labels(arrays["y_test"], len(vx), num_classes, f"{p}: y_test")
    raw = RawImages(tx, ty, vx, vy, classes)
    if "client_train" in arrays:
        raw.train_clients, raw.client_names = _clients(arrays["client_train"], len(tx), p)
    return raw


def _class_names(arrays: dict[str, np.ndarray], p: Path) -> tuple[str, ...]:
    if "class_names" not in arrays:
        labels = np.concatenate([arrays["y_train"].ravel(), arrays["y_test"].ravel()])
        top = int(labels.max()) if labels.size and np.issubdtype(labels.dtype, np.integer) else 0
        return tuple(f"class_{c}" for c in range(top + 1))
    names = arrays["class_names"]
    if names.ndim != 1 or names.dtype.kind != "U" or not len(names):
        raise DatasetFormatError(f"{p}: class_names must be a non-empty 1-D array of strings, got "
                                 f"{names.dtype} of shape {names.shape}")
    if len(set(names.tolist())) != len(names):
        raise DatasetFormatError(f"{p}: class_names has duplicates")
    return tuple(names.tolist())


def _clients(owner: np.ndarray, n: int, p: Path) -> tuple[np.ndarray, tuple[str, ...]]:
    """(client index of each example, client names): integer ids name clients 0..K-1, each of which must hold
    an example; string ids are sorted."""
    if owner.ndim != 1 or len(owner) != n:
        raise DatasetFormatError(f"{p}: client_train must hold one client id per training image ({n}), got "
                                 f"shape {owner.shape}")
    if np.issubdtype(owner.dtype, np.integer):
        if owner.min() < 0:
            raise DatasetFormatError(f"{p}: client_train ids must be >= 0, got {owner.min()}")
        sizes = np.bincount(owner)
        empty = np.flatnonzero(sizes == 0)
        if len(empty):
            raise DatasetFormatError(f"{p}: client_train: client {empty[0]} has no examples (integer ids must "
                                     f"be 0..{len(sizes) - 1}, each holding at least one example)")
        return owner.astype(np.int64), tuple(str(i) for i in range(len(sizes)))
    if owner.dtype.kind != "U":
        raise DatasetFormatError(f"{p}: client_train must hold integer or string client ids, got {owner.dtype}")
    names, index = np.unique(owner, return_inverse=True)
    return index.astype(np.int64), tuple(names.tolist())
