"""Real MNIST split between two sites' data directories, and the same clients as one in-memory folder: what the
tests of sites (tests/test_sites.py) train on."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

SITES = {"a": ("a0", "a1", "a2"), "b": ("b0", "b1", "b2")}
PER_CLIENT = 40  # training images per client
TEST_PER_CLASS = 10  # the server's test set
OWN_TEST = 12  # a client's own test images (own_tests=True)


def make_sites(root: Path, data_dir: Path, own_tests: bool = False) -> dict[str, Path]:
    """Under ``root``: site-a/ and site-b/ (clients/<client>/<class>/*.png, each client three classes of real
    MNIST training images; with ``own_tests``, clients/<client>/test/<class>/ of test images), server/test/<class>/
    (the server's test set) and all/ (every client and the test set, as one ``data.dataset: folder``, by links).
    Returns the paths by name: "a", "b", "server", "all"."""
    from PIL import Image

    from fedrod_ray.config import DataConfig
    from fedrod_ray.data import load_dataset

    ds = load_dataset(DataConfig(dataset="mnist", data_dir=str(data_dir), download=False))
    tx, ty = ds.train_x.numpy()[:, 0], ds.train_y.numpy()
    vx, vy = ds.test_x.numpy()[:, 0], ds.test_y.numpy()

    def write(folder: Path, images: np.ndarray, labels: np.ndarray) -> None:
        for i, (img, y) in enumerate(zip(images, labels)):
            (folder / str(y)).mkdir(parents=True, exist_ok=True)
            Image.fromarray(img, mode="L").save(folder / str(y) / f"{i:04d}.png")

    rng = np.random.default_rng(0)
    paths = {name: root / f"site-{name}" for name in SITES} | {"server": root / "server", "all": root / "all"}
    k = 0
    for site, clients in SITES.items():
        for name in clients:
            classes = [(3 * k + j) % 10 for j in range(3)]
            pick = np.concatenate([rng.choice(np.flatnonzero(ty == c), PER_CLIENT // 3 + (j == 0), replace=False)
                                   for j, c in enumerate(classes)])
            folder = paths[site] / "clients" / name
            write(folder, tx[pick], ty[pick])
            if own_tests:
                own = np.concatenate([rng.choice(np.flatnonzero(vy == c), OWN_TEST // 3, replace=False)
                                      for c in classes])
                write(folder / "test", vx[own], vy[own])
            (paths["all"] / "clients").mkdir(parents=True, exist_ok=True)
            (paths["all"] / "clients" / name).symlink_to(folder)
            k += 1
    test = np.concatenate([np.flatnonzero(vy == c)[:TEST_PER_CLASS] for c in range(10)])
    write(paths["server"] / "test", vx[test], vy[test])
    if not own_tests:
        (paths["all"] / "test").symlink_to(paths["server"] / "test")
    return paths


def sites_config(paths: dict[str, Path], head: str, **train) -> dict:
    """A run at the two sites: 3 rounds, half the clients each round."""
    train_cfg = {"head": head, "rounds": 3, "client_fraction": 0.5, "local_epochs": 1, "batch_size": 20, **train}
    if head == "ditto":
        train_cfg.update(balanced_loss="ce")
    return {"name": f"sites_{head}", "seed": 0,
            "data": {"dataset": "sites", "path": str(paths["server"]), "partition": "natural", "num_clients": 6,
                     "normalize": False},
            "sites": [{"name": name, "path": str(paths[name])} for name in SITES],
            "train": train_cfg,
            "runtime": {"torch_threads": 1, "checkpoint_every": 1}}


def memory_config(paths: dict[str, Path], head: str, **train) -> dict:
    """The same federation, in this process, from the same clients as one folder."""
    cfg = sites_config(paths, head, **train)
    del cfg["sites"]
    cfg["data"].update(dataset="folder", path=str(paths["all"]))
    cfg["runtime"]["mode"] = "local"
    return cfg


@contextmanager
def site_cluster(**init) -> Iterator[tuple[object, dict]]:
    """A real multi-node local Ray cluster for a run at the sites, this process its driver (``ray.init(**init)``):
    a head with no CPU and no dashboard, and one 1-CPU worker node per site, labelled ``fedrod.site=<name>``.
    Yields the cluster and the site nodes by name; shuts both down at the end."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        nodes = {name: add_site_node(cluster, name) for name in SITES}
        ray.init(address=cluster.address, log_to_driver=False, **init)
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def add_site_node(cluster, name: str):
    """A 1-CPU worker node of site ``name`` (labelled ``fedrod.site=<name>``) added to ``cluster``."""
    return cluster.add_node(num_cpus=1, labels={"fedrod.site": name})
