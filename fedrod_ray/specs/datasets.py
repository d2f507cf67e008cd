"""Datasets (``data.dataset``, ``fedrod_ray.data``): the built-in sets, the user's own, and the entry-point
group through which installed packages add more (``fedrod_ray.config.plugins``)."""

from __future__ import annotations

DATASETS = ("mnist", "fmnist", "emnist", "cifar10", "cifar100", "synthetic")  # found under data.data_dir
# The user's own images, under data.path (fedrod_ray.data.folder, fedrod_ray.data.arrays).
USER_DATASETS = ("folder", "arrays")
DATASET_PLUGINS = "fedrod_ray.datasets"
