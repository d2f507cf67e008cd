"""``data.dataset: sites``: the server's setup once the sites have reported their clients (docs/sites.md).

What the server knows of a site's clients is what the site reports (``data.sites.SiteIndex``): their names
and how many training examples each has. Client ids follow the config's order of the sites, and each site's
clients in name order, so that a site's clients are a contiguous block of ids. The server's own data is its
test set; no client's examples, class distribution or state is here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..config import ConfigError
from ..data.sites import SiteIndex
from .setup import Setup


@dataclass(frozen=True)
class SiteClients:
    """One site's clients as the server knows them: their ids (a block) and names, and its index."""

    name: str
    ids: range
    index: SiteIndex

    def client_name(self, cid: int) -> str:
        return self.index.names[cid - self.ids.start]


@dataclass
class SiteSetup(Setup):
    """A ``Setup`` (its dataset the server's test set only, its partition empty) with the sites' clients."""

    sites: tuple[SiteClients, ...] = ()

    at_sites = True

    @classmethod
    def of(cls, server: Setup, indexes: list[SiteIndex]) -> SiteSetup:
        """The setup of ``server`` (``setup.prepare_server``) with the clients the sites report, in the config's
        order; the sites' images must have the server's shape, and data.num_clients count them all."""
        cfg, sites, start = server.cfg, [], 0
        for i, (site, index) in enumerate(zip(cfg.sites, indexes)):
            if index.image_shape != server.dataset.image_shape:
                raise ConfigError(f"sites.{i}.path: site {site.name}'s images are {index.image_shape} (C x H x W), "
                                  f"the server's test set's {server.dataset.image_shape}")
            sites.append(SiteClients(site.name, range(start, start + len(index.names)), index))
            start += len(index.names)
        if cfg.data.num_clients != start:
            counts = ", ".join(f"{s.name} {len(s.ids)}" for s in sites)
            raise ConfigError(f"data.num_clients: the sites hold {start} clients ({counts}); set "
                              f"data.num_clients={start}")
        return cls(cfg, server.dataset, server.partition, server.test, server.augment, tuple(sites))

    @property
    def num_clients(self) -> int:
        return sum(len(s.ids) for s in self.sites)

    @property
    def all_client_ids(self) -> list[int]:
        return list(range(self.num_clients))

    @property
    def sizes(self) -> np.ndarray:
        return np.array([n for s in self.sites for n in s.index.sizes], dtype=np.int64)

    @property
    def class_dists(self) -> torch.Tensor:
        raise RuntimeError("with sites, each client's class distribution stays at its site (P-FL is computed there)")

    def site_of(self, cid: int) -> SiteClients:
        return next(s for s in self.sites if cid in s.ids)
