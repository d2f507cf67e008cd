"""The executor protocol: how the round loop hands its client calls to whatever runs them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from ..client_update.local import LocalResult, RoundInput
from ..clients.client import ClientFailure, ClientState, ClientUnavailable, EvalCounts
from ..server_math.aggregate import StateDict

Job = tuple[int, ClientState]  # a client id and the state its call starts from
# A client's result and new state, or its failure, or (at sites) that it could not be reached.
TrainOutcome = tuple[LocalResult, ClientState] | ClientFailure | ClientUnavailable


class Executor(Protocol):
    def train(self, round_idx: int, jobs: list[Job], message: RoundInput) -> Iterator[tuple[int, TrainOutcome]]:
        """Yield (position in jobs, outcome) as each client finishes, in any order."""

    def ask(self, round_idx: int, phase: str, common: StateDict,
            questions: dict[int, StateDict]) -> dict[int, StateDict | ClientFailure]:
        """Each client's answer (``ClientHost.answer``) to ``common`` and its own question, by client id: a
        call that reads no client state, so one lost with its actor is sent again."""

    def evaluate(self, jobs: list[Job], estimate: bool = False) -> EvalCounts:
        """PM test counts of clients that have trained (``ClientHost.evaluate``; ``estimate``: on the
        estimate's sample)."""

    def finetune(self, jobs: list[Job], message: RoundInput, epochs: int, round_idx: int) -> EvalCounts:
        """PM test counts after the method's adaptation (fine-tuning) from ``message`` (``ClientHost.finetune``)."""

    def zero_shot(self, jobs: list[Job], message: RoundInput, round_idx: int) -> EvalCounts:
        """Test counts of the zero-shot models of clients that never trained (``ClientHost.zero_shot``)."""

    def cancel(self) -> None:
        """Make the evaluation calls in flight in another thread of this process end soon (they raise); the
        executor is not used again. Called when the thread that waits on them is stopped (Ctrl-C)."""

    def close(self) -> None: ...
