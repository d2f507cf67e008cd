"""The executor protocol: the whole contract between the round loop and a runtime.

``round_loop.Federation`` knows a runtime only through ``Executor``: it hands it the round's client calls
and reads back results, sums or counts. A runtime subclasses ``Executor`` and overrides what it does; the
defaults are what a runtime with nothing to do there needs (tests/test_layering.py fails if the loop calls
anything else). Two capabilities change what a round reads back:

- ``sums_only`` (secure aggregation): ``train_sums`` gives the round's ``RoundSums``, which the runtime
  could not open per client, instead of each client's result from ``train``;
- ``evaluates_at_clients``: P-FL is computed where the clients are and comes back as sums
  (``pfl_sums``), instead of per-client test counts from ``evaluate``, ``finetune`` and ``zero_shot``.

docs/extending.md ("Add a runtime") says which to implement and which tests a new runtime copies.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from ..client_update.local import LocalResult, RoundInput
from ..clients.client import ClientFailure, ClientState, ClientUnavailable, EvalCounts
from ..server_math.aggregate import StateDict
from ..server_math.distributed_dp import DistributedRound
from ..server_math.sums import Losses, RoundSums

Job = tuple[int, ClientState]  # a client id and the state its call starts from
# A client's result and new state, or its failure, or that it could not be reached (its site or node is away).
TrainOutcome = tuple[LocalResult, ClientState] | ClientFailure | ClientUnavailable


class RoundFailedError(RuntimeError):
    """Too many clients of a round failed for its average to be trusted, or the runtime could not complete
    the round's aggregation."""


class RoundSkipped(Exception):
    """A ``sums_only`` runtime declines a round it cannot sum without revealing less than its policy allows
    (its sampled clients sit on too few nodes): nothing of the round is applied, and its record says why."""


@dataclass(frozen=True)
class SumRequest:
    """What a ``sums_only`` runtime needs of the server to sum a round: which shared weights the rule weighs
    (``generic_keys``), the rule's upload of an update that did not move (its keys, shapes and dtypes),
    whether the sums are client-level DP's clipped ones, each client's sample count, and under the distributed
    DP mechanism (``privacy.mechanism``) what its participants need to noise their shares."""

    generic_keys: frozenset[str]
    upload: StateDict
    dp: bool
    sizes: tuple[int, ...]
    distributed: DistributedRound | None = None


@dataclass
class SummedRound:
    """A ``sums_only`` round as the runtime gives it back: the sums over its participants, their losses, who
    took part, and who failed (with their errors)."""

    sums: RoundSums
    losses: Losses
    done: list[int]
    failures: list[ClientFailure] = field(default_factory=list)


@dataclass
class PflSums:
    """P-FL computed where the clients are (``evaluates_at_clients``): {"pfl_*": (sum, clients)}, the clients
    whose PM could not be evaluated (id -> error), those that were away, and where it was computed (the
    record's ``pfl_at``)."""

    sums: dict[str, tuple[float, int]]
    failed: dict[int, str]
    unavailable: list[int]
    where: str


class Executor:
    """What a round needs from a runtime. Override ``train`` (or, ``sums_only``, ``train_sums``), ``ask`` if
    a method asks its clients questions, and one of the two evaluations; the rest defaults to nothing."""

    # Capabilities, fixed for the executor's life (a class's, or set in its __init__):
    sums_only: bool = False  # secure aggregation: train_sums, never one client's result
    evaluates_at_clients: bool = False  # P-FL comes back as sums (pfl_sums)
    clients_may_be_away: bool = False  # train may yield ClientUnavailable; the record counts them

    def train(self, round_idx: int, jobs: list[Job], message: RoundInput) -> Iterator[tuple[int, TrainOutcome]]:
        """Yield (position in jobs, outcome) as each client finishes, in any order."""
        raise NotImplementedError(f"{type(self).__name__} trains no client one by one (sums_only)")

    def train_sums(self, round_idx: int, jobs: list[Job], message: RoundInput, request: SumRequest) -> SummedRound:
        """The round's clients trained and summed where the server cannot open the sum per client; raises
        ``RoundSkipped`` for a round it declines."""
        raise NotImplementedError(f"{type(self).__name__} offers no secure aggregation")

    def ask(self, round_idx: int, phase: str, common: StateDict,
            questions: dict[int, StateDict]) -> dict[int, StateDict | ClientFailure]:
        """Each client's answer (``ClientHost.answer``) to ``common`` and its own question, by client id: a
        call that reads no client state, so one lost with its actor is sent again."""
        raise NotImplementedError(f"{type(self).__name__} answers no method's questions")

    def evaluate(self, jobs: list[Job], estimate: bool = False) -> EvalCounts:
        """PM test counts of clients that have trained (``ClientHost.evaluate``; ``estimate``: on the
        estimate's sample)."""
        raise NotImplementedError(f"{type(self).__name__} evaluates at the clients (pfl_sums)")

    def finetune(self, jobs: list[Job], message: RoundInput, epochs: int, round_idx: int) -> EvalCounts:
        """PM test counts after the method's adaptation (fine-tuning) from ``message`` (``ClientHost.finetune``)."""
        raise NotImplementedError(f"{type(self).__name__} does not fine-tune")

    def zero_shot(self, jobs: list[Job], message: RoundInput, round_idx: int) -> EvalCounts:
        """Test counts of the zero-shot models of clients that never trained (``ClientHost.zero_shot``)."""
        raise NotImplementedError(f"{type(self).__name__} has no clients that never trained")

    def pfl_sums(self, global_shared: StateDict, method_state: StateDict, rounds_done: int,
                 versions: dict[int, int]) -> PflSums:
        """P-FL of the clients whose committed state has ``versions`` (client -> rounds trained), summed where
        they are (``evaluates_at_clients``)."""
        raise NotImplementedError(f"{type(self).__name__} returns per-client counts (evaluate)")

    def kept_states(self, rounds: dict[int, int]) -> dict:
        """What a checkpoint records of the client states the runtime keeps itself, given the server's
        committed ``rounds`` (client -> rounds trained); nothing where the server holds them all."""
        return {}

    def restore(self, kept: dict, rounds: dict[int, int]) -> None:
        """Take a checkpoint's ``kept_states`` back after a restart, checking the runtime still holds them."""

    def cancel(self) -> None:
        """Make the evaluation calls in flight in another thread of this process end soon (they raise); the
        executor is not used again. Called when the thread that waits on them is stopped (Ctrl-C)."""

    def close(self) -> None:
        """Release the runtime's workers."""
