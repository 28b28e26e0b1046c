"""Belady's rule over the readers' plans: evict the shard needed furthest in the future.

Shards that no plan names (read and not coming back, or never announced) go first, the
least recently used of them first; then the others, the one needed last first. The hot
tier skips pinned shards (a reader holds them), so a policy never needs to know of them.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator

from ..planner import Planner


class BeladyPolicy:
    """Clairvoyant eviction and admission, from :class:`~cached.planner.Planner`."""

    def __init__(self, planner: Planner) -> None:
        self.planner = planner
        # Oldest access first: the tie-break among shards with no announced use.
        self._urls: OrderedDict[str, str] = OrderedDict()

    def on_insert(self, shard_id: str, url: str) -> None:
        self._urls[shard_id] = url
        self._urls.move_to_end(shard_id)

    def on_access(self, shard_id: str) -> None:
        if shard_id in self._urls:
            self._urls.move_to_end(shard_id)

    def on_remove(self, shard_id: str) -> None:
        self._urls.pop(shard_id, None)

    def victims(self) -> Iterator[str]:
        next_use = self.planner.next_use
        # Sort key: furthest next use first (inf, no announced use, before all); among
        # equals, the least recently used first (the enumeration order).
        ranked = sorted(
            ((-next_use(url), age, sid) for age, (sid, url) in enumerate(self._urls.items())),
        )
        return iter([sid for _, _, sid in ranked])

    # I28: prefetch never evicts a sooner need.
    def admits(self, url: str, victim: str) -> bool:
        """A prefetch of ``url`` may displace ``victim`` only if the victim is needed later
        (or by no plan at all): prefetching cannot evict what is read sooner, so it cannot
        thrash."""
        victim_url = self._urls.get(victim)
        if victim_url is None:
            return True
        later = self.planner.next_use(victim_url)
        return later == math.inf or later > self.planner.next_use(url)
