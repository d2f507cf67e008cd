"""The coordinator's dispatch policies, LargestFirst (pooled actors) and LongestQueueFirst (clients
pinned to actors), on hand-worked cases."""

from __future__ import annotations

import heapq

import pytest

from fedrod_ray.timing.scheduling import LargestFirst, LongestQueueFirst


def policy(max_in_flight=2):
    return LongestQueueFirst({0: ["a", "b", "c"], 1: ["d"], 2: ["e", "f"]}, max_in_flight)


def test_take_starts_the_longest_idle_queues_up_to_the_cap():
    """Queue lengths 3, 1, 2 and two slots: actor 0 (3) then actor 2 (2); nothing more until a release."""
    p = policy()
    assert p.pending == 6
    assert p.take() == [(0, "a"), (2, "e")]
    assert p.pending == 4
    assert p.take() == []  # both slots busy


def test_a_freed_slot_goes_to_the_longest_idle_queue_ties_to_the_first_queued():
    """After release(2) the idle actors are 1 ([d]) and 2 ([f]), one item each (0 is busy although its
    queue [b, c] is longest): the tie goes to actor 1, queued before actor 2."""
    p = policy()
    p.take()
    p.release(2)
    assert p.take() == [(1, "d")]
    assert p.take() == []
    # Now 0 frees: idle are 0 ([b, c], 2 items) and 2 ([f], 1 item) -> 0.
    p.release(0)
    assert p.take() == [(0, "b")]
    assert p.pending == 2


def test_ties_follow_the_order_the_actors_were_queued_in():
    """Equal queue lengths: the first key of the queues mapping wins, whatever its id."""
    p = LongestQueueFirst({5: ["x", "y"], 3: ["u", "v"], 9: ["w", "z"]}, 1)
    assert p.take() == [(5, "x")]
    p.release(5)  # now 3 and 9 have 2 items, 5 has 1
    assert p.take() == [(3, "u")]
    p.release(3)  # 5: 1, 3: 1, 9: 2
    assert p.take() == [(9, "w")]


def test_one_call_per_actor_and_empty_queues_ignored():
    """More slots than actors: each actor with work gets exactly one call; an empty queue gets none."""
    p = LongestQueueFirst({0: ["a", "b"], 1: [], 2: ["c"]}, 5)
    assert p.take() == [(0, "a"), (2, "c")]
    assert p.take() == []  # 0 still has b but is busy
    p.release(1)  # releasing an actor that holds no call changes nothing
    assert p.take() == []
    p.release(2)  # 2 is idle but has nothing left
    assert p.take() == []
    p.release(0)
    assert p.take() == [(0, "b")]
    assert p.pending == 0


def test_drop_returns_the_rest_of_the_queue_and_the_actor_gets_no_more_work():
    """drop(0) while 0 is busy with a: [b, c] come back, and a released 0 is never started again."""
    p = policy()
    p.take()
    assert p.drop(0) == ["b", "c"]
    assert p.pending == 2
    assert p.drop(0) == []
    assert p.drop(7) == []  # an actor that never had work
    p.release(0)
    p.release(2)
    assert p.take() == [(1, "d"), (2, "f")]
    assert p.pending == 0


@pytest.mark.parametrize("cap", [0, -1])
def test_max_in_flight_below_one_is_refused(cap):
    """With no slot nothing could ever run: a ValueError at construction."""
    with pytest.raises(ValueError, match="max_in_flight"):
        LongestQueueFirst({0: ["a"]}, cap)


def replay(queues, durations, max_in_flight):
    return replay_policy(LongestQueueFirst(queues, max_in_flight), durations)


def replay_policy(p, durations):
    """Run a policy against a simulated clock: (launches as (time, actor, item), makespan)."""
    events, launches, seq = [], [], 0

    def launch(now):
        nonlocal seq
        for actor, item in p.take():
            launches.append((now, actor, item))
            heapq.heappush(events, (now + durations[item], seq, actor))
            seq += 1

    launch(0)
    now = 0
    while events:
        now, _, actor = heapq.heappop(events)
        p.release(actor)
        launch(now)
    assert p.pending == 0
    return launches, now


def test_replay_of_a_round_gives_the_hand_computed_makespan():
    """Durations a3 b1 c2 d6 e2 f2, two slots. By hand:
    t=0: 0 (3 items) -> a until 3; then 2 (2) beats 1 (1) -> e until 2.
    t=2: e done; idle 1 [d] and 2 [f] tie at 1 -> 1 (queued first): d until 8.
    t=3: a done; 0 [b, c] (2) beats 2 [f] (1) -> b until 4.
    t=4: b done; 0 [c] and 2 [f] tie -> 0: c until 6.
    t=6: c done; only 2 has work -> f until 8.   Makespan 8.
    Ties to the last-queued actor would start f at 2 and d only at 4 (when f and b end), ending at 10."""
    queues = {0: ["a", "b", "c"], 1: ["d"], 2: ["e", "f"]}
    durations = {"a": 3, "b": 1, "c": 2, "d": 6, "e": 2, "f": 2}
    launches, makespan = replay(queues, durations, 2)
    assert launches == [(0, 0, "a"), (0, 2, "e"), (2, 1, "d"), (3, 0, "b"), (4, 0, "c"), (6, 2, "f")]
    assert makespan == 8


def test_replay_with_one_slot_runs_everything_back_to_back():
    """One slot: calls run back to back, so the makespan is the total work 3+1+2+6+2+2 = 16, and the
    order is the policy's alone (each launch goes to the longest queue, ties to the first queued)."""
    queues = {0: ["a", "b", "c"], 1: ["d"], 2: ["e", "f"]}
    durations = {"a": 3, "b": 1, "c": 2, "d": 6, "e": 2, "f": 2}
    launches, makespan = replay(queues, durations, 1)
    # lengths (0, 1, 2) before each launch:  (3,1,2) -> a;  (2,1,2) tie 0/2 -> b;  (1,1,2) -> e;
    # (1,1,1) tie -> c;  (0,1,1) tie 1/2 -> d;  (0,0,1) -> f.   Start times 0, 3, 4, 6, 8, 14.
    assert launches == [(0, 0, "a"), (3, 0, "b"), (4, 2, "e"), (6, 0, "c"), (8, 1, "d"), (14, 2, "f")]
    assert makespan == 16


# --- LargestFirst -----------------------------------------------------------------------------------


def test_largest_first_hands_the_largest_items_to_the_idle_actors_ties_in_order():
    p = LargestFirst(["b", "e", "c", "d", "a", "f"], [1, 2, 3, 4, 5, 2], actors=[0, 1])
    assert p.pending == 6
    assert p.take() == [(0, "a"), (1, "d")]
    assert p.take() == []  # both actors busy
    p.release(1)
    assert p.take() == [(1, "c")]
    p.release(0)
    p.release(1)
    assert p.take() == [(0, "e"), (1, "f")]  # sizes 2 and 2: the order they were given in


def test_largest_first_replay_beats_the_sampled_order():
    """Durations = sizes, two actors. Largest first: t0 a(5) on 0, d(4) on 1; t4 c(3) on 1 until 7;
    t5 e(2) on 0 until 7; t7 b(1) until 8. Makespan 8 (the work is 15: 7.5 at best). In the sampled
    order b, e, c, d, a the 5 would start last, at 4, and end at 9."""
    durations = {"a": 5, "b": 1, "c": 3, "d": 4, "e": 2}
    items = ["b", "e", "c", "d", "a"]
    launches, makespan = replay_policy(LargestFirst(items, [durations[i] for i in items], [0, 1]), durations)
    assert launches == [(0, 0, "a"), (0, 1, "d"), (4, 1, "c"), (5, 0, "e"), (7, 1, "b")]
    assert makespan == 8
    _, in_order = replay_policy(LargestFirst(items, [5, 4, 3, 2, 1], [0, 1]), durations)
    assert in_order == 9


def test_largest_first_requeue_and_drop():
    p = LargestFirst(["x", "y", "z"], [3, 2, 1], actors=[0, 1])
    assert p.take() == [(0, "x"), (1, "y")]
    # Actor 1 restarted bare: y never ran and goes first again, to whichever actor is free.
    p.requeue(1, "y")
    p.release(1)
    assert p.take() == [(1, "y")]
    # Actor 0 is gone for good: nothing is pinned to it, actor 1 takes the rest.
    assert p.drop(0) == []
    p.release(0)
    assert p.take() == []  # a dropped actor never becomes idle again
    p.release(1)
    assert p.take() == [(1, "z")]
    # The last actor gone: what is left cannot run anywhere and comes back.
    p.requeue(1, "z")
    assert p.drop(1) == ["z"] and p.pending == 0
