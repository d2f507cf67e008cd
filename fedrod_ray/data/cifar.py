"""Reader for the CIFAR-10/100 "python version": pickled batches, in the tar.gz or an extracted folder."""

from __future__ import annotations

import io
import pickle
import tarfile
from pathlib import Path

import numpy as np

from .files import DatasetFormatError

LAYOUT = {
    # dataset: (archive, folder inside it, train batches, test batch, label key, classes)
    "cifar10": (
        "cifar-10-python.tar.gz",
        "cifar-10-batches-py",
        tuple(f"data_batch_{i}" for i in range(1, 6)),
        "test_batch",
        "labels",
        10,
    ),
    "cifar100": ("cifar-100-python.tar.gz", "cifar-100-python", ("train",), "test", "fine_labels", 100),
}

# The batches were written by Python 2 with numpy arrays inside; these are the only globals such a
# pickle needs, so anything else (os.system, eval, ...) in a tampered file is refused, not called.
_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),  # how Python 3's protocol-2 pickles spell bytes
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR batch")


def load_batch(data: bytes, source: str, label_key: str, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """One pickled batch as N x 3 x 32 x 32 uint8 images and int64 labels."""
    try:
        # latin1 turns Python 2 str into str and leaves numpy's raw array bytes intact.
        batch = _RestrictedUnpickler(io.BytesIO(data), encoding="latin1").load()
    except (
        pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError, IndexError,
        ImportError, OverflowError,
    ) as e:  # the ways a corrupt or tampered pickle fails; all mean the same to the user
        raise DatasetFormatError(f"{source}: not a readable CIFAR batch ({type(e).__name__}: {e})") from None
    if not isinstance(batch, dict):
        raise DatasetFormatError(f"{source}: expected a dict, got {type(batch).__name__}")
    batch = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in batch.items()}
    if "data" not in batch or label_key not in batch:
        raise DatasetFormatError(f"{source}: missing 'data' or {label_key!r} (keys: {sorted(batch)})")
    x = np.asarray(batch["data"])
    y = np.asarray(batch[label_key], dtype=np.int64)
    if x.dtype != np.uint8 or x.ndim != 2 or x.shape[1] != 3 * 32 * 32:
        raise DatasetFormatError(f"{source}: data is {x.dtype} {x.shape}, expected uint8 N x 3072")
    if y.shape != (len(x),):
        raise DatasetFormatError(f"{source}: {len(x)} images but labels of shape {y.shape}")
    if len(y) and (y.min() < 0 or y.max() >= num_classes):
        raise DatasetFormatError(f"{source}: labels outside 0..{num_classes - 1}")
    return x.reshape(-1, 3, 32, 32), y


def has_extracted(folder: Path, dataset: str) -> bool:
    _, inner, train_names, test_name, *_ = LAYOUT[dataset]
    return all((folder / inner / n).is_file() for n in (*train_names, test_name))


def read_cifar(folder: Path, dataset: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train_x, train_y, test_x, test_y) from ``folder``'s extracted batches, else its tar.gz.

    The tar is read member by member in memory rather than extracted, so nothing lands on disk and a
    crafted member path cannot escape ``folder``.
    """
    archive, inner, train_names, test_name, label_key, num_classes = LAYOUT[dataset]
    names = (*train_names, test_name)
    extracted = folder / inner
    if has_extracted(folder, dataset):
        blobs = {n: ((extracted / n).read_bytes(), str(extracted / n)) for n in names}
    else:
        path = folder / archive
        blobs = {}
        try:
            with tarfile.open(path, "r:gz") as tar:
                for n in names:
                    try:
                        member = tar.getmember(f"{inner}/{n}")
                    except KeyError:
                        raise DatasetFormatError(f"{path}: no member {inner}/{n}") from None
                    f = tar.extractfile(member)
                    if f is None:
                        raise DatasetFormatError(f"{path}: {inner}/{n} is not a regular file")
                    blobs[n] = (f.read(), f"{path}:{inner}/{n}")
        except (tarfile.TarError, EOFError, OSError) as e:
            raise DatasetFormatError(f"{path}: not a readable tar.gz ({e}); delete it and fetch it again") from None
    train = [load_batch(*blobs[n], label_key, num_classes) for n in train_names]
    test_x, test_y = load_batch(*blobs[test_name], label_key, num_classes)
    train_x = np.concatenate([x for x, _ in train])
    train_y = np.concatenate([y for _, y in train])
    return train_x, train_y, np.array(test_x, order="C"), test_y
