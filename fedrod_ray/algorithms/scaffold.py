"""SCAFFOLD (Karimireddy et al., 2020), option II, acting on w = (theta, psi) under the balanced loss.

The server keeps a control variate c and client m keeps c_m (all start at 0). Every local step uses
the gradient g(w) - c_m + c. After K local steps at learning rate eta, the client sets
c_m+ = c_m - c + (w_bar - w_m) / (K eta), keeps it, and uploads delta_m = c_m+ - c_m with w_m. The
server takes the usual sample-weighted average of the w_m and sets c <- c + (1/M) sum_{m in P} delta_m.

(w_bar - w_m) / (K eta) is option II's estimate of the mean corrected gradient, exact for plain SGD.
With heavy-ball momentum beta (the paper's schedule: 0.9) the same K steps move w further, up to
1/(1 - beta) times, and the estimate would be that much too large. So K eta is replaced by how far
the optimiser moves w per unit of a constant gradient, eta * sum_{s<K} (1 - beta^(K-s)) / (1 - beta)
(``local.effective_step_sum``), which is K eta at beta = 0 and keeps the estimate exact for a
constant gradient under momentum too.
"""

from __future__ import annotations

import torch

from ..server_math.aggregate import StateDict
from .base import GenericRule, LocalCorrection, zeros_like_missing
from .registry import register


class _ControlVariates(LocalCorrection):
    def __init__(self, anchor: StateDict, c_m: StateDict, c: StateDict):
        self.anchor, self.c_m, self.c = anchor, c_m, c
        # The per-step term is the same for every step: computed once.
        self.offset = {k: c[k] - c_m[k] for k in anchor}

    def apply(self, params: dict[str, torch.Tensor]) -> None:
        for k, off in self.offset.items():
            params[k].grad.add_(off)

    def finish(self, local: StateDict, step_sum: float) -> tuple[StateDict, StateDict]:
        new = {k: self.c_m[k] - self.c[k] + (w_bar - local[k]) / step_sum for k, w_bar in self.anchor.items()}
        return new, {k: new[k] - self.c_m[k] for k in new}


@register
class Scaffold(GenericRule):
    name = "scaffold"

    def init_server_state(self, generic: StateDict) -> StateDict:
        return {k: torch.zeros_like(v) for k, v in generic.items()}

    def broadcast(self, server_state: StateDict) -> StateDict:
        return server_state

    def server_update(self, previous, averaged, uploads, num_participants, num_clients, server_state):
        c = {k: v + (num_participants / num_clients) * uploads[k] for k, v in server_state.items()}
        return averaged, c

    def start_local(self, anchor, client_state, broadcast):
        return _ControlVariates(anchor, zeros_like_missing(client_state, anchor), zeros_like_missing(broadcast, anchor))
