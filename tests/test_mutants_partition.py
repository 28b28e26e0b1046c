"""The client's split of an epoch over readers, where a mutation run (issue 21) found no
fast test: every sample read once (less the documented remainder), equal parts, whole
shards from 0, ranks from the environment, and the shuffle buffer's edges. Pure code."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from cached_client.errors import UsageError
from cached_client.partition import (
    Part,
    ShuffleBuffer,
    buffered_shuffle,
    by_sample,
    by_shard,
    reader_parts,
    resolve_rank,
    shard_order,
)

from tests.test_partition import Counted

LENGTHS = [7, 3, 10, 1, 6, 9, 4]  # 40 samples


def samples(parts: list[Part], lengths: list[int]) -> list[tuple[int, int]]:
    """The (shard, sample) pairs that ``parts`` read."""
    return [
        (p.shard, i)
        for p in parts
        for i in range(p.start, lengths[p.shard] if p.stop is None else p.stop)
    ]


@pytest.mark.parametrize("streams", [1, 2, 3, 4, 6, 7, 40])
def test_by_sample_reads_each_sample_at_most_once_in_equal_runs(streams: int) -> None:
    order = shard_order(len(LENGTHS), shuffle=True, seed=5, epoch=1)
    total = sum(LENGTHS)
    got = [samples(by_sample(order, LENGTHS, s, streams), LENGTHS) for s in range(streams)]
    assert all(len(g) == total // streams for g in got)
    flat = [x for g in got for x in g]
    assert len(set(flat)) == len(flat) == total - total % streams
    # Laid end to end in shard order: the runs are contiguous and in order.
    epoch = [(shard, i) for shard in order for i in range(LENGTHS[shard])]
    assert flat == epoch[: len(flat)]


def test_by_sample_cuts_shards_where_the_runs_end() -> None:
    assert by_sample([0, 1, 2], [4, 4, 4], 1, 3) == [Part(1, 0, 4)]
    assert by_sample([0, 1, 2], [4, 4, 4], 0, 2) == [Part(0, 0, 4), Part(1, 0, 2)]
    assert by_sample([0, 1, 2], [4, 4, 4], 1, 2) == [Part(1, 2, 4), Part(2, 0, 4)]
    assert by_sample([2, 0, 1], [5, 0, 3], 1, 2) == [Part(0, 1, 5)]  # an empty shard


def test_by_sample_with_each_takes_at_most_the_equal_share() -> None:
    assert by_sample([0, 1], [5, 5], 1, 2, each=3) == [Part(0, 3, 5), Part(1, 0, 1)]
    assert by_sample([0, 1], [5, 5], 1, 2, each=5) == [Part(1, 0, 5)]  # exactly all
    with pytest.raises(UsageError, match="2 readers of 6 samples need more than 10"):
        by_sample([0, 1], [5, 5], 0, 2, each=6)


def test_by_shard_reads_every_shard_once_and_whole() -> None:
    order = [3, 0, 4, 1, 2]
    parts = [by_shard(order, s, 2) for s in range(2)]
    assert parts[0] == [Part(3, 0, None), Part(4, 0, None), Part(2, 0, None)]
    assert parts[1] == [Part(0, 0, None), Part(1, 0, None)]


def test_reader_parts_splits_the_epochs_order_by_shard_or_by_sample() -> None:
    asked: list[int] = []

    def lengths() -> list[int]:
        asked.append(1)
        return LENGTHS

    n = len(LENGTHS)
    order = shard_order(n, shuffle=True, seed=3, epoch=2)
    assert order != list(range(n)) and sorted(order) == list(range(n))
    assert order != shard_order(n, shuffle=True, seed=3, epoch=3)
    assert shard_order(n, shuffle=False, seed=3, epoch=2) == list(range(n))
    whole = reader_parts(n, shuffle=True, seed=3, epoch=2, stream=1, streams=3)
    assert whole == by_shard(order, 1, 3) and not asked
    equal = reader_parts(n, shuffle=True, seed=3, epoch=2, stream=1, streams=3, lengths=lengths)
    assert equal == by_sample(order, LENGTHS, 1, 3) and asked == [1]
    plain = reader_parts(n, shuffle=False, seed=3, epoch=2, stream=0, streams=2)
    assert [p.shard for p in plain] == [0, 2, 4, 6]
    # Every shard once over the readers, whole.
    readers = [
        reader_parts(n, shuffle=True, seed=9, epoch=0, stream=s, streams=3) for s in (0, 1, 2)
    ]
    assert Counter(p.shard for r in readers for p in r) == Counter(range(n))


def test_an_explicit_rank_or_world_size_wins_over_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert resolve_rank(None, 4) == (1, 4)
    assert resolve_rank(0, None) == (0, 2)
    with pytest.raises(UsageError, match=r"rank 3 is not in 0\.\.1"):
        resolve_rank(3, None)  # the world size found in the environment
    assert resolve_rank(0, 5) == (0, 5)


def test_a_buffer_of_one_keeps_the_order() -> None:
    assert list(buffered_shuffle(range(50), 1, random.Random(0))) == list(range(50))


def test_a_buffer_of_two_still_shuffles() -> None:
    out = list(buffered_shuffle(range(200), 2, random.Random(0), initial=2))
    assert sorted(out) == list(range(200)) and out != list(range(200))


@pytest.mark.parametrize("size", [2, 3, 8, 33])
def test_the_buffer_never_holds_more_than_size(size: int) -> None:
    source = Counted(500)
    given = 0
    for given, _ in enumerate(buffered_shuffle(source, size, random.Random(1), initial=1), 1):
        assert source.taken - given < size  # it held at most size, this one included
    assert given == 500


def test_the_buffer_starts_at_100_items_by_default_and_at_one_when_asked() -> None:
    source = Counted(300)
    first = next(iter(buffered_shuffle(source, 1000, random.Random(0))))
    assert source.taken == 100 and 0 <= first < 100
    source = Counted(300)
    next(iter(buffered_shuffle(source, 1000, random.Random(0), initial=1)))
    assert source.taken == 1
    # The class's own default too (a reader builds it without ``initial``).
    source = Counted(300)
    next(iter(ShuffleBuffer[int](1000, random.Random(0)).run(source)))
    assert source.taken == 100
