"""The planner and the eviction policies, where a mutation run (issue 21) found behaviour
that no test held: the read-rate estimate, index upkeep across replaced and dropped plans,
the questions the prefetcher asks, admission at equal need. Pure code, a virtual clock."""

from __future__ import annotations

import math

import pytest

from cached.planner import MIN_RATE_INTERVAL_S, NOTIFY_INTERVAL_S, RATE_ALPHA, Planner, prepare
from cached.policy import BeladyPolicy, EvictionPolicy, LRUPolicy, make_policy
from tests.test_planner import Clock


def test_a_plan_starts_at_its_cursor_and_keeps_its_job() -> None:
    plan = prepare("k", ["a", "b"])
    assert plan.cursor == 0 and plan.job == "" and plan.current() == "a"
    assert prepare("k", ["a", "b"], cursor=5).current() is None  # past the end
    p = Planner(clock=Clock())
    p.update("k", ["a", "b", "c"], cursor=2, job="train")
    p.update("j", ["z"])
    assert [plan.job for plan in p.plans()] == ["train", ""]
    assert p.next_use("c") == 0.0 and p.next_use("a") == math.inf


def test_the_rate_is_a_moving_average_of_the_observed_reads() -> None:
    clock = Clock()
    p = Planner(clock=clock)
    p.update("k", [f"u{i}" for i in range(100)])
    clock.now = 1.0
    p.advance("k", 4)  # the first observation is taken as it is
    plan = p.plans()[0]
    assert plan.rate == pytest.approx(4.0) and plan.cursor_at == 1.0
    clock.now = 2.0
    p.advance("k", 14)  # 10 shards in this second
    assert plan.rate == pytest.approx(RATE_ALPHA * 10 + (1 - RATE_ALPHA) * 4)
    # An interval of exactly MIN_RATE_INTERVAL_S is observed, not merged.
    clock.now = 0.0
    p.update("j", ["a", "b", "c"])
    clock.now = MIN_RATE_INTERVAL_S
    p.advance("j", 1)
    assert p.plans()[1].rate == pytest.approx(1 / MIN_RATE_INTERVAL_S)


def test_upcoming_counts_from_the_cursor() -> None:
    clock = Clock()
    p = Planner(clock=clock)
    p.update("k", ["a", "b", "c", "d"])
    clock.now = 2.0
    p.advance("k", 2)  # 1 shard/s
    assert list(p.upcoming()) == [(0.0, "c"), (pytest.approx(1.0), "d")]


def test_a_stream_without_a_rate_reads_at_the_median_of_the_others() -> None:
    clock = Clock()
    p = Planner(clock=clock)
    p.update("slow", [f"s{i}" for i in range(50)])
    p.update("fast", [f"f{i}" for i in range(50)])
    p.update("new", ["n0", "n1", "n2", "n3", "n4"])
    clock.now = 1.0
    p.advance("slow", 2)
    assert p.next_use("n4") == pytest.approx(4 / 2)  # the only observed rate
    p.advance("fast", 8)
    assert p.next_use("n4") == pytest.approx(4 / 8)  # the median of [2, 8]: known[1]


def test_install_yields_every_step_urls_of_index_work() -> None:
    p = Planner(clock=Clock())
    urls = [f"u{i}" for i in range(10)]
    assert sum(1 for _ in p.install(prepare("k", urls), step=3)) == 3
    # A replacement: 10 URLs indexed, then the old plan's 10 unindexed.
    assert sum(1 for _ in p.install(prepare("k", [*urls[5:], "v"]), step=3)) == 2 + 3
    lapsed = p.drop(["k"])
    assert sum(1 for _ in p.unindexing(lapsed, step=3)) == 2


def test_index_entries_go_with_their_plans() -> None:
    p = Planner(clock=Clock())
    p.update("k", ["a", "b", "c"])
    p.update("k", ["c", "d"])  # replaced: a and b are no plan's any more
    assert set(p._naming) == {"c", "d"}
    p.update("j", ["d", "e"])
    for _ in p.unindexing(p.drop(["k"])):
        pass
    assert p._naming == {"d": {"j"}, "e": {"j"}}
    assert not p.names("c") and p.names("d") and p.names("e")


def test_a_plan_sent_again_keeps_its_index_when_the_old_one_is_unindexed() -> None:
    """A reader's plan is dropped, the reader sends it again, then the dropped plan's index
    entries go: those the new plan names must stay, or it is invisible to eviction."""
    clock = Clock()
    p = Planner(clock=clock, timeout_s=10)
    p.update("k", ["a", "b", "c"])
    clock.now = 11.0
    lapsed = p.drop_lapsed()
    assert [plan.key for plan in lapsed] == ["k"]
    p.update("k", ["b", "c", "d"])
    for _ in p.unindexing(lapsed):
        pass
    assert p.next_use("b") == 0.0 and p.next_use("c") == pytest.approx(1.0)
    assert p.names("b") and not p.names("a")


def test_a_plan_lapses_exactly_at_the_timeout_only_after_it() -> None:
    clock = Clock()
    p = Planner(clock=clock, timeout_s=10)
    p.update("k", ["a"])
    clock.now = 10.0
    assert p.expire() == 0  # quiet for exactly timeout_s: still live
    clock.now = 10.5
    assert p.expire() == 1 and not p.names("a")


def test_next_use_skips_dropped_plans_still_indexed() -> None:
    """Plans dropped but not unindexed yet name the URL too; whatever order the index
    keeps them in, the live plan answers."""
    p = Planner(clock=Clock())
    for i in range(30):
        p.update(f"gone{i}", ["x"])
    p.update("live", ["w", "x"])
    p.drop([f"gone{i}" for i in range(30)])  # not unindexed
    assert p.next_use("x") == pytest.approx(1.0)


def test_drop_returns_the_plans_it_removed() -> None:
    p = Planner(clock=Clock())
    p.update("a", ["x"])
    p.update("b", ["y"])
    version = p.version
    assert [plan.key for plan in p.drop(["a", "nobody"])] == ["a"]
    assert [plan.key for plan in p.plans()] == ["b"] and p.version > version
    assert p.drop(["nobody"]) == []


def test_at_cursors_and_names() -> None:
    clock = Clock()
    p = Planner(clock=clock)
    p.update("a", ["x", "y"])
    p.update("b", ["z"])
    assert p.at_cursors() == {"x", "z"}
    clock.now = 1.0
    p.advance("b", 1)  # b is past its end
    assert p.at_cursors() == {"x"}
    assert p.names("z") and p.names("y")  # behind or ahead of the cursor
    assert not p.names("nowhere")


def test_needed_only_by() -> None:
    clock = Clock()
    p = Planner(clock=clock)
    p.update("a", ["x", "y"], job="j1")
    p.update("b", ["y", "z"], job="j2")
    p.update("c", ["w"], job="j2")
    in_j2 = lambda plan: plan.job == "j2"  # noqa: E731
    assert p.needed_only_by("z", in_j2)
    assert not p.needed_only_by("y", in_j2)  # a needs it too
    assert not p.needed_only_by("x", in_j2)
    assert not p.needed_only_by("nowhere", in_j2)  # nobody needs it
    clock.now = 1.0
    p.advance("a", 2)  # a has read y: only b needs it now
    assert p.needed_only_by("y", in_j2)
    p.advance("c", 1)  # c read w, and needs it no more
    assert not p.needed_only_by("w", in_j2)


def test_a_move_exactly_at_the_notify_interval_is_told_at_once() -> None:
    clock = Clock()
    p = Planner(clock=clock)
    told: list[float] = []
    p.on_change(lambda: told.append(clock.now))
    p.update("k", ["a", "b", "c"])
    clock.now = NOTIFY_INTERVAL_S
    assert p.advance("k", 1) is None
    assert told == [0.0, NOTIFY_INTERVAL_S]


@pytest.mark.parametrize("name", ["belady", "lru"])
def test_a_removed_shard_is_no_victim(name: str) -> None:
    policy: EvictionPolicy = make_policy(name)  # a planner of its own for belady
    policy.on_insert("a", "u/a")
    policy.on_insert("b", "u/b")
    policy.on_remove("a")
    policy.on_remove("never-inserted")  # no error
    assert list(policy.victims()) == ["b"]


def test_belady_admits_only_a_victim_needed_later() -> None:
    p = Planner(clock=Clock())
    p.update("r1", ["now", "soon", "later"])
    p.update("r2", ["x", "tie", "y"])
    policy = BeladyPolicy(p)
    for sid, url in [("s", "soon"), ("l", "later"), ("t", "tie")]:
        policy.on_insert(sid, url)
    assert policy.admits("soon", "l")
    assert not policy.admits("later", "s")
    assert not policy.admits("soon", "t")  # needed at the same time: kept
    assert policy.admits("soon", "unknown")  # a shard the policy never heard of
    assert LRUPolicy().admits("soon", "s")
