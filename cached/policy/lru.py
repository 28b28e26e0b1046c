"""Least recently used: evict the shard whose last access is oldest (for comparison)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator


class LRUPolicy:
    """LRU over shard ids (an ordered dict: oldest first). Ignores the readers' plans."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()

    def on_insert(self, shard_id: str, url: str) -> None:
        self._order[shard_id] = None
        self._order.move_to_end(shard_id)

    def on_access(self, shard_id: str) -> None:
        if shard_id in self._order:
            self._order.move_to_end(shard_id)

    def on_remove(self, shard_id: str) -> None:
        self._order.pop(shard_id, None)

    def victims(self) -> Iterator[str]:
        # A copy: the caller removes entries while iterating.
        return iter(list(self._order))

    def admits(self, url: str, victim: str) -> bool:
        """LRU knows no future: a prefetch may displace any unpinned shard."""
        return True
