"""Datasets (``data.dataset``, ``fedrod_ray.data``): the built-in sets, the user's own, and the entry-point
group through which installed packages add more (``fedrod_ray.config.plugins``)."""

from __future__ import annotations

DATASETS = ("mnist", "fmnist", "emnist", "cifar10", "cifar100", "synthetic")  # found under data.data_dir
# The user's own images, under data.path (fedrod_ray.data.folder, fedrod_ray.data.arrays); sites: the clients'
# data lives at the sites (the config's ``sites``), and data.path is the server's public test set only.
USER_DATASETS = ("folder", "arrays", "sites")
SITES = "sites"
DATASET_PLUGINS = "fedrod_ray.datasets"
