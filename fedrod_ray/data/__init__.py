"""Image datasets as in-memory uint8 tensors: MNIST, Fashion-MNIST, EMNIST digits, CIFAR-10/100, synthetic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..config import DATASETS
from . import cifar, files, idx
from .classes import class_names
from .files import DatasetFormatError, DatasetNotFoundError, resolve_data_dir
from .synthetic import make_synthetic
from .transforms import augment_batch, normalize

if TYPE_CHECKING:
    from fedrod_ray.config import DataConfig

__all__ = [
    "DatasetFormatError",
    "DatasetNotFoundError",
    "ImageDataset",
    "augment_batch",
    "class_names",
    "load_dataset",
    "normalize",
    "resolve_data_dir",
]

_STATS = {
    "mnist": ((0.1307,), (0.3081,)),
    "fmnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
_NUM_CLASSES = {"mnist": 10, "fmnist": 10, "emnist": 10, "cifar10": 10, "cifar100": 100, "synthetic": 10}
_IDX_NAMES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
              "t10k-labels-idx1-ubyte.gz")


@dataclass
class ImageDataset:
    name: str
    train_x: torch.Tensor  # uint8, N x C x H x W, contiguous
    train_y: torch.Tensor  # int64, N
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    mean: tuple[float, ...]  # per channel, in [0, 1] units
    std: tuple[float, ...]
    augment: bool  # whether training uses crop/flip augmentation by default

    @property
    def image_shape(self) -> tuple[int, int, int]:
        c, h, w = self.train_x.shape[1:]
        return int(c), int(h), int(w)


def load_dataset(cfg: DataConfig, seed: int = 0) -> ImageDataset:
    """Load ``cfg.dataset`` from ``<data_dir>/<dataset>/``, downloading it first if allowed and missing.

    ``seed`` only matters for the synthetic dataset, which is generated rather than read.
    """
    name = cfg.dataset
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    num_classes = _NUM_CLASSES[name]
    if name == "synthetic":
        tx, ty, vx, vy = make_synthetic(cfg.synthetic_train_per_class, cfg.synthetic_test_per_class, seed)
        return ImageDataset(name, tx, ty, vx, vy, num_classes, *_stats(cfg, tx.numpy()), augment=False)

    root = resolve_data_dir(cfg.data_dir)
    if name in ("mnist", "fmnist", "emnist"):
        if name == "emnist":
            folder = files.ensure_emnist(root, cfg.download)
            paths = [folder / f for f in files.EMNIST_FILES]
        else:
            folder = files.ensure_files(name, root, cfg.download)
            paths = [folder / f for f in _IDX_NAMES]
        transpose = name == "emnist"
        tx, ty = idx.read_idx_pair(paths[0], paths[1], num_classes, transpose)
        vx, vy = idx.read_idx_pair(paths[2], paths[3], num_classes, transpose)
    else:
        folder = root / name
        if not cifar.has_extracted(folder, name):
            files.ensure_files(name, root, cfg.download)
        tx, ty, vx, vy = cifar.read_cifar(folder, name)
    return ImageDataset(
        name, _tensor(tx), _tensor(ty), _tensor(vx), _tensor(vy), num_classes, *_stats(cfg, tx),
        augment=name in ("cifar10", "cifar100"),
    )


def _stats(cfg: DataConfig, train_x: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The per-channel mean and std that every input is normalised with; (0, 1) without normalisation,
    which makes ``normalize`` the plain x / 255 everywhere (training, evaluation, the served model)."""
    channels = train_x.shape[1]
    if not cfg.normalize:
        return (0.0,) * channels, (1.0,) * channels
    if cfg.dataset in _STATS:
        return _STATS[cfg.dataset]
    # No published per-channel statistics cover EMNIST digits or the synthetic set: measured on the training images.
    return _pixel_stats(train_x)


def _tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def _pixel_stats(x: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of uint8 N x C x H x W images, in [0, 1] units."""
    flat = x.transpose(1, 0, 2, 3).reshape(x.shape[1], -1).astype(np.float32) / 255
    return tuple(float(v) for v in flat.mean(1)), tuple(float(v) for v in flat.std(1))
