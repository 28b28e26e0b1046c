"""Eviction policies behind one small interface, chosen by name (``[cache] policy``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from ..planner import Planner
from .belady import BeladyPolicy
from .lru import LRUPolicy

__all__ = ["POLICIES", "BeladyPolicy", "EvictionPolicy", "LRUPolicy", "make_policy"]


class EvictionPolicy(Protocol):
    """Orders resident shards for eviction. The hot tier tells it what happens; it decides order.

    The hot tier skips pinned shards itself, so a policy never needs to know about readers.
    """

    def on_insert(self, shard_id: str, url: str) -> None:
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

    def admits(self, url: str, victim: str) -> bool:
        """Whether a prefetch of ``url`` may evict ``victim`` to make room (admission)."""
        ...


POLICIES: dict[str, Callable[[Planner], EvictionPolicy]] = {
    "belady": BeladyPolicy,
    "lru": lambda _planner: LRUPolicy(),
}
DEFAULT_POLICY = "belady"


def make_policy(name: str, planner: Planner | None = None) -> EvictionPolicy:
    """Build a policy by its registry name; raises ``KeyError`` naming the known ones."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise KeyError(f"unknown eviction policy {name!r}; known: {', '.join(POLICIES)}") from None
    return factory(planner if planner is not None else Planner())
