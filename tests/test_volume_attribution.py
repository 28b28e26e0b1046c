"""bench/volume.py's attribution of the daemon's fetches to the epochs they serve: pure
code over recorded events (the benchmark itself runs a real daemon; ``make bench``)."""

from __future__ import annotations

from bench.volume import attribute

WINDOWS = [(0.0, 10.0), (10.5, 20.0)]


def test_a_fetch_counts_for_the_epoch_whose_read_follows_it() -> None:
    events = [
        (1.0, "fetch", "a", 100),
        (2.0, "read", "a", 110),
        (3.0, "fetch", "b", 200),
        (4.0, "read", "b", 210),
        (9.0, "fetch", "a", 100),  # the next epoch's first shard, prefetched early
        (11.0, "read", "a", 110),
        (12.0, "read", "b", 210),  # still resident: no fetch
    ]
    done = attribute(events, WINDOWS)
    assert done.for_epoch == [300, 100]
    assert done.ahead == [100, 0]  # fetched in epoch 0, for epoch 1
    assert (done.unread, done.wasted, done.twice, done.again) == ([0, 0], [0, 0], 0, 0)


def test_waste_fetched_twice_before_a_read_and_never_read() -> None:
    events = [
        (1.0, "fetch", "a", 100),
        (2.0, "fetch", "a", 100),  # evicted unread and fetched again
        (3.0, "read", "a", 110),
        (4.0, "fetch", "b", 200),
        (5.0, "read", "b", 210),
        (6.0, "fetch", "b", 200),  # the same epoch's reads consume it again
        (7.0, "read", "b", 210),
        (10.2, "fetch", "c", 300),  # between the epochs: counts in the one before
        (19.0, "fetch", "d", 400),  # for an epoch that never came
    ]
    done = attribute(events, WINDOWS)
    assert done.for_epoch == [500, 0]
    assert done.wasted == [100, 0] and done.twice == 1
    assert done.again == 1
    assert done.unread == [300, 400]
