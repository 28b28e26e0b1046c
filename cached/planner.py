"""Plans: what every reader will read, in order, and how fast it goes.

Each client stream announces its plan, the ordered shard URLs it will read (this epoch,
usually followed by the next one), and moves a cursor along it with its reads. From the
plans the planner answers two questions, for eviction and for prefetch:

- :meth:`Planner.next_use`: how soon (estimated seconds) a shard is needed again;
- :meth:`Planner.upcoming`: every planned shard in order of earliest need.

Time, not position, makes plans of different readers comparable: a shard 10 places
ahead in a stream that reads 5 shards/s is needed sooner than one 3 places ahead in a
stream that reads one shard every 2 s. Each stream's rate is observed from its cursor.

Plain data, no I/O, no event loop: the policy code that the daemon runs is the code
``bench/cache_sim.py`` replays, with a virtual clock.
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

# A stream that has not moved yet is assumed to read at the median rate of the others, or
# at this rate (shards per second) when no stream has moved.
DEFAULT_RATE = 1.0
# Weight of the newest observation in a stream's rate (an exponential moving average).
RATE_ALPHA = 0.3
# Observations closer together than this are merged (cursor moves of pipelined reads).
MIN_RATE_INTERVAL_S = 0.05


@dataclass
class Plan:
    """One stream's future: shard URLs in read order and the cursor (index being read)."""

    key: str
    urls: list[str]
    job: str = ""
    cursor: int = 0
    rate: float | None = None  # shards per second, None until observed
    seen: float = 0.0  # clock of the last update or read
    _positions: dict[str, list[int]] = field(default_factory=dict, repr=False)
    _moved_at: float = 0.0
    _moved_from: int = 0

    def __post_init__(self) -> None:
        for pos, url in enumerate(self.urls):
            self._positions.setdefault(url, []).append(pos)

    def next_position(self, url: str) -> int | None:
        """The first position at or after the cursor where ``url`` is read, if any."""
        positions = self._positions.get(url)
        if not positions:
            return None
        i = bisect.bisect_left(positions, self.cursor)
        return positions[i] if i < len(positions) else None


class Planner:
    """Every live stream's plan. Not thread-safe: the daemon calls it from its event loop.

    Args:
        timeout_s: a plan not updated or read for this long is dropped (a killed client).
        clock: seconds, monotonic; ``bench/cache_sim.py`` passes a virtual one.
    """

    def __init__(self, timeout_s: float = 120.0, clock: Callable[[], float] = time.monotonic):
        self.timeout_s = timeout_s
        self.clock = clock
        self._plans: dict[str, Plan] = {}
        # url -> keys of the plans that name it: next_use looks only at those (eviction
        # asks for every resident shard, and most plans do not name most shards).
        self._naming: dict[str, set[str]] = {}
        # Bumped on every change, so the prefetcher knows when to look again.
        self.version = 0
        self._listeners: list[Callable[[], None]] = []
        self._median = (-1, DEFAULT_RATE)  # (version, median observed rate)

    # -- updates from clients ------------------------------------------------------------

    def update(self, key: str, urls: Sequence[str], *, cursor: int = 0, job: str = "") -> None:
        """Set (or replace) stream ``key``'s plan. A replacement keeps the observed rate."""
        now = self.clock()
        old = self._plans.get(key)
        plan = Plan(key, list(urls), job=job, cursor=min(cursor, len(urls)), seen=now)
        plan._moved_at, plan._moved_from = now, plan.cursor
        if old is not None:
            plan.rate = old.rate
            self._unindex(old)
        self._plans[key] = plan
        for url in plan._positions:
            self._naming.setdefault(url, set()).add(key)
        self._changed()

    def _unindex(self, plan: Plan) -> None:
        for url in plan._positions:
            keys = self._naming.get(url)
            if keys is not None:
                keys.discard(plan.key)
                if not keys:
                    del self._naming[url]

    def advance(self, key: str, cursor: int) -> None:
        """Stream ``key`` reads position ``cursor`` of its plan (piggy-backed on reads)."""
        plan = self._plans.get(key)
        if plan is None:
            return
        now = self.clock()
        plan.seen = now
        if cursor <= plan.cursor:
            return
        plan.cursor = min(cursor, len(plan.urls))
        elapsed = now - plan._moved_at
        if elapsed >= MIN_RATE_INTERVAL_S:
            observed = (plan.cursor - plan._moved_from) / elapsed
            old = observed if plan.rate is None else plan.rate
            plan.rate = RATE_ALPHA * observed + (1 - RATE_ALPHA) * old
            plan._moved_at, plan._moved_from = now, plan.cursor
        self._changed()

    def expire(self) -> int:
        """Drop plans whose stream went quiet for ``timeout_s``; returns how many."""
        limit = self.clock() - self.timeout_s
        lapsed = [key for key, plan in self._plans.items() if plan.seen < limit]
        for key in lapsed:
            self._unindex(self._plans.pop(key))
        if lapsed:
            self._changed()
        return len(lapsed)

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` after every change (the prefetcher's wake-up)."""
        self._listeners.append(listener)

    def _changed(self) -> None:
        self.version += 1
        for listener in self._listeners:
            listener()

    # -- questions for eviction and prefetch ---------------------------------------------

    def plans(self) -> list[Plan]:
        """The live plans."""
        return list(self._plans.values())

    def rate(self, plan: Plan) -> float:
        """A plan's read rate in shards per second (observed, else an estimate)."""
        if plan.rate is not None and plan.rate > 0:
            return plan.rate
        version, rate = self._median
        if version != self.version:  # asked per resident shard at eviction: compute once
            known = sorted(p.rate for p in self._plans.values() if p.rate)
            rate = known[len(known) // 2] if known else DEFAULT_RATE
            self._median = (self.version, rate)
        return rate

    def next_use(self, url: str) -> float:
        """Estimated seconds until some stream reads ``url``; ``inf`` when no plan names it
        at or after its cursor. 0 means a stream is reading it now."""
        best = math.inf
        for key in self._naming.get(url, ()):
            plan = self._plans[key]
            pos = plan.next_position(url)
            if pos is not None:
                best = min(best, (pos - plan.cursor) / self.rate(plan))
        return best

    def upcoming(self) -> Iterator[tuple[float, str]]:
        """``(seconds until needed, url)`` for every planned shard at or after a cursor,
        each URL once (at its earliest need), soonest first. Lazy: the prefetcher stops
        at its lookahead budget, so long plans cost only what is walked."""
        seen: set[str] = set()
        for when, url in heapq.merge(*(self._walk(p) for p in self._plans.values())):
            if url not in seen:
                seen.add(url)
                yield when, url

    def _walk(self, plan: Plan) -> Iterator[tuple[float, str]]:
        rate = self.rate(plan)
        for pos in range(plan.cursor, len(plan.urls)):
            yield (pos - plan.cursor) / rate, plan.urls[pos]

    def summary(self) -> list[dict[str, object]]:
        """Per-plan state for ``/status``."""
        now = self.clock()
        return [
            {
                "stream": p.key,
                "job": p.job,
                "cursor": p.cursor,
                "shards": len(p.urls),
                "rate_shards_per_s": None if p.rate is None else round(p.rate, 3),
                "idle_s": round(now - p.seen, 3),
            }
            for p in self._plans.values()
        ]
