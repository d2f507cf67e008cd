"""The paper's small ConvNet feature extractors: z = f(x; theta).

Max-pooling comes before each ReLU: the two commute (ReLU is monotone), and pooling first makes the
ReLU and its backward four times cheaper.
"""

from __future__ import annotations

from torch import nn


def mnist_cnn(in_channels: int = 1, feature_dim: int = 50) -> nn.Sequential:
    """28x28 inputs: two 5x5 convs (32, 64 channels) with 2x2 max-pooling, then FC to 50 features."""
    return nn.Sequential(
        nn.Conv2d(in_channels, 32, 5), nn.MaxPool2d(2), nn.ReLU(),
        nn.Conv2d(32, 64, 5), nn.MaxPool2d(2), nn.ReLU(),
        nn.Flatten(), nn.Linear(64 * 4 * 4, feature_dim), nn.ReLU(),
    )


def cifar_cnn(in_channels: int = 3, feature_dim: int = 64) -> nn.Sequential:
    """32x32 inputs: three 3x3 convs (32, 64, 64 channels), each followed by 2x2 max-pooling, FC to 64."""
    return nn.Sequential(
        nn.Conv2d(in_channels, 32, 3, padding=1), nn.MaxPool2d(2), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.MaxPool2d(2), nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1), nn.MaxPool2d(2), nn.ReLU(),
        nn.Flatten(), nn.Linear(64 * 4 * 4, feature_dim), nn.ReLU(),
    )

