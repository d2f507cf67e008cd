"""ResNet-20 for 32 x 32 inputs (He et al., 2016, section 4.2): the deeper CIFAR backbone of Fed-RoD's
appendix comparison. 3 stages of 3 basic blocks (16, 32, 64 channels; the 2nd and 3rd stages halve the
resolution), global average pooling to 64 features; the parameter-free option-A shortcut (subsample,
zero-pad the new channels), which gives the paper's 0.27M parameters with a 10-class head.

Its batch-norm running statistics are buffers in the state dict, so the server averages them with the
weights (as FedAvg implementations commonly do).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class _PadShortcut(nn.Module):
    """Option A: x subsampled by ``stride`` and zero-padded from ``in_ch`` to ``out_ch`` channels."""

    def __init__(self, stride: int, in_ch: int, out_ch: int):
        super().__init__()
        self.stride, self.extra = stride, out_ch - in_ch

    def forward(self, x: Tensor) -> Tensor:
        x = x[:, :, ::self.stride, ::self.stride]
        return F.pad(x, (0, 0, 0, 0, self.extra // 2, self.extra - self.extra // 2))


class BasicBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.shortcut = _PadShortcut(stride, in_ch, out_ch) if stride != 1 or in_ch != out_ch else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet20(in_channels: int = 3, feature_dim: int = 64) -> nn.Sequential:
    """N x C x H x W (any H, W >= 4; 32 x 32 in the paper) to N x 64 features."""
    if feature_dim != 64:
        raise ValueError(f"resnet20 has 64 features, not {feature_dim}")
    layers: list[nn.Module] = [nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
    in_ch = 16
    for out_ch, stride in ((16, 1), (32, 2), (64, 2)):
        for b in range(3):
            layers.append(BasicBlock(in_ch, out_ch, stride if b == 0 else 1))
            in_ch = out_ch
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
