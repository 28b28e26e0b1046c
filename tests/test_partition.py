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
