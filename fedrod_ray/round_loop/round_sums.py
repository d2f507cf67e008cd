"""A round's server step from sums over its participants (``server_math.sums.RoundSums``): what the rule (and
client-level DP) make of them, written once whether the loop summed the clients' results itself or a secure
aggregation (an executor that is ``sums_only``) handed over only the sums.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..algorithms import GenericRule
from ..federation_state.dp_rounds import ClientLevelDP
from ..server_math.aggregate import StateDict
from ..server_math.sums import RoundSums


@dataclass
class SharedUpdate:
    """The round's new shared weights (before the method's server step) and the rule's and DP's state."""

    weights: StateDict
    server_state: StateDict
    privacy_state: StateDict


# size: the server step's whole input: the sums, the rule and its state, and DP and its state
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
