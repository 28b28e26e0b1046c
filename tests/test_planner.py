"""The planner and the policies that read it: pure code, a virtual clock, no daemon."""

from __future__ import annotations

import math

import pytest

from cached import config_checks
from cached.planner import DEFAULT_RATE, NOTIFY_INTERVAL_S, Planner
from cached.policy import POLICIES, BeladyPolicy, make_policy


class Clock:
    """Virtual seconds, moved by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_next_use_is_the_distance_to_the_next_read_over_the_read_rate() -> None:
    clock = Clock()
    p = Planner(clock=clock)
    p.update("a", ["u0", "u1", "u2", "u3", "u1"])
    # No rate observed yet: the default rate, in shards per second.
    assert p.next_use("u2") == pytest.approx(2 / DEFAULT_RATE)
    assert p.next_use("u0") == 0.0  # being read
    assert p.next_use("nowhere") == math.inf
    clock.now = 1.0
    p.advance("a", 2)  # two shards in one second
    assert p.next_use("u3") == pytest.approx(0.5)
    # u1 was read (position 1) and comes back at position 4.
    assert p.next_use("u1") == pytest.approx(1.0)
    assert p.next_use("u0") == math.inf  # behind the cursor, not read again


def test_a_faster_stream_needs_its_shards_sooner() -> None:
    clock = Clock()
    p = Planner(clock=clock)
    p.update("slow", ["s0", "s1", "s2", "s3"])
    p.update("fast", ["f0", "f1", "f2", "f3", "f4", "f5", "f6", "f7"])
    clock.now = 4.0
    p.advance("slow", 1)  # 0.25 shard/s
    p.advance("fast", 4)  # 1 shard/s
    order = [url for _, url in p.upcoming()]
    # Both cursors' shards are needed now; then fast's other 3 (1..3 s) come before
    # slow's next one (4 s).
    assert set(order[:2]) == {"s1", "f4"}
    assert order[2:] == ["f5", "f6", "f7", "s2", "s3"]


def test_upcoming_names_each_shard_once_at_its_earliest_need() -> None:
    p = Planner(clock=Clock())
    p.update("a", ["x", "y", "z"])
    p.update("b", ["z", "x"])
    got = list(p.upcoming())
    assert [url for _, url in got] == ["x", "z", "y"]
    assert [when for when, _ in got] == sorted(when for when, _ in got)


def test_a_replaced_plan_keeps_its_rate_and_a_quiet_one_expires() -> None:
    clock = Clock()
    p = Planner(timeout_s=10, clock=clock)
    p.update("a", ["u0", "u1", "u2"])
    clock.now = 2.0
    p.advance("a", 2)
    p.update("a", ["v0", "v1"])  # the next epoch
    assert p.plans()[0].rate == pytest.approx(1.0)
    p.update("b", ["w"])
    clock.now = 11.0
    p.advance("b", 0)  # a read where it already is: alive, not moved
    clock.now = 13.0
    assert p.expire() == 1  # "a" was quiet since 2.0; "b" spoke at 11.0
    assert [plan.key for plan in p.plans()] == ["b"]


def test_listeners_hear_every_change() -> None:
    clock = Clock()
    p = Planner(timeout_s=10, clock=clock)
    heard: list[int] = []
    p.on_change(lambda: heard.append(p.version))
    p.update("a", ["u", "v"])
    clock.now = 1.0
    assert p.advance("a", 1) is None  # told at once
    assert p.advance("a", 1) is None  # no move: no change
    clock.now = 20.0
    p.expire()
    assert heard == [1, 2, 3]


def test_cursor_moves_are_told_at_most_every_interval_and_none_is_lost() -> None:
    # The prefetcher walks its whole window at each notice: a fast local reader's every
    # shard was one walk (D30). Moves in between are told once, when the caller flushes.
    clock = Clock()
    p = Planner(clock=clock)
    heard: list[int] = []
    p.on_change(lambda: heard.append(p.plans()[0].cursor))
    p.update("a", [f"u{i}" for i in range(10)])
    clock.now = 0.01
    wait = p.advance("a", 1)
    assert wait == pytest.approx(NOTIFY_INTERVAL_S - 0.01)
    assert p.advance("a", 2) is not None
    assert heard == [0]  # the plan's install only
    assert p.version == 3  # the state moved: eviction's order sees it at once
    clock.now = NOTIFY_INTERVAL_S
    p.flush()
    p.flush()  # nothing left untold
    assert heard == [0, 2]
    clock.now = 1.0
    assert p.advance("a", 3) is None  # a quiet interval since: told at once
    assert heard == [0, 2, 3]


def test_belady_evicts_unplanned_first_then_the_furthest_needed() -> None:
    clock = Clock()
    planner = Planner(clock=clock)
    policy = make_policy("belady", planner)
    assert isinstance(policy, BeladyPolicy)
    for sid, url in [("A", "a"), ("B", "b"), ("C", "c"), ("D", "d"), ("E", "e")]:
        policy.on_insert(sid, url)
    planner.update("s", ["c", "a", "x", "b"])
    policy.on_access("D")  # D and E are unplanned; E is the least recently used now
    assert list(policy.victims()) == ["E", "D", "B", "A", "C"]
    # Admission: a prefetch of "x" (needed at position 2) may displace b (3) and the
    # unplanned ones, not a (1) or c (0).
    assert [v for v in "ABCDE" if policy.admits("x", v)] == ["B", "D", "E"]


def test_lru_ignores_plans_and_admits_everything() -> None:
    planner = Planner(clock=Clock())
    policy = make_policy("lru", planner)
    for sid in "ABC":
        policy.on_insert(sid, sid.lower())
    policy.on_access("A")
    planner.update("s", ["b"])
    assert list(policy.victims()) == ["B", "C", "A"]
    assert all(policy.admits("c", v) for v in "ABC")


def test_the_config_accepts_exactly_the_registered_policies() -> None:
    assert set(config_checks._POLICIES) == set(POLICIES)
    with pytest.raises(KeyError, match="known: belady, lru"):
        make_policy("fifo")
