"""FedDyn (Acar et al., 2021), as docs/method.md ("Generic-FL rules") writes it and the authors' code runs it.

Client m keeps g_m (starts at 0) and minimises l_BR(w) - <g_m, w> + (alpha/2)||w - w_bar||^2, then
g_m <- g_m - alpha (w_m - w_bar). The server keeps h (starts at 0):
h <- h - alpha (1/M) sum_{m in P} (w_m - w_bar), and w_bar <- mean_{m in P} w_m - h / alpha, where the
mean over the participants is *plain*, not weighted by |D_m| (hence ``aggregation_weight`` = 1).
"""

from __future__ import annotations

import torch

from ..server_math.aggregate import StateDict
from ..specs.rules import FedDynParams
from .base import GenericRule, LocalCorrection, zeros_like_missing
from .registry import register


class _Dynamic(LocalCorrection):
    def __init__(self, alpha: float, anchor: StateDict, grad: StateDict):
        self.alpha, self.anchor, self.grad = alpha, anchor, grad

    def apply(self, params: dict[str, torch.Tensor]) -> None:
        for k, w_bar in self.anchor.items():
            p = params[k]
            # d/dw of -<g_m, w> + alpha/2 ||w - w_bar||^2
            p.grad.add_(p - w_bar, alpha=self.alpha).sub_(self.grad[k])

    def finish(self, local: StateDict, step_sum: float) -> tuple[StateDict, StateDict]:
        return {k: self.grad[k] - self.alpha * (local[k] - w_bar) for k, w_bar in self.anchor.items()}, {}


@register
class FedDyn(GenericRule):
    name = "feddyn"
    Params = FedDynParams

    def init_server_state(self, generic: StateDict) -> StateDict:
        return {k: torch.zeros_like(v) for k, v in generic.items()}

    def aggregation_weight(self, num_samples: int) -> float:
        return 1.0

    def server_update(self, previous, averaged, uploads, num_participants, num_clients, server_state):
        alpha = self.params.alpha
        h = {k: server_state[k] - alpha * (num_participants / num_clients) * (averaged[k] - previous[k])
             for k in averaged}
        return {k: averaged[k] - h[k] / alpha for k in averaged}, h

    def start_local(self, anchor, client_state, broadcast):
        return _Dynamic(self.params.alpha, anchor, zeros_like_missing(client_state, anchor))
