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

from .owners import name_of, owner_of

# A stream that has not moved yet is assumed to read at the median rate of the others, or
# at this rate (shards per second) when no stream has moved.
DEFAULT_RATE = 1.0
# Weight of the newest observation in a stream's rate (an exponential moving average).
RATE_ALPHA = 0.3
# Observations closer together than this are merged (cursor moves of pipelined reads).
MIN_RATE_INTERVAL_S = 0.05
# Listeners hear of cursor moves at most this often (the prefetcher walks its whole window
# at each change: at every shard a fast local reader reads, that was a third of the
# daemon's CPU); a move in between is told by :meth:`Planner.flush`, which the caller of
# :meth:`Planner.advance` runs when it says (docs/decisions.md, D30).
NOTIFY_INTERVAL_S = MIN_RATE_INTERVAL_S
# Index work on a plan (a million URLs is a plan the protocol allows) is done in steps of
# this many URLs, so that the daemon's event loop can serve between them.
INDEX_STEP = 20_000


@dataclass
class Plan:
    """One stream's future: shard URLs in read order and the cursor (index being read).
    ``key`` is the stream's name as the daemon holds it, under its user (cached/owners.py)."""

    key: str
    urls: list[str]
    job: str = ""
    dataset: str = ""  # the dataset whose positions the plan named (cached/datasets.py)
    cursor: int = 0
    rate: float | None = None  # shards per second, None until observed
    seen: float = 0.0  # clock of the last update or read
    cursor_at: float = 0.0  # clock when the cursor came to where it is
    _positions: dict[str, list[int]] = field(default_factory=dict, repr=False)
    _moved_at: float = 0.0
    _moved_from: int = 0

    def __post_init__(self) -> None:
        for pos, url in enumerate(self.urls):
            self._positions.setdefault(url, []).append(pos)

    def current(self) -> str | None:
        """The shard at the cursor (being read, or waited for); None past the end."""
        return self.urls[self.cursor] if self.cursor < len(self.urls) else None

    def next_position(self, url: str) -> int | None:
        """The first position at or after the cursor where ``url`` is read, if any."""
        positions = self._positions.get(url)
        if not positions:
            return None
        i = bisect.bisect_left(positions, self.cursor)
        return positions[i] if i < len(positions) else None


def prepare(
    key: str, urls: Sequence[str], *, cursor: int = 0, job: str = "", dataset: str = ""
) -> Plan:
    """A plan ready for :meth:`Planner.install`. Touches no planner state, so the daemon
    builds a long plan (its position index is the costly part) in a worker thread."""
    urls = list(urls)
    return Plan(key, urls, job=job, dataset=dataset, cursor=min(cursor, len(urls)))


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
        self._told_at = -math.inf  # clock of the last notice to the listeners
        self._untold = False  # a cursor move not told yet (see advance)
        self._median = (-1, DEFAULT_RATE)  # (version, median observed rate)

    # -- updates from clients ------------------------------------------------------------

    def update(self, key: str, urls: Sequence[str], *, cursor: int = 0, job: str = "") -> None:
        """Set (or replace) stream ``key``'s plan. A replacement keeps the observed rate."""
        for _ in self.install(prepare(key, urls, cursor=cursor, job=job)):
            pass

    def install(self, plan: Plan, step: int = INDEX_STEP) -> Iterator[None]:
        """Publish ``plan`` (made by :func:`prepare`), replacing its stream's old one; a
        replacement keeps the observed rate. A generator: it yields every ``step`` URLs of
        index work, so the daemon can serve in between (run it to the end; one install at
        a time). Until the plan is published, an index entry without its plan is skipped.
        """
        yield from self._index(plan, step)
        now = self.clock()
        plan.seen = plan._moved_at = plan.cursor_at = now
        plan._moved_from = plan.cursor
        old = self._plans.get(plan.key)
        if old is not None:
            plan.rate = old.rate
        self._plans[plan.key] = plan
        self._changed()
        if old is not None:
            yield from self._unindex(old, step, keep=plan)

    def _index(self, plan: Plan, step: int) -> Iterator[None]:
        for i, url in enumerate(plan._positions, 1):
            self._naming.setdefault(url, set()).add(plan.key)
            if i % step == 0:
                yield

    def _unindex(self, plan: Plan, step: int, keep: Plan | None = None) -> Iterator[None]:
        """Drop ``plan``'s index entries, except those of URLs its replacement ``keep`` names."""
        for i, url in enumerate(plan._positions, 1):
            if keep is None or url not in keep._positions:
                keys = self._naming.get(url)
                if keys is not None:
                    keys.discard(plan.key)
                    if not keys:
                        del self._naming[url]
            if i % step == 0:
                yield

    def advance(self, key: str, cursor: int) -> float | None:
        """Stream ``key`` reads position ``cursor`` of its plan (piggy-backed on reads).

        The listeners hear of a move at once unless they heard of a change in the last
        :data:`NOTIFY_INTERVAL_S`; then the move is told by :meth:`flush`, and the return
        value says in how many seconds to call it (None: nothing left untold)."""
        plan = self._plans.get(key)
        if plan is None:
            return None
        now = self.clock()
        plan.seen = now
        if cursor <= plan.cursor:
            return None
        plan.cursor = min(cursor, len(plan.urls))
        plan.cursor_at = now
        elapsed = now - plan._moved_at
        if elapsed >= MIN_RATE_INTERVAL_S:
            observed = (plan.cursor - plan._moved_from) / elapsed
            old = observed if plan.rate is None else plan.rate
            plan.rate = RATE_ALPHA * observed + (1 - RATE_ALPHA) * old
            plan._moved_at, plan._moved_from = now, plan.cursor
        self.version += 1
        wait = self._told_at + NOTIFY_INTERVAL_S - now
        if wait > 0:
            self._untold = True
            return wait
        self._tell(now)
        return None

    def flush(self) -> None:
        """Tell the listeners of cursor moves that :meth:`advance` left untold."""
        if self._untold:
            self._tell(self.clock())

    def expire(self) -> int:
        """Drop plans whose stream went quiet for ``timeout_s``; returns how many."""
        lapsed = self.drop_lapsed()
        for _ in self.unindexing(lapsed):
            pass
        return len(lapsed)

    # I37: a quiet plan is dropped after plan_timeout_s.
    def drop_lapsed(self) -> list[Plan]:
        """Unpublish the plans whose stream went quiet for ``timeout_s`` and return them;
        their index entries go with :meth:`unindexing` (in steps, like :meth:`install`)."""
        limit = self.clock() - self.timeout_s
        lapsed = [plan for plan in self._plans.values() if plan.seen < limit]
        for plan in lapsed:
            del self._plans[plan.key]
        if lapsed:
            self._changed()
        return lapsed

    # I38: a heartbeat keeps a quiet plan.
    def touch(self, keys: Sequence[str]) -> None:
        """The readers of the plans under ``keys`` are alive (a heartbeat): their plans
        do not lapse while they read from files without a request, or pause."""
        now = self.clock()
        for key in keys:
            plan = self._plans.get(key)
            if plan is not None:
                plan.seen = now

    def drop(self, keys: list[str]) -> list[Plan]:
        """Unpublish the plans under ``keys`` (their reader went away) and return them; their
        index entries go with :meth:`unindexing`."""
        dropped = [plan for key in keys if (plan := self._plans.pop(key, None)) is not None]
        if dropped:
            self._changed()
        return dropped

    def unindexing(self, plans: list[Plan], step: int = INDEX_STEP) -> Iterator[None]:
        """Remove dropped ``plans``' index entries, yielding every ``step`` URLs; those of a
        plan published under the same key since (its reader's, sent again) stay."""
        for plan in plans:
            yield from self._unindex(plan, step, keep=self._plans.get(plan.key))

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` after every change (the prefetcher's wake-up); cursor moves
        at most every :data:`NOTIFY_INTERVAL_S` (see :meth:`advance`)."""
        self._listeners.append(listener)

    def _changed(self) -> None:
        self.version += 1
        self._tell(self.clock())

    def _tell(self, now: float) -> None:
        self._told_at, self._untold = now, False
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

    def names(self, url: str) -> bool:
        """Whether some live plan names ``url`` (anywhere, before or after its cursor)."""
        return any(key in self._plans for key in self._naming.get(url, ()))

    def next_use(self, url: str) -> float:
        """Estimated seconds until some stream reads ``url``; ``inf`` when no plan names it
        at or after its cursor. 0 means a stream is reading it now."""
        best = math.inf
        for key in self._naming.get(url, ()):
            plan = self._plans.get(key)
            if plan is None:  # indexed, not yet published, or dropped and being unindexed
                continue
            pos = plan.next_position(url)
            if pos is not None:
                best = min(best, (pos - plan.cursor) / self.rate(plan))
        return best

    def at_cursors(self) -> set[str]:
        """The shards the streams read now, or wait for: each live plan's cursor shard."""
        return {url for plan in self._plans.values() if (url := plan.current()) is not None}

    def needed_only_by(self, url: str, streams: Callable[[Plan], bool]) -> bool:
        """Whether some live plan names ``url`` at or after its cursor, and every such
        plan is one of ``streams``."""
        naming = [
            plan
            for key in self._naming.get(url, ())
            if (plan := self._plans.get(key)) is not None and plan.next_position(url) is not None
        ]
        return bool(naming) and all(streams(plan) for plan in naming)

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
        """Per-plan state for ``/status``: each plan's stream and dataset as its client
        named them, and the user it is held for (None for a key of no user)."""
        now = self.clock()
        return [
            {
                "stream": name_of(p.key),
                "user": owner_of(p.key) or None,
                "job": p.job,
                "dataset": name_of(p.dataset) if p.dataset else None,
                "cursor": p.cursor,
                "shards": len(p.urls),
                "rate_shards_per_s": None if p.rate is None else round(p.rate, 3),
                "idle_s": round(now - p.seen, 3),
            }
            for p in self._plans.values()
        ]
