"""A round's server step from sums over its participants: what the rule (and client-level DP) make of them.

The round loop folds each client's result into ``RoundSums`` in the round's client order (``Federation``); a
secure aggregation (Flower's SecAgg+, ``fedrod_ray_flower.secure``) hands over the same sums without any one
client's result. Either way ``shared_update`` turns them into the new shared weights and the rule's and DP's
server state, so the math is written once.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..algorithms import GenericRule
from ..federation_state.dp_rounds import ClientLevelDP
from ..server_math.aggregate import StateDict, WeightedSum


@dataclass
class RoundSums:
    """The round's sums over its participants: without client-level DP, theta and psi under the rule's
    ``aggregation_weight`` (``generic``), the other shared weights (the hyper head's nu) by sample count
    (``rest``) and the rule's uploads unweighted (``uploads``); with it, every shared weight unweighted
    (``clipped``, each participant's anchor + clip(Delta)) and how many updates were within the clip norm
    (``unclipped``). The sums a mode does not use are empty."""

    generic: WeightedSum
    rest: WeightedSum
    uploads: WeightedSum
    clipped: WeightedSum
    unclipped: int = 0


@dataclass
class SharedUpdate:
    """The round's new shared weights (before the method's server step) and the rule's and DP's state."""

    weights: StateDict
    server_state: StateDict
    privacy_state: StateDict


def shared_update(sums: RoundSums, previous: StateDict, generic_keys: set[str], rule: GenericRule,
                  server_state: StateDict, num_clients: int, dp: ClientLevelDP | None, privacy_state: StateDict,
                  round_idx: int) -> SharedUpdate:
    """The new shared weights from the round's ``sums`` and the weights ``previous`` sent in round
    ``round_idx``: the rule's ``server_update`` on the means (with DP: on the noised mean of the clipped
    updates, ``ClientLevelDP.aggregate``, and the expected number of participants)."""

    def generic(state: StateDict) -> StateDict:
        return {k: v for k, v in state.items() if k in generic_keys}

    if dp is not None:
        # The rule's server step sees only the noised mean, and the expected number of participants.
        averaged, privacy_state = dp.aggregate(sums.clipped.total, sums.clipped.count, sums.unclipped, previous,
                                               privacy_state, round_idx)
        new_generic, server_state = rule.server_update(generic(previous), generic(averaged), {}, dp.expected,
                                                       num_clients, server_state)
    else:
        new_generic, server_state = rule.server_update(generic(previous), sums.generic.mean(), sums.uploads.mean(),
                                                       sums.generic.count, num_clients, server_state)
        averaged = sums.rest.mean()
    return SharedUpdate({**averaged, **new_generic}, server_state, privacy_state)
