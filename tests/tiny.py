"""Tiny client data and models shared by the unit tests of the local update and the rules."""

from __future__ import annotations

import torch

from fedrod_ray.client_update.local import ClientData
from fedrod_ray.models import build_model

SHAPE = (1, 28, 28)
MEAN, STD = (0.5,), (0.5,)
N = 24
# A skewed label distribution, with some classes absent.
LABELS = (0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 3, 5, 5, 5, 5, 5, 7, 9)


def make_data(seed: int = 0, n: int = N) -> ClientData:
    """n random 28x28 images, labelled by LABELS (repeated as needed) in a seeded random order."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, *SHAPE), generator=g, dtype=torch.uint8)
    labels = torch.tensor(LABELS)
    y = labels.repeat((n + len(labels) - 1) // len(labels))[:n]
    y = y[torch.randperm(n, generator=g)]
    return ClientData(x=x, y=y, counts=torch.bincount(y, minlength=10))


def model_and_global(variant, seed=0):
    """A model and a copy of its shared weights (the 'global' ones a client starts from)."""
    # PyTorch's init, with which these tolerances were set: on random pixels He's larger weights make some
    # losses diverge, and the comparisons would measure float rounding of huge weights.
    model = build_model("mnist_cnn", 10, SHAPE, variant, 16, seed, init="pytorch")
    if variant == "hyper":
        # A non-zero hypernet output layer, so that the generated head (and its gradients) is non-zero.
        with torch.no_grad():
            model.hypernet.net[2].weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(3))
    state = model.state_dict()
    return model, {k: state[k].clone() for k in model.shared_keys()}
