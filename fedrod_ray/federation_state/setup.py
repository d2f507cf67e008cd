"""What a run derives from its config before training starts, the same on every machine: the dataset,
its partition into clients and the test set (``prepare``), and the host that trains them (``make_host``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..clients.client import ClientContext, ClientHost
from ..config import ConfigError, ExperimentConfig
from ..data import ImageDataset, declared_image_shape, load_dataset, load_server_test
from ..data.partition import Partition, make_partition
from ..data.transforms import normalize
from ..models import FedModel, resolve_arch
from ..models.extractors import check_arch
from ..models.metrics import TestSet
from ..objectives import meta_per_class
from ..personalization import build_method, method_model
from ..specs.models import ARCHS


@dataclass
class Setup:
    """Everything derived from the config before training starts (same on every machine)."""

    cfg: ExperimentConfig
    dataset: ImageDataset
    partition: Partition
    test: TestSet
    augment: bool

    at_sites = False  # the clients' data and state live at their sites (``site_setup.SiteSetup``)

    @property
    def sizes(self) -> np.ndarray:
        """Each client's number of training examples."""
        return self.partition.sizes

    @property
    def num_clients(self) -> int:
        """Training clients; ids from num_clients on are held-out new clients."""
        return self.partition.num_train_clients

    @property
    def all_client_ids(self) -> list[int]:
        return list(range(len(self.partition.client_indices)))

    @property
    def class_dists(self) -> torch.Tensor:
        # A copy: after a trip through Ray's object store the partition's arrays are read-only.
        counts = torch.tensor(self.partition.counts, dtype=torch.float64)
        return counts / counts.sum(1, keepdim=True).clamp_min(1)

    @property
    def pfl_weights(self) -> torch.Tensor:
        """What each client's P-FL weighs its per-class test counts by (``TestSet.pfl_weights``)."""
        return self.test.pfl_weights(self.class_dists)

    def build_model(self) -> FedModel:
        t = self.cfg.train
        return method_model(self.cfg, build_method(t.head, t.head_params), self.dataset.num_classes,
                            self.dataset.image_shape)


def check_model_arch(cfg: ExperimentConfig) -> None:
    """What ``prepare`` checks of a user's ``model.arch`` (an import path or a plug-in), done when the config is
    loaded, before any data is: it imports, builds for the dataset's image shape and gives N x d features on one
    dummy batch; else a ConfigError naming model.arch. The shape is the data's declared one
    (``declared_image_shape``); where only loading the data tells it (a plug-in's dataset), ``prepare`` checks.
    The built-ins import nothing and are checked by ``prepare`` too, so loading their configs stays cheap."""
    arch = cfg.model.arch
    if arch == "auto" or arch in ARCHS:
        return
    shape = declared_image_shape(cfg.data)
    if shape is not None:
        check_arch(arch, shape)


def prepare(cfg: ExperimentConfig) -> Setup:
    ds = load_dataset(cfg.data, seed=cfg.seed)
    # The feature extractor is built and tried once here, before any data moves, so that what is wrong with it
    # (it does not import, build, take these images or give N x d features) stops the run with model.arch named.
    check_arch(resolve_arch(cfg.model.arch, ds.image_shape), ds.image_shape)
    partition = partition_dataset(cfg, ds)
    own = None if partition.test_clients is None else torch.from_numpy(partition.test_clients)
    if own is not None and cfg.eval.estimate_size:
        # The estimate samples the test set by class; the clients' own test sets would need a sample per client.
        raise ConfigError("eval.estimate_size: the P-FL estimate samples the global test set by class, and this "
                          "data gives each client a test set of its own (client_test / clients/<id>/test/), on "
                          "which P-FL is measured; set eval.estimate_size=0")
    test = TestSet(normalize(ds.test_x, ds.mean, ds.std), ds.test_y, ds.num_classes, own)
    augment = ds.augment if cfg.train.augment is None else cfg.train.augment
    return Setup(cfg, ds, partition, test, augment)


def prepare_server(cfg: ExperimentConfig) -> Setup:
    """``data.dataset: sites``: what the server prepares before the sites report their clients: its test set
    (``load_server_test``) and the model's check, no client yet (``site_setup.SiteSetup`` adds them)."""
    ds = load_server_test(cfg.data)
    check_arch(resolve_arch(cfg.model.arch, ds.image_shape), ds.image_shape)
    partition = Partition([], np.zeros((0, ds.num_classes), np.int64), 0)
    test = TestSet(normalize(ds.test_x, ds.mean, ds.std), ds.test_y, ds.num_classes)
    return Setup(cfg, ds, partition, test, bool(cfg.train.augment))


def partition_dataset(cfg: ExperimentConfig, ds: ImageDataset) -> Partition:
    """``cfg``'s split of ``ds`` over the clients (natural: the clients the data names)."""
    return make_partition(cfg.data, ds.train_y.numpy(), ds.num_classes, cfg.seed, meta_per_class(cfg.train),
                          ds.train_clients, ds.client_names, ds.test_y.numpy(), ds.test_clients)


def make_host(setup: Setup, device: str = "cpu") -> ClientHost:
    ds, part = setup.dataset, setup.partition
    return ClientHost(setup.cfg, ClientContext(ds.train_x, ds.train_y, part.client_indices, part.counts, setup.test,
                                               ds.mean, ds.std, setup.augment, part.meta_indices, device))
