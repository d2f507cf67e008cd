"""The coordinator's dispatch policy as a pure, clock-free state machine (used by the Ray executor and
replayed by ``bench/round_overhead.py`` on measured update times).

Clients are pinned to actors and an actor trains one client at a time. At most ``max_in_flight``
calls run at once (the cluster's training slots); a free slot goes to the idle actor with the longest
queue, since the round ends when the busiest actor does. Ties go to the actor queued first.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class LongestQueueFirst(Generic[T]):
    def __init__(self, queues: dict[int, list[T]], max_in_flight: int):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.queues = {a: deque(q) for a, q in queues.items() if q}
        self.max_in_flight = max_in_flight
        self.busy: set[int] = set()

    def take(self) -> list[tuple[int, T]]:
        """Start as much work as the policy allows now: (actor, item) pairs, in launch order."""
        started = []
        while len(self.busy) < self.max_in_flight:
            idle = [a for a, q in self.queues.items() if q and a not in self.busy]
            if not idle:
                break
            a = max(idle, key=lambda k: len(self.queues[k]))
            started.append((a, self.queues[a].popleft()))
            self.busy.add(a)
        return started

    def release(self, actor: int) -> None:
        """``actor`` finished its call (or lost it)."""
        self.busy.discard(actor)

    def drop(self, actor: int) -> list[T]:
        """Withdraw the work still queued for ``actor`` (it is gone for good)."""
        return list(self.queues.pop(actor, ()))

    @property
    def pending(self) -> int:
        return sum(len(q) for q in self.queues.values())
