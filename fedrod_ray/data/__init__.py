"""Image datasets as in-memory uint8 tensors: MNIST, Fashion-MNIST, EMNIST digits, CIFAR-10/100, synthetic,
the user's own (an image folder or an .npz under data.path) and those that packages register under the
``fedrod_ray.datasets`` entry point (a callable ``(cfg: DataConfig, seed: int) -> ImageDataset``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..config import ConfigError
from ..specs.datasets import DATASET_PLUGINS, DATASETS, SITES
from . import cifar, files, idx
from .arrays import image_shape as arrays_shape
from .arrays import read_arrays
from .classes import class_names
from .files import DatasetFormatError, DatasetNotFoundError, resolve_data_dir
from .folder import image_shape as folder_shape
from .folder import read_folder
from .layout import RawImages
from .sites import read_server_test, server_image_shape
from .synthetic import make_synthetic
from .transforms import augment_batch, normalize

if TYPE_CHECKING:
    from fedrod_ray.config import DataConfig

__all__ = [
    "DatasetFormatError",
    "DatasetNotFoundError",
    "ImageDataset",
    "RawImages",
    "augment_batch",
    "class_names",
    "declared_image_shape",
    "from_raw",
    "load_dataset",
    "load_server_test",
    "normalize",
    "resolve_data_dir",
]

_STATS = {
    "mnist": ((0.1307,), (0.3081,)),
    "fmnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
_IMAGE_SHAPES = {"mnist": (1, 28, 28), "fmnist": (1, 28, 28), "emnist": (1, 28, 28), "cifar10": (3, 32, 32),
                 "cifar100": (3, 32, 32), "synthetic": (1, 28, 28)}
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
    classes: tuple[str, ...] = ()  # label c's name; empty: the built-in set's (fedrod_ray.data.classes)
    # Natural clients (data.partition: natural): each training example's client, an index into client_names.
    train_clients: np.ndarray | None = None
    client_names: tuple[str, ...] = ()
    # Their own test sets: each test example's client, an index into client_names (None: no client has one).
    test_clients: np.ndarray | None = None

    @property
    def image_shape(self) -> tuple[int, int, int]:
        c, h, w = self.train_x.shape[1:]
        return int(c), int(h), int(w)

    @property
    def class_names(self) -> list[str]:
        return list(self.classes) if self.classes else class_names(self.name, self.num_classes)


def load_dataset(cfg: DataConfig, seed: int = 0) -> ImageDataset:
    """Load ``cfg.dataset`` from ``<data_dir>/<dataset>/``, downloading it first if allowed and missing.

    ``seed`` only matters for the synthetic dataset, which is generated rather than read.
    """
    name = cfg.dataset
    if name == SITES:
        raise ConfigError("data.dataset: sites keeps the clients' data at the sites, which no process reads "
                          "whole; the server loads its test set only (load_server_test)")
    if name in ("folder", "arrays"):
        if cfg.path is None:
            raise ConfigError(f"data.path: data.dataset={name} reads the data from data.path; set it")
        raw = read_folder(cfg.path) if name == "folder" else read_arrays(cfg.path)
        return from_raw(name, raw, cfg)
    if name not in DATASETS:
        # Only here: the HTTP service imports this package for its normalisation, and nothing it does not need.
        from ..config.plugins import load_plugin

        ds = load_plugin(DATASET_PLUGINS, name, "data.dataset", "dataset")(cfg, seed)
        if not isinstance(ds, ImageDataset):
            raise ConfigError(f"data.dataset: the plug-in {name!r} returned a {type(ds).__name__}, not an "
                              "ImageDataset")
        return ds
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


def declared_image_shape(cfg: DataConfig) -> tuple[int, int, int] | None:
    """C x H x W of ``cfg``'s images without loading them: fixed for the built-in sets; for the user's own, from
    one header (the first image of a folder, x_train's in an .npz). None for a plug-in's dataset, which only
    loading it tells, and for data that cannot be read here: loading it says why, naming the file."""
    if cfg.dataset in _IMAGE_SHAPES:
        return _IMAGE_SHAPES[cfg.dataset]
    if cfg.dataset == SITES and cfg.path is not None:
        return server_image_shape(cfg.path)
    if cfg.dataset not in ("folder", "arrays") or cfg.path is None:
        return None
    try:
        return (folder_shape if cfg.dataset == "folder" else arrays_shape)(cfg.path)
    except (DatasetFormatError, DatasetNotFoundError):
        return None


def load_server_test(cfg: DataConfig) -> ImageDataset:
    """``data.dataset: sites``: the dataset as the server holds it, its public test set at ``data.path`` and no
    training example (the sites hold those). With ``data.normalize``, the statistics are the test set's, so that
    nothing is computed from the sites' data."""
    test = read_server_test(cfg.path)
    empty = np.empty((0, *test.x.shape[1:]), np.uint8)
    return ImageDataset(SITES, _tensor(empty), torch.empty(0, dtype=torch.int64), _tensor(test.x), _tensor(test.y),
                        len(test.classes), *_stats(cfg, test.x), augment=False, classes=test.classes)


def from_raw(name: str, raw: RawImages, cfg: DataConfig) -> ImageDataset:
    """The dataset of the user's own images; no augmentation unless train.augment asks for it."""
    return ImageDataset(name, _tensor(raw.train_x), _tensor(raw.train_y), _tensor(raw.test_x), _tensor(raw.test_y),
                        len(raw.classes), *_stats(cfg, raw.train_x), augment=False, classes=raw.classes,
                        train_clients=raw.train_clients, client_names=raw.client_names,
                        test_clients=raw.test_clients)


def _stats(cfg: DataConfig, train_x: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The per-channel mean and std that every input is normalised with; (0, 1) without normalisation,
    which makes ``normalize`` the plain x / 255 everywhere (training, evaluation, the served model)."""
    channels = train_x.shape[1]
    if not cfg.normalize:
        return (0.0,) * channels, (1.0,) * channels
    if cfg.dataset in _STATS:
        return _STATS[cfg.dataset]
    # No published per-channel statistics cover EMNIST digits, the synthetic set or the user's own images:
    # measured on the training images.
    return _pixel_stats(train_x)


def _tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def _pixel_stats(x: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of uint8 N x C x H x W images, in [0, 1] units."""
    flat = x.transpose(1, 0, 2, 3).reshape(x.shape[1], -1).astype(np.float32) / 255
    return tuple(float(v) for v in flat.mean(1)), tuple(float(v) for v in flat.std(1))
