"""FedProx (Li et al., 2020): local objective l_BR(w) + (mu/2)||w - w_bar||^2; FedAvg on the server."""

from __future__ import annotations

import torch

from ..server_math.aggregate import StateDict
from ..specs.rules import FedProxParams
from .base import GenericRule, LocalCorrection
from .registry import register


class _Proximal(LocalCorrection):
    def __init__(self, mu: float, anchor: StateDict):
        self.mu, self.anchor = mu, anchor

    def apply(self, params: dict[str, torch.Tensor]) -> None:
        for k, w_bar in self.anchor.items():
            p = params[k]
            p.grad.add_(p - w_bar, alpha=self.mu)  # d/dw of mu/2 ||w - w_bar||^2


@register
class FedProx(GenericRule):
    name = "fedprox"
    Params = FedProxParams

    def start_local(self, anchor, client_state, broadcast):
        return _Proximal(self.params.mu, anchor)
