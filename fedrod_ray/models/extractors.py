"""The feature extractor f(x; theta) that ``model.arch`` names: a built-in, a plug-in registered under the
``fedrod_ray.models`` entry point, or a ``package.module:factory`` import path. A factory takes the input
shape (C, H, W) and returns an ``nn.Module`` that maps N x C x H x W to N x d; d is read from one dummy
batch, so the heads fedrod-ray adds always fit."""

from __future__ import annotations

import torch
from torch import nn

from ..config.values import ConfigError, check_registry, is_import_path
from ..specs.models import ARCHS, MODEL_PLUGINS
from .convnet import MIN_SIDE, cifar_cnn, mnist_cnn
from .resnet import resnet20

FEATURE_DIM = {"mnist_cnn": 50, "cifar_cnn": 64, "resnet20": 64}
BUILDERS = {"mnist_cnn": mnist_cnn, "cifar_cnn": cifar_cnn, "resnet20": resnet20}
check_registry(BUILDERS, ARCHS, "model.arch")


def feature_extractor(arch: str, image_shape: tuple[int, int, int]) -> tuple[nn.Module, int]:
    """(f, d) for ``arch`` and inputs of ``image_shape``; a ConfigError naming model.arch and what failed. A
    built-in takes (C,) alone for the paper's image size; the ConvNets size their first FC layer from H, W."""
    if arch in BUILDERS:
        sized = {"image_hw": tuple(image_shape[1:])} if arch in MIN_SIDE and len(image_shape) == 3 else {}
        return BUILDERS[arch](image_shape[0], FEATURE_DIM[arch], **sized), FEATURE_DIM[arch]
    # Only here: a served built-in model imports nothing it does not need (tests/test_export.py).
    from ..config.plugins import import_object, load_plugin

    factory = (import_object(arch, "model.arch") if is_import_path(arch)
               else load_plugin(MODEL_PLUGINS, arch, "model.arch", "arch"))
    shape = tuple(int(n) for n in image_shape)
    try:
        body = factory(shape)
    except Exception as e:  # the user's code: any failure is reported with its origin
        raise ConfigError(f"model.arch: {arch}({shape}) failed: {type(e).__name__}: {e}") from e
    if not isinstance(body, nn.Module):
        raise ConfigError(f"model.arch: {arch}({shape}) returned a {type(body).__name__}, not a torch nn.Module")
    return body, _feature_dim(body, arch, shape)


def check_arch(arch: str, image_shape: tuple[int, int, int]) -> int:
    """Build ``arch``'s feature extractor and pass one dummy batch of ``image_shape`` images through it; d, or a
    ConfigError naming model.arch and what failed (a built-in too small a size for it, a factory's error)."""
    with torch.random.fork_rng(devices=[]):  # a check: the global random state stays as it was
        body, d = feature_extractor(arch, image_shape)
    if _feature_dim(body, arch, tuple(image_shape)) != d:
        raise ConfigError(f"model.arch: {arch} gives features of another size than its {d}")
    return d


def _feature_dim(body: nn.Module, arch: str, shape: tuple[int, ...]) -> int:
    """d from a batch of two zero images, in eval mode so that no batch-norm statistic moves."""
    was_training = body.training
    body.eval()
    try:
        with torch.no_grad():
            out = body(torch.zeros(2, *shape))
    except Exception as e:
        raise ConfigError(f"model.arch: the module {arch} built fails on a 2 x {' x '.join(map(str, shape))} "
                          f"batch: {type(e).__name__}: {e}") from e
    finally:
        body.train(was_training)
    if not isinstance(out, torch.Tensor) or out.ndim != 2 or out.shape[0] != 2 or out.shape[1] < 1:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(f"model.arch: the module {arch} built maps a 2 x {' x '.join(map(str, shape))} batch "
                          f"to {got}, not 2 x d features (flatten its output, e.g. end it with nn.Flatten())")
    return int(out.shape[1])
