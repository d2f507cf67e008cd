"""The paper's small ConvNet feature extractors: z = f(x; theta).

Their first fully connected layer takes the last feature map of the image size they are built for, so
they fit any image their convolutions can take (``MIN_SIDE``); at the paper's sizes (28 x 28, 32 x 32)
they are the paper's networks. Max-pooling comes before each ReLU: the two commute (ReLU is monotone), and
pooling first makes the ReLU and its backward four times cheaper.
"""

from __future__ import annotations

from torch import nn

from ..config import ConfigError

# The smallest image side each ConvNet takes: its last feature map is then 1 x 1.
MIN_SIDE = {"mnist_cnn": 16, "cifar_cnn": 8}


def mnist_cnn(in_channels: int = 1, feature_dim: int = 50, image_hw: tuple[int, int] = (28, 28)) -> nn.Sequential:
    """Two 5x5 convs (32, 64 channels) with 2x2 max-pooling, then FC to 50 features (from 64 x 4 x 4 at 28x28)."""
    h, w = (((side - 4) // 2 - 4) // 2 for side in _fits("mnist_cnn", image_hw))
    return nn.Sequential(
        nn.Conv2d(in_channels, 32, 5), nn.MaxPool2d(2), nn.ReLU(),
        nn.Conv2d(32, 64, 5), nn.MaxPool2d(2), nn.ReLU(),
        nn.Flatten(), nn.Linear(64 * h * w, feature_dim), nn.ReLU(),
    )


def cifar_cnn(in_channels: int = 3, feature_dim: int = 64, image_hw: tuple[int, int] = (32, 32)) -> nn.Sequential:
    """Three 3x3 convs (32, 64, 64 channels), each followed by 2x2 max-pooling, then FC to 64 features (from
    64 x 4 x 4 at 32x32)."""
    h, w = (side // 8 for side in _fits("cifar_cnn", image_hw))
    return nn.Sequential(
        nn.Conv2d(in_channels, 32, 3, padding=1), nn.MaxPool2d(2), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.MaxPool2d(2), nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1), nn.MaxPool2d(2), nn.ReLU(),
        nn.Flatten(), nn.Linear(64 * h * w, feature_dim), nn.ReLU(),
    )


def _fits(arch: str, image_hw: tuple[int, int]) -> tuple[int, int]:
    if min(image_hw) < MIN_SIDE[arch]:
        raise ConfigError(f"model.arch: {arch} takes images of at least {MIN_SIDE[arch]} x {MIN_SIDE[arch]}, not "
                          f"{' x '.join(map(str, image_hw))}; choose another model.arch (a package.module:factory "
                          "for images this small)")
    return image_hw
