"""Fed-RoD's two heads and the hypernetwork that generates the personalized one.

Both heads are bias-free linear maps (classes x feature_dim), which is what the paper's parameter
counts imply; the personalized logits are added to the generic ones at the logit level.
"""

from __future__ import annotations

import torch
from torch import nn


class HyperNetwork(nn.Module):
    """phi = H(a; nu): Linear(C -> hidden) -> ReLU -> Linear(hidden -> C * feature_dim), no biases."""

    def __init__(self, num_classes: int, hidden: int, feature_dim: int):
        super().__init__()
        self.num_classes = num_classes
        self.feature_dim = feature_dim
        self.net = nn.Sequential(
            nn.Linear(num_classes, hidden, bias=False),
            nn.ReLU(),
            nn.Linear(hidden, num_classes * feature_dim, bias=False),
        )
        # A zero output layer makes every generated head start at zero, so a fresh personalized model
        # equals the generic one (the same start as the linear variant's zero-initialised head).
        nn.init.zeros_(self.net[2].weight)

    def forward(self, class_dist: torch.Tensor) -> torch.Tensor:
        """Map a class distribution (C,) to the P-head weight (C, feature_dim); a batch (M, C) to (M, C,
        feature_dim)."""
        return self.net(class_dist).view(*class_dist.shape[:-1], self.num_classes, self.feature_dim)

