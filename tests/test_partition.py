"""The client's shuffle buffer: pure code, no daemon."""

from __future__ import annotations

import random
from collections.abc import Iterator

from cached_client.partition import buffered_shuffle


def test_the_shuffle_buffer_yields_early_stays_bounded_and_loses_nothing() -> None:
    drawn = 0

    def source() -> Iterator[int]:
        nonlocal drawn
        for i in range(5000):
            drawn += 1
            yield i

    out = []
    first_after = None
    for x in buffered_shuffle(source(), 1000, random.Random(1), initial=100):
        if first_after is None:
            first_after = drawn
        out.append(x)
        assert drawn - len(out) <= 1000  # never more than `size` held back
    assert first_after is not None and first_after <= 101  # not after 1000
    assert sorted(out) == list(range(5000)) and out != list(range(5000))
    again = list(buffered_shuffle(range(5000), 1000, random.Random(1), initial=100))
    assert again == out  # the same seed, the same order


class Counted:
    """The items 0..n-1, counting in ``taken`` how many the buffer has taken."""

    def __init__(self, n: int) -> None:
        self.n, self.taken = n, 0

    def __iter__(self) -> Iterator[int]:
        for i in range(self.n):
            self.taken = i + 1
            yield i


def test_the_buffer_starts_at_the_first_shard_and_gives_half_of_it_at_once() -> None:
    """A reader's first shard of 67 samples is all in: the buffer starts there (not at
    100, which needs the next shard's download) and gives out 34 before it takes another
    item, so a batch of 32 needs one download per worker."""
    source = Counted(500)
    out: list[int] = []
    before_more: list[int] = []
    for x in buffered_shuffle(source, 1000, random.Random(2), 100, lambda: source.taken >= 67):
        out.append(x)
        if source.taken == 67:
            before_more.append(x)
    assert len(before_more) == 34 and set(before_more) <= set(range(67))
    assert before_more != sorted(before_more)  # drawn at random, not in order
    assert sorted(out) == list(range(500))
    # Then two in, one out: every item is drawn from at least half of what came in.
    again = Counted(500)
    early = lambda: again.taken >= 67  # noqa: E731
    for given, _ in enumerate(buffered_shuffle(again, 1000, random.Random(2), 100, early), 1):
        assert again.taken - given >= (again.taken - 1) // 2 or again.taken == 500


def test_without_an_early_start_a_big_first_shard_starts_at_initial() -> None:
    """Shards of 100 samples or more: the start is at ``initial`` (100), half out at once."""
    source = Counted(300)
    first_out = [source.taken for _ in buffered_shuffle(source, 1000, random.Random(0), 100)]
    assert first_out[:50] == [100] * 50 and first_out[50] == 102
