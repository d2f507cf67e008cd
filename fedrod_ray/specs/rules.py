"""Generic-FL rules (``train.generic_rule``, ``fedrod_ray.algorithms``): each one's hyperparameters
(``train.rule_params``) and what it rules out."""

from __future__ import annotations

import dataclasses

from pydantic.dataclasses import dataclass

from ..config.values import CLOSED, NonNegativeFloat, PositiveFloat


@dataclass(config=CLOSED)
class NoParams:
    """A rule without hyperparameters."""


@dataclass(config=CLOSED)
class FedProxParams:
    mu: NonNegativeFloat = 0.01  # the proximal term's weight


@dataclass(config=CLOSED)
class FedDynParams:
    alpha: PositiveFloat = 0.01  # the server step divides by alpha


@dataclasses.dataclass(frozen=True)
class RuleSpec:
    """A rule's ``Params`` (filled from ``train.rule_params``) and constraints.

    ``not_private``: why the rule cannot be used with client-level DP (empty: it can); ``momentum_from_zero``:
    its local correction assumes each local update's momentum starts at zero (no kept momentum buffers);
    ``not_buffered``: why it cannot run as FedBuff (``rounds.mode: fedbuff``, whose staleness-weighted step
    replaces the server's; empty: it can); ``server_model``: the server averages the clients' uploads into a model (local-only training does not)."""

    params: type = NoParams
    not_private: str = ""
    momentum_from_zero: bool = False
    not_buffered: str = ""
    server_model: bool = True


RULES: dict[str, RuleSpec] = {
    "fedavg": RuleSpec(),
    "fedprox": RuleSpec(FedProxParams),
    "feddyn": RuleSpec(FedDynParams, not_buffered="its server step corrects the average by a state h that "
                                                  "FedBuff's step would leave behind"),
    # Option II reads c_m from how far the K steps moved w, per unit of gradient, from buffers at zero
    # (local.effective_step_sum): a kept buffer moves w along earlier rounds' gradients as well.
    "scaffold": RuleSpec(not_private="its clients upload control-variate increments besides their update, which "
                                     "the clip does not bound, and a client's c_m would drift from a noised "
                                     "server c", momentum_from_zero=True,
                         not_buffered="its server control variate c is the mean of the round's increments, "
                                      "which stale arrivals from other models would corrupt"),
    "local": RuleSpec(not_private="local-only training sends nothing to the server, so there is nothing to protect",
                      not_buffered="local-only training has no server model to update", server_model=False),
}
