"""A feature-extractor factory for ``model.arch: fedrod_example.model:small_cnn``.

fedrod-ray calls it with the input shape (C, H, W) and adds the generic head, the personalized head or
hypernetwork and everything else; it only has to map N x C x H x W images to N x d features.
"""

from __future__ import annotations

from torch import nn


def small_cnn(input_shape: tuple[int, int, int], width: int = 16, features: int = 32) -> nn.Module:
    channels, _, _ = input_shape
    return nn.Sequential(
        nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1, stride=2), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(),  # any image size gives width x 2 x 2 values
        nn.Linear(width * 4, features), nn.ReLU(),
    )
