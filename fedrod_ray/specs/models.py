"""Feature extractors (``model.arch``, ``fedrod_ray.models``) and initial weights (``model.init``)."""

from __future__ import annotations

ARCHS = ("mnist_cnn", "cifar_cnn", "resnet20")  # fedrod_ray.models.BUILDERS
# Entry-point group through which installed packages add feature extractors (fedrod_ray.config.plugins).
MODEL_PLUGINS = "fedrod_ray.models"
# model.init: "normal" is the paper's ("weights initialised from normal distributions"; it names no scale,
# so He's, N(0, 2 / fan_in), which keeps a ReLU network's activations at one scale); "pytorch" is PyTorch's
# default (Kaiming-uniform, a = sqrt(5)), what versions before 0.3 used.
INITS = ("normal", "pytorch")
# Extractors with buffers (batch-norm statistics), which the batched local update cannot stack.
BUFFERED_ARCHS = ("resnet20",)
