"""Seeded class-conditional 1 x 28 x 28 images that need no download: for offline runs and tests.

Each class has a smooth random prototype. An example is its class prototype blended with a random
other class's prototype, randomly shifted, plus pixel noise. Blends past one half and the noise make
some examples genuinely ambiguous, so a small ConvNet reaches about 80% test accuracy within an epoch
but cannot reach 100%.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .transforms import shift_flip

NUM_CLASSES = 10
SIZE = 28
MAX_BLEND = 0.6  # other class's weight ~ U[0, MAX_BLEND]; > 0.5 (1 in 6) it outweighs the label
NOISE = 1.2  # pixel noise, in units of a prototype's standard deviation
MAX_SHIFT = 2


def _prototypes(g: torch.Generator) -> torch.Tensor:
    coarse = torch.randn(NUM_CLASSES, 1, 7, 7, generator=g)
    protos = F.interpolate(coarse, size=(SIZE, SIZE), mode="bicubic", align_corners=False)
    protos = protos - protos.mean(dim=(1, 2, 3), keepdim=True)
    return protos / protos.std(dim=(1, 2, 3), keepdim=True)


def _sample(protos: torch.Tensor, per_class: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.arange(NUM_CLASSES).repeat_interleave(per_class)
    n = len(y)
    # Adding 1..C-1 modulo C picks a different class uniformly.
    other = (y + torch.randint(1, NUM_CLASSES, (n,), generator=g)) % NUM_CLASSES
    blend = (torch.rand(n, generator=g) * MAX_BLEND).view(n, 1, 1, 1)
    x = (1 - blend) * protos[y] + blend * protos[other]
    dy = torch.randint(-MAX_SHIFT, MAX_SHIFT + 1, (n,), generator=g)
    dx = torch.randint(-MAX_SHIFT, MAX_SHIFT + 1, (n,), generator=g)
    x = shift_flip(x, dy, dx, torch.zeros(n, dtype=torch.bool), pad=MAX_SHIFT)
    x = x + NOISE * torch.randn(x.shape, generator=g)
    pixels = (127.5 + 50.0 * x).round().clamp(0, 255).to(torch.uint8)
    order = torch.randperm(n, generator=g)
    return pixels[order].contiguous(), y[order]


def make_synthetic(
    train_per_class: int, test_per_class: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train_x, train_y, test_x, test_y): uint8 N x 1 x 28 x 28 images, int64 labels, balanced."""
    g = torch.Generator().manual_seed(seed)
    protos = _prototypes(g)
    train_x, train_y = _sample(protos, train_per_class, g)
    test_x, test_y = _sample(protos, test_per_class, g)
    return train_x, train_y, test_x, test_y
