"""Batch-level image transforms on tensors: normalisation and CIFAR-style crop/flip augmentation."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

PAD = 2


def normalize(x_uint8: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """float32 ``(x / 255 - mean) / std`` per channel, for N x C x H x W or C x H x W input."""
    m = torch.as_tensor(mean, dtype=torch.float32, device=x_uint8.device).view(-1, 1, 1)
    s = torch.as_tensor(std, dtype=torch.float32, device=x_uint8.device).view(-1, 1, 1)
    return (x_uint8.to(torch.float32) / 255.0 - m) / s


def normalized_black(mean: Sequence[float], std: Sequence[float]) -> list[float]:
    """The raw image's zero (black) per channel after ``normalize``: the padding value of an augmentation
    applied to normalised images."""
    return [-m / sd for m, sd in zip(mean, std)]


def shift_flip(
    x: Tensor, dy: Tensor, dx: Tensor, flip: Tensor, pad: int = PAD, fill: float | Sequence[float] = 0.0
) -> Tensor:
    """Per-example translation by (dy, dx) in [-pad, pad], then optional horizontal flip.

    Equivalent to padding by ``pad`` with ``fill`` (a scalar or one value per channel) and cropping
    H x W at offset (pad + dy, pad + dx); done with one gather over index grids instead of a loop over
    images. The result keeps ``x``'s memory format (channels_last stays channels_last).
    """
    n, _, h, w = x.shape
    dev = x.device
    channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    fill_t = torch.as_tensor(fill, dtype=x.dtype, device=dev)
    per_channel = fill_t.ndim > 0 or fill_t.item() != 0
    if per_channel:
        fill_t = fill_t.view(-1, 1, 1)
        x = x - fill_t  # pad with zeros around (x - fill), then add fill back everywhere
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    rows = (dy.to(dev) + pad).view(n, 1) + torch.arange(h, device=dev)  # n x h
    cols = (dx.to(dev) + pad).view(n, 1) + torch.arange(w, device=dev)  # n x w
    cols = torch.where(flip.to(dev).view(n, 1), cols.flip(1), cols)
    batch = torch.arange(n, device=dev).view(n, 1, 1)
    # Advanced indices on dims 0, 1, 2 of the NHWC view give an n x h x w x C result.
    out = padded.permute(0, 2, 3, 1)[batch, rows.view(n, h, 1), cols.view(n, 1, w)].permute(0, 3, 1, 2)
    if per_channel:
        out = out + fill_t
    return out.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def augment_batch(x: Tensor, generator: torch.Generator, fill: float | Sequence[float] = 0.0) -> Tensor:
    """Pad 2, random H x W crop, random horizontal flip, each drawn per example.

    The usual pipeline pads the raw image with black: apply this to uint8 images before ``normalize``,
    or to normalised images with ``fill=normalized_black(mean, std)``. The draws come from
    ``generator`` (on its own device) and are then moved to ``x``'s device, so a given generator state
    always gives the same augmentation.
    """
    return shift_flip(x, *augment_draws(x.shape[0], generator), fill=fill)


def augment_draws(n: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """``augment_batch``'s random draws for n examples, (dy, dx, flip), on the generator's device: apart so
    that a batched update (``fedrod_ray.client_update.batched``) can draw each client's exactly as its own
    update does."""
    gdev = generator.device
    dy = torch.randint(-PAD, PAD + 1, (n,), generator=generator, device=gdev)
    dx = torch.randint(-PAD, PAD + 1, (n,), generator=generator, device=gdev)
    flip = torch.rand(n, generator=generator, device=gdev) < 0.5
    return dy, dx, flip
