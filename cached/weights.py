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
# set): 417 bytes a URL measured, for any URL length, whether or not the strings are shared.
PLAN_URL_BYTES = 420
# A dataset's URL list holds a slot (8 bytes) a URL besides the string.
DATASET_URL_BYTES = 8


def strings_bytes(urls: Iterable[str]) -> int:
    """The memory of ``urls``' strings (CPython: 49 bytes and one a character for ASCII)."""
    return sum(map(sys.getsizeof, urls))


def plan_bytes(urls: Sequence[str], *, shared: bool) -> int:
    """What a plan of ``urls`` holds: its per-URL structures, and its strings unless they
    are ``shared`` with a dataset held (a plan that names positions in a dataset)."""
    own = 0 if shared else strings_bytes(urls)
    return own + PLAN_URL_BYTES * len(urls)


def dataset_bytes(urls: Sequence[str]) -> int:
    """What a dataset's URL list holds."""
    return strings_bytes(urls) + DATASET_URL_BYTES * len(urls)


def frames_bytes(frames: Sequence[Any]) -> int:
    """The bytes of a reply's frames (``bytes`` or ZeroMQ messages)."""
    return sum(len(frame) for frame in frames)
