"""The Ray executor's dispatch policies as pure, clock-free state machines (used by the Ray executor and
replayed by ``bench/round_overhead.py`` on measured update times).

An actor runs one call at a time, so the actors in the pool are the cluster's training slots.

- ``LargestFirst`` (the pooled layout): any actor takes any item; whichever actor is free takes the
  largest item left. A round ends when its last update does, so starting the longest ones first leaves
  the short ones to fill the gaps at the end.
- ``LongestQueueFirst`` (clients pinned to actors): at most ``max_in_flight`` calls at once; a free
  slot goes to the idle actor with the longest queue, since the round ends when the busiest actor does.

Both also take back an item whose call never started (``requeue``) and withdraw an actor that is gone
for good (``drop``), returning the items no one else can run.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class LargestFirst(Generic[T]):
    def __init__(self, items: list[T], sizes: list[float], actors: list[int]):
        order = sorted(range(len(items)), key=lambda i: -sizes[i])  # stable: equal sizes keep their order
        self.queue = deque(items[i] for i in order)
        self.idle = deque(actors)
        self.actors = set(actors)

    def take(self) -> list[tuple[int, T]]:
        """Start as much work as the policy allows now: (actor, item) pairs, in launch order."""
        started = []
        while self.queue and self.idle:
            started.append((self.idle.popleft(), self.queue.popleft()))
        return started

    def release(self, actor: int) -> None:
        """``actor`` finished its call (or lost it)."""
        if actor in self.actors:
            self.idle.append(actor)

    def requeue(self, actor: int, item: T) -> None:
        """``item``'s call on ``actor`` never ran: it goes first again."""
        self.queue.appendleft(item)

    def drop(self, actor: int) -> list[T]:
        self.actors.discard(actor)
        if actor in self.idle:
            self.idle.remove(actor)
        if self.actors:
            return []
        lost, self.queue = list(self.queue), deque()
        return lost

    @property
    def pending(self) -> int:
        return len(self.queue)


class LongestQueueFirst(Generic[T]):
    def __init__(self, queues: dict[int, list[T]], max_in_flight: int):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.queues = {a: deque(q) for a, q in queues.items() if q}
        self.max_in_flight = max_in_flight
        self.busy: set[int] = set()

    def take(self) -> list[tuple[int, T]]:
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
        self.busy.discard(actor)

    def requeue(self, actor: int, item: T) -> None:
        self.queues.setdefault(actor, deque()).appendleft(item)

    def drop(self, actor: int) -> list[T]:
        """Withdraw the work still queued for ``actor``."""
        return list(self.queues.pop(actor, ()))

    @property
    def pending(self) -> int:
        return sum(len(q) for q in self.queues.values())
