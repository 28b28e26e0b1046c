"""What a holding costs the daemon in memory, in bytes: the weights that ``[server]``'s byte
caps count (:mod:`.bounds`, :mod:`.quota`; docs/operations.md, "Fairness and bounds on a
shared node").

A count of URLs is no bound on memory where a URL may be long, so each URL list a request
leaves behind weighs what it costs: its strings (``sys.getsizeof``: the text and CPython's
header) and what the daemon builds per URL. The figures per URL were measured with
``tracemalloc`` on the planner and the datasets (bench/bounds_rss.py checks them against a
real daemon's RSS).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

# A plan's per-URL structures: its list's slot, its position index (a dict entry and a list
# of positions) and the planner's index of the plans naming each URL (a dict entry and a
# set): 417 bytes a URL by tracemalloc, 450 in a daemon's RSS (565 a URL of 60 characters,
# 1,458 one of 1,000, each plan past the first five of 100,000 or 20,000 URLs).
PLAN_URL_BYTES = 450
# A dataset's URL list holds a slot (8 bytes) a URL besides the string: 1,080 bytes a URL
# of 1,000 characters in RSS, the string's 1,049 and 31.
DATASET_URL_BYTES = 32


def strings_bytes(urls: Iterable[str]) -> int:
    """The memory of ``urls``' strings (CPython: 49 bytes and one a character for ASCII)."""
    return sum(map(sys.getsizeof, urls))


def plan_bytes(urls: int, strings: int = 0) -> int:
    """What a plan of ``urls`` URLs holds: its per-URL structures, and ``strings``, the
    bytes of its URLs' own strings (:func:`strings_bytes`; none for a plan that names
    positions in a dataset: it shares the dataset's)."""
    return strings + PLAN_URL_BYTES * urls


def dataset_bytes(urls: Sequence[str]) -> int:
    """What a dataset's URL list holds."""
    return strings_bytes(urls) + DATASET_URL_BYTES * len(urls)


def frames_bytes(frames: Sequence[Any]) -> int:
    """The bytes of a reply's frames (``bytes`` or ZeroMQ messages)."""
    return sum(len(frame) for frame in frames)
