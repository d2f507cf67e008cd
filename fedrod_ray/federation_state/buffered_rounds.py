"""FedBuff's event queue on the virtual clock (``rounds.mode: fedbuff``, docs/rounds.md): the clients in flight,
the send-outs that keep ``concurrency`` of them busy, and the arrivals in virtual-time order up to the next
server step. The server step itself is the federation's (``buffered.buffered_update``).

The real computation runs whenever convenient: a client is trained against the model it was sent, but
lazily, all the untrained clients at once (one executor call, as parallel as the executor is), when the
first of them arrives or before the model they were sent changes. Every untrained client in flight was
therefore sent the current model, and a snapshot needs no older one.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..server_math.buffered import next_arrival, pick_client
from .state import Arrival


class BufferedRounds:
    """The clients in flight and the send-outs so far; ``step`` runs the queue up to the next full buffer.

    ``train(version, pending)`` returns the untrained arrivals ``pending`` trained against model ``version``
    (the current one); ``arrive(version, arrival, failed)`` is called as each one arrives, in virtual-time
    order, with the failures of this step so far: it commits the client's state, or checks the failures."""

    def __init__(self, seed: int, durations: np.ndarray, concurrency: int, buffer_size: int,
                 train: Callable[[int, list[Arrival]], list[Arrival]],
                 arrive: Callable[[int, Arrival, list[Arrival]], None]):
        self.seed, self.durations = seed, durations
        self.concurrency, self.buffer_size = concurrency, buffer_size
        self.train, self.arrive = train, arrive
        self.in_flight: list[Arrival] = []  # in send-out order
        self.dispatches = 0

    def restore(self, dispatches: int, in_flight: list[Arrival]) -> None:
        self.dispatches, self.in_flight = dispatches, list(in_flight)

    def step(self, version: int, now: float) -> tuple[list[Arrival], list[Arrival], float]:
        """Process arrivals from virtual time ``now`` until ``buffer_size`` updates are in; each one that arrives
        first frees its slot for a new client, sent the current model (version ``version``), except the last,
        whose replacement the caller sends after the server step (``dispatch``). Returns the buffered updates
        and the failures, in arrival order, and the time the buffer filled."""
        if self.dispatches == 0:
            for _ in range(self.concurrency):
                self.dispatch(version, now)
        buffer: list[Arrival] = []
        failed: list[Arrival] = []
        while len(buffer) < self.buffer_size:
            i = next_arrival([(a.arrives, a.dispatch) for a in self.in_flight])
            if not self.in_flight[i].trained:
                self._train_pending(version)
            arrival = self.in_flight.pop(i)
            now = arrival.arrives
            (failed if arrival.error is not None else buffer).append(arrival)
            self.arrive(version, arrival, failed)
            if len(buffer) < self.buffer_size:
                self.dispatch(version, now)
        self._train_pending(version)  # before the model they were sent changes
        return buffer, failed, now

    def dispatch(self, version: int, now: float) -> None:
        """Send model ``version`` to an idle client, picked by the seed and the send-out's number."""
        busy = {a.client_id for a in self.in_flight}
        idle = [c for c in range(len(self.durations)) if c not in busy]
        cid = pick_client(self.seed, self.dispatches, idle)
        self.in_flight.append(Arrival(cid, self.dispatches, version, now + float(self.durations[cid])))
        self.dispatches += 1

    def _train_pending(self, version: int) -> None:
        pending = [i for i, a in enumerate(self.in_flight) if not a.trained]
        if not pending:
            return
        trained = self.train(version, [self.in_flight[i] for i in pending])
        for i, arrival in zip(pending, trained, strict=True):
            self.in_flight[i] = arrival
