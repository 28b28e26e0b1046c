"""Eviction policies behind one small interface, chosen by name (``[cache] policy``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from .lru import LRUPolicy


class EvictionPolicy(Protocol):
    """Orders resident shards for eviction. The hot tier tells it what happens; it decides order.

    The hot tier skips pinned shards itself, so a policy never needs to know about readers.
    """

    def on_insert(self, shard_id: str) -> None:
        """A shard was published (or reloaded at start)."""
        ...

    def on_access(self, shard_id: str) -> None:
        """A reader used the shard."""
        ...

    def on_remove(self, shard_id: str) -> None:
        """The shard left the hot tier."""
        ...

    def victims(self) -> Iterator[str]:
        """Resident shards, the best one to evict first."""
        ...


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    """Build a policy by its registry name; raises ``KeyError`` naming the known ones."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise KeyError(f"unknown eviction policy {name!r}; known: {', '.join(POLICIES)}") from None
