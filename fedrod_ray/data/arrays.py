"""``data.dataset: arrays``: an .npz already in memory's shape, the fast path for the user's own data.

Keys: ``x_train``, ``y_train``, ``x_test``, ``y_test`` (uint8 images N x H x W x C, N x C x H x W or
N x H x W; integer labels), optionally ``class_names`` (strings, label order), ``client_train`` (the
natural client of each training example, for ``data.partition: natural``: integers 0..K-1 or strings) and
``client_test`` (each test example's client, ids as in client_train: the clients' own test sets, whose union
is the global test set).
Read with ``allow_pickle=False``: an .npz cannot run code.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from .files import DatasetFormatError, DatasetNotFoundError
from .layout import RawImages, check_labels, chw, to_nchw

REQUIRED = ("x_train", "y_train", "x_test", "y_test")
OPTIONAL = ("class_names", "client_train", "client_test")


def read_arrays(path: str) -> RawImages:
    p = _file(path)
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
        raise DatasetFormatError(f"data.path: {p} holds {', '.join(unknown)}, which fedrod-ray does not read; "
                                 f"it reads {', '.join(REQUIRED + OPTIONAL)}")
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
    if "client_test" in arrays:
        if "client_train" not in arrays:
            raise DatasetFormatError(f"{p}: client_test names the clients of the test examples, but there is no "
                                     "client_train naming those of the training examples")
        raw.test_clients = _test_clients(arrays["client_test"], arrays["client_train"], raw.client_names,
                                         len(vx), p)
    return raw


def image_shape(path: str) -> tuple[int, int, int] | None:
    """C x H x W of x_train's images from its .npy header alone (no pixel is read); None where the header is
    of a format version this does not read."""
    p = _file(path)
    try:
        with zipfile.ZipFile(p) as z, z.open("x_train.npy") as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape = np.lib.format.read_array_header_1_0(f)[0]
            elif version == (2, 0):
                shape = np.lib.format.read_array_header_2_0(f)[0]
            else:
                return None
    except KeyError:
        raise DatasetFormatError(f"data.path: {p} lacks x_train (needs {', '.join(REQUIRED)})") from None
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise DatasetFormatError(f"data.path: {p} is not a readable .npz: {e}") from e
    return chw(shape, f"{p}: x_train")


def _file(path: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_file():
        raise DatasetNotFoundError(f"data.path: {p} does not exist (data.dataset=arrays reads an .npz file)")
    return p


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


def _test_clients(owner: np.ndarray, train_owner: np.ndarray, names: tuple[str, ...], n: int, p: Path) -> np.ndarray:
    """The client index (into ``names``, as client_train's) of each test example. Every client has test
    examples, and every one belongs to a client that trains: a client's P-FL is read from its own test set,
    so a partial set of them would leave some clients measured another way."""
    if owner.ndim != 1 or len(owner) != n:
        raise DatasetFormatError(f"{p}: client_test must hold one client id per test image ({n}), got shape "
                                 f"{owner.shape}")
    integer = np.issubdtype(train_owner.dtype, np.integer)
    if integer != np.issubdtype(owner.dtype, np.integer) or (not integer and owner.dtype.kind != "U"):
        raise DatasetFormatError(f"{p}: client_test must hold client ids of client_train's kind "
                                 f"({train_owner.dtype}), got {owner.dtype}")
    keys = owner.astype(str) if integer else owner
    index = {name: k for k, name in enumerate(names)}
    unknown = next((name for name in keys.tolist() if name not in index), None)
    if unknown is not None:
        raise DatasetFormatError(f"{p}: client_test: client {unknown} has test examples but no training examples "
                                 "(client_train names no such client)")
    out = np.fromiter((index[name] for name in keys.tolist()), np.int64, count=n)
    sizes = np.bincount(out, minlength=len(names))
    if (sizes == 0).any():
        raise DatasetFormatError(f"{p}: client_test: client {names[int(np.argmax(sizes == 0))]} has no test "
                                 "examples; either every client has its own test set or none does (without "
                                 "client_test, each client's P-FL weighs the global test set by its classes)")
    return out
