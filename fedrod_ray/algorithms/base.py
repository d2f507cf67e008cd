"""The seam for generic-FL rules: how theta and psi are optimised on a client and combined by the server.

A rule (docs/method.md, "Generic-FL rules") changes step 2's optimisation of w = (theta, psi)
under the balanced loss and step 4's aggregation, and may keep state on the clients and on the
server. The personalized part (phi_m, or nu for the hyper head) is never the rule's business: it is
trained by its own loss and, for nu, averaged by sample count whatever the rule.

A round, as the server's round loop drives it (Flower's configure -> train -> aggregate):

1. ``broadcast(server_state)``: what every client receives besides the global weights;
2. on each client, ``start_local(anchor, client_state, broadcast)`` returns a ``LocalCorrection``
   (or None for plain SGD): its ``apply`` adds the rule's term to the gradients of w after every
   backward pass, and its ``finish`` gives the client's new state and what it uploads to the server;
3. the server averages the clients' w with ``aggregation_weight(num_samples)`` and their uploads
   unweighted, both folded in the round's client order, then ``server_update`` gives the new global
   w and server state.

Rule state is a flat ``StateDict`` whose keys the rule chooses; an empty dict means "all zeros",
so a client that never trained costs nothing. Every tensor a rule sees is already on the training
device, and everything it returns is moved back to the CPU by the caller.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..server_math.aggregate import StateDict
from ..specs.rules import NoParams


class LocalCorrection:
    """One client update's use of a rule: a gradient term per step, and the state it leaves behind."""

    def apply(self, params: dict[str, torch.Tensor]) -> None:
        """Add the rule's term to the gradients, after every backward pass of the local update.

        Args:
            params: the generic parameters (theta, psi) by name; add to each ``p.grad`` in place (the caller
                runs this under ``torch.no_grad``).
        """

    def finish(self, local: StateDict, step_sum: float) -> tuple[StateDict, StateDict]:
        """What the update leaves behind, once the local epochs are done.

        Args:
            local: the client's trained w = (theta, psi).
            step_sum: how far the local optimiser moved w per unit of a constant gradient: K * lr for K steps
                of plain SGD, more with momentum (``local.effective_step_sum``).

        Returns:
            (the client's new rule state, what it uploads to the server besides w); both empty by default.
        """
        return {}, {}


class GenericRule:
    """Base class: plain FedAvg behaviour for every hook. Subclasses override what they change."""

    name: ClassVar[str] = ""
    Params: ClassVar[type] = NoParams
    # True: a client starts its update from its own last local model (when it has one) instead of the
    # global weights, so its calls carry that model (``ClientState.for_training(keep_local_model=True)``).
    starts_from_local_model: ClassVar[bool] = False

    def __init__(self, params=None):
        self.params = params if params is not None else self.Params()

    # --- server ---------------------------------------------------------------------------------

    def init_server_state(self, generic: StateDict) -> StateDict:
        """The server's state before the first round.

        Args:
            generic: the initial global w = (theta, psi).

        Returns:
            The rule's server state (empty: none, or all zeros).
        """
        return {}

    def broadcast(self, server_state: StateDict) -> StateDict:
        """What every sampled client receives this round besides the global weights (SCAFFOLD: c).

        Args:
            server_state: the rule's server state.

        Returns:
            The broadcast, handed to each client's ``start_local``.
        """
        return {}

    def aggregation_weight(self, num_samples: int) -> float:
        """A participant's weight in the round's average of w.

        Args:
            num_samples: the client's number of training examples, |D_m|.

        Returns:
            Its weight: |D_m| for FedAvg's sample-weighted mean, 1 for a plain mean (FedDyn).
        """
        return float(num_samples)

    def server_update(self, previous: StateDict, averaged: StateDict, uploads: StateDict,
                      num_participants: int, num_clients: int,
                      server_state: StateDict) -> tuple[StateDict, StateDict]:
        """The new global w and server state after a round.

        Args:
            previous: the global w sent this round.
            averaged: the participants' w, averaged with ``aggregation_weight``.
            uploads: the participants' uploads (from ``LocalCorrection.finish``), averaged unweighted.
            num_participants: |P|, the clients whose update this round counts.
            num_clients: M, every training client.
            server_state: the rule's server state.

        Returns:
            (the new global w, the new server state); FedAvg's is (averaged, server_state).
        """
        return averaged, server_state

    # --- client ---------------------------------------------------------------------------------

    def start_local(self, anchor: StateDict, client_state: StateDict,
                    broadcast: StateDict) -> LocalCorrection | None:
        """How one client's local update uses the rule.

        Args:
            anchor: the global w this round, on the training device (not to be modified).
            client_state: the client's rule state (empty: it never trained, all zeros).
            broadcast: what ``broadcast`` gave this round.

        Returns:
            The correction to apply at every step and finish with, or None for plain SGD.
        """
        return None


def zeros_like_missing(state: StateDict, like: StateDict) -> StateDict:
    """``state`` with a zero tensor for every key of ``like`` it lacks (rule state starts at zero)."""
    return {k: state[k] if k in state else torch.zeros_like(v) for k, v in like.items()}
