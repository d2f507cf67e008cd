"""LG-FedAvg (Liang et al., 2020): the lower layers (the feature extractor's convolutions) are personal, the
fully connected layers (the extractor's last one and the head) shared.

The client trains all of its model for E epochs of SGD on cross-entropy and returns the fully connected
layers, which the server averages by sample count. The PM is the client's model after its last update; the
GM is the mean of the PMs. (The paper starts LG-FedAvg from a FedAvg model; here all clients start from the
same initial weights.) The PM has no global reading: its layers are the client's own below the shared ones.
"""

from __future__ import annotations

from torch import nn

from ..models import BODY
from .fedper import SplitModel
from .registry import register


def lower_layer_keys(model) -> list[str]:
    """The feature extractor's parameters that come before its last fully connected layer."""
    linears = [name for name, m in model.body.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError("lg_fedavg shares the feature extractor's last fully connected layer, and this "
                         "model.arch has none")
    last = f"{BODY}{linears[-1]}."
    keys = [k for k in model.state_dict() if k.startswith(BODY)]
    return keys[:next(i for i, k in enumerate(keys) if k.startswith(last))]


@register
class LGFedAvg(SplitModel):
    name = "lg_fedavg"
    global_reading = None

    def personal_keys(self, model):
        return lower_layer_keys(model)
