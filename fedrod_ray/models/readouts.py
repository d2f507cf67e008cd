"""A method's own readout of the features: modules beyond the extractor and the generic head that a
personalization method adds to the model (``FedModel(readout=...)``), and how its GM and its PM read z.

Its parameters are shared (averaged by the server, checkpointed with the global weights) unless named in
``personal`` (each client keeps those: ``Personalization.personal_keys``). Because the model carries the
readout, every runtime that builds the run's model (in process, Ray actors, sites, Flower, ``final/``) has it,
and the evaluation's one call, ``FedModel.generic_logits`` / ``personal_logits``, reads both models.

GPFL (Zhang et al., ICCV 2023): global category embeddings E and the Conditional Valve (CoV). FedCP (Zhang et
al., KDD 2023): the Conditional Policy Network (CPN) and a personal head beside the global head h^g (the
model's generic head). FedDBE (Zhang et al., NeurIPS 2023): a personal bias of the features. docs/method.md
states them.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn


class Readout(nn.Module):
    """The interface: the GM's logits (default: the model's generic head) and the PM's logits of z."""

    personal: ClassVar[tuple[str, ...]] = ()  # entries of its state dict each client keeps

    def generic_logits(self, model: nn.Module, z: torch.Tensor) -> torch.Tensor:
        return model.generic_head(z)

    def personal_logits(self, model: nn.Module, z: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class CoV(nn.Module):
    """GPFL's Conditional Valve: CoV(z, c) = ReLU(z * (gamma(c) + 1) + beta(c)), gamma and beta each
    Linear(d, d) -> ReLU -> LayerNorm(d) (affine), as the official code."""

    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.LayerNorm(dim))
        self.beta = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.LayerNorm(dim))

    def forward(self, z: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return F.relu(z * (self.gamma(c) + 1) + self.beta(c))


def cosine_logits(f: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
    """[cos(f, E_c)]_c: unscaled cosine similarities of each row of f to each class embedding."""
    return F.linear(F.normalize(f, dim=-1), F.normalize(embeddings, dim=-1))


class GPFLReadout(Readout):
    """E in R^{C x d} (N(0, 1), shared), the CoV (shared), and per client the personal head h (bias-free, as
    every head here) and the conditions g and p (zeros until the client has trained).

    GM: argmax_c cos(CoV(z, g_bar), E_c) with g_bar = mean_c E_c; PM: h(CoV(z, p))."""

    personal = ("head.weight", "g", "p")

    def __init__(self, feature_dim: int, num_classes: int):
        super().__init__()
        self.embedding = nn.Embedding(num_classes, feature_dim)
        self.cov = CoV(feature_dim)
        self.head = nn.Linear(feature_dim, num_classes, bias=False)
        self.register_buffer("g", torch.zeros(feature_dim))
        self.register_buffer("p", torch.zeros(feature_dim))

    def generic_logits(self, model, z):
        e = self.embedding.weight
        return cosine_logits(self.cov(z, e.mean(0)), e)

    def personal_logits(self, model, z):
        return self.head(self.cov(z, self.p))


def gumbel_softmax(a: torch.Tensor, noise: torch.Generator, dim: int, tau: float = 1.0) -> torch.Tensor:
    """Soft Gumbel-softmax of ``a`` along ``dim`` with Gumbel(0, 1) noise -log(Exp(1)) drawn on the CPU from
    ``noise`` (torch's ``F.gumbel_softmax`` draws from the global generator: not reproducible per client)."""
    g = -torch.empty(a.shape, dtype=a.dtype).exponential_(generator=noise).log()
    return ((a + g.to(a.device)) / tau).softmax(dim)


class FedCPReadout(Readout):
    """The CPN, Linear(d, 2d) -> LayerNorm(2d) -> ReLU (shared), and per client the personal head h^p
    (bias-free) and the context c. The global head h^g is the model's generic head: the GM is h^g(z).

    PM: (s, s') = Gumbel-softmax over the two rows of CPN(z * c / ||c||) viewed 2 x d, and
    h^p(z * s) + h^g(z * s'). The noise is drawn from ``noise``, a generator the method seeds before every use
    (training, and the PM's evaluation), so that a PM scores the same on every runtime."""

    personal = ("head.weight", "context")

    def __init__(self, feature_dim: int, num_classes: int):
        super().__init__()
        self.cpn = nn.Sequential(nn.Linear(feature_dim, 2 * feature_dim), nn.LayerNorm(2 * feature_dim), nn.ReLU())
        self.head = nn.Linear(feature_dim, num_classes, bias=False)
        self.register_buffer("context", torch.ones(feature_dim))  # each client's is drawn by the method
        self.noise: torch.Generator | None = None

    def masks(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, s'), the personal and global soft masks of each sample (s + s' = 1)."""
        if self.noise is None:
            raise RuntimeError("FedCP's readout needs its noise generator seeded before a forward pass")
        a = self.cpn(z * (self.context / self.context.norm())).view(len(z), 2, -1)
        s = gumbel_softmax(a, self.noise, dim=1)
        return s[:, 0], s[:, 1]

    def personal_logits(self, model, z):
        return masked_logits(z, *self.masks(z), self.head, model.generic_head)


def masked_logits(z: torch.Tensor, s: torch.Tensor, s2: torch.Tensor, personal_head: nn.Module,
                  global_head: nn.Module) -> torch.Tensor:
    """FedCP's output h^p(z * s) + h^g(z * s')."""
    return personal_head(z * s) + global_head(z * s2)


class DBEReadout(Readout):
    """FedDBE's personalized representation bias z^p (the PRBM, personal, zeros at first), added to the
    features before the generic head: PM h(z + z^p); the GM is h(z), without it."""

    personal = ("shift",)

    def __init__(self, feature_dim: int, num_classes: int):
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(feature_dim))

    def personal_logits(self, model, z):
        return model.generic_head(z + self.shift)


READOUTS: dict[str, type[Readout]] = {"gpfl": GPFLReadout, "fedcp": FedCPReadout, "feddbe": DBEReadout}
