"""The datasets clients told the daemon: URL lists that compact plans name by position
(issue 24, item 5; docs/protocol.md, "Datasets").

A dataset is named by the digest of its URLs (``cached_wire.catalog.catalog_id``), which
the daemon checks, so no client can make a name stand for URLs it did not send. Datasets
are held per user (cached/owners.py): one copy serves every job of the user that told it,
and another user's plans can name only the datasets that user told, so each user's lists
count against its own caps and no one keeps another's alive. A dataset stays while a plan
names it, and for ``timeout_s`` after it was last told or named; its URLs count against
the telling user's ``[server] max_plan_urls_per_user`` and ``max_dataset_bytes_per_user``
and the daemon's ``max_plan_urls`` and ``max_dataset_bytes`` (``bounds``).

Plain data, no I/O: the server calls it from its event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from cached_wire.catalog import catalog_id, decode_index
from cached_wire.urls import check_all

from .errors import UnknownDataset
from .owners import scoped


def key(dataset_id: str, owner: str) -> str:
    """The key ``owner``'s dataset ``dataset_id`` is held under (a plan's ``dataset``)."""
    return scoped(owner, dataset_id)


@dataclass
class Dataset:
    """One told URL list. ``urls`` is shared by every plan that names it: a plan's URLs are
    the same string objects, so a plan costs its positions, not its URLs' text."""

    id: str
    urls: list[str]
    seen: float  # clock of the last tell, or of the last plan naming it


# I58: a dataset's name is its digest, checked.
def checked(dataset_id: str, urls: list[object]) -> Dataset:
    """The dataset a ``dataset`` request tells, checked: a list of valid URLs whose digest
    is ``dataset_id``. Pure (``ValueError`` for a bad one): runs in a worker thread for
    long lists."""
    if not all(isinstance(u, str) for u in urls):
        raise ValueError("request field 'urls' must be a list of strings")
    strings = [u for u in urls if isinstance(u, str)]
    check_all(strings)
    if catalog_id(strings) != dataset_id:
        raise ValueError(
            f"dataset {dataset_id!r} is not the digest of the URLs sent "
            "(cached_wire.catalog.catalog_id)"
        )
    return Dataset(dataset_id, strings, 0.0)


# I57: a plan by positions is the plan of its URLs.
def resolve(dataset: Dataset, index: str, most: int) -> list[str]:
    """The URLs a plan's ``index`` names in ``dataset`` (at most ``most`` of them);
    ``ValueError`` for a bad index. Pure: runs in a worker thread for long plans."""
    if len(index) > (most * 4 + 2) // 3 * 4:  # base64 of ``most`` positions
        raise ValueError(f"a plan may name at most {most} shards")
    positions = decode_index(index)
    urls = dataset.urls
    try:
        return [urls[p] for p in positions]
    except IndexError:
        raise ValueError(
            f"a plan's index names a position past dataset {dataset.id!r}'s {len(urls)} shards"
        ) from None


class Datasets:
    """The datasets told, by name. Not thread-safe: the daemon calls it from its loop.

    Args:
        timeout_s: a dataset no live plan names is dropped this long after it was last
            told or named (the planner's plan timeout).
        clock: seconds, monotonic.
    """

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self._by_id: dict[str, Dataset] = {}

    def add(self, dataset: Dataset, owner: str = "") -> Dataset:
        """Hold ``dataset`` for ``owner`` (or refresh the one held under its name, whose
        URLs the plans already share); returns the one held."""
        held = self._by_id.setdefault(key(dataset.id, owner), dataset)
        held.seen = self.clock()
        return held

    def find(self, dataset_id: str, owner: str = "") -> Dataset | None:
        """The dataset ``owner`` told as ``dataset_id``, if one is held (not counted as
        named)."""
        return self._by_id.get(key(dataset_id, owner))

    def get(self, dataset_id: str, owner: str = "") -> Dataset:
        """The dataset ``owner`` told as ``dataset_id``, named now; :class:`UnknownDataset`
        if none is held (another user's is not this user's)."""
        held = self._by_id.get(key(dataset_id, owner))
        if held is None:
            raise UnknownDataset(
                f"this daemon holds no dataset {dataset_id!r}: send it (op 'dataset') first"
            )
        held.seen = self.clock()
        return held

    # I59: a dataset stays while a plan names it.
    def drop_unnamed(self, named: set[str]) -> list[str]:
        """Drop the datasets no key in ``named`` (the live plans' :func:`key`) holds and
        that were last told or named over ``timeout_s`` ago; returns their keys."""
        cutoff = self.clock() - self.timeout_s
        gone = [i for i, d in self._by_id.items() if i not in named and d.seen < cutoff]
        for dataset_id in gone:
            del self._by_id[dataset_id]
        return gone

    def ids(self) -> set[str]:
        """The keys of the datasets held (:func:`key`)."""
        return set(self._by_id)

    def summary(self) -> dict[str, int]:
        """For ``/status``: datasets held and their URLs."""
        return {
            "datasets": len(self._by_id),
            "urls": sum(len(d.urls) for d in self._by_id.values()),
        }
