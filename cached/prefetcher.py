"""Prefetch: fetch the shards the readers' plans need soonest, ahead of the readers.

The prefetcher walks :meth:`Planner.upcoming` (every planned shard, soonest need first,
across all streams, each stream's distance scaled by its read rate) and counts the bytes
of the shards it passes, resident or not, until ``[prefetch] lookahead`` is reached; every
shard in that window that is not resident is fetched at prefetch priority. The eviction
policy admits a prefetch only if it displaces shards needed later than the one it brings
(:meth:`HotTier.reserve`), so prefetch cannot thrash the hot tier. A shard not fetched yet
counts at an estimate: no HEAD asks its size, its GET tells it (docs/decisions.md, D27).

A reader's first shard (or any shard at a reader's cursor that is missing: the reader has
nothing to read) gets the link first: while one is arriving, no other prefetch starts,
and a download that only such waiting readers need (their own next shard, asked for early)
waits for it (:meth:`Prefetcher.hold`). A cold epoch's first batch then waits for one
download per reader, not for a share of the link among every shard in the window.

Fairness: prefetches take at most ``concurrency - 1`` download slots (the fetcher keeps
one for demand misses, which are also served first from the queue), so a job's lookahead
never makes another job's reader wait for a download to finish; the window is one for the
whole daemon, ordered by time of need, so a fast job gets more of it only because it needs
more sooner.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterator

from .errors import CachedError
from .fetcher import Fetcher
from .hot.tier import reservation_bytes
from .metrics import Metrics
from .planner import Planner
from .stores.base import ObjectInfo

log = logging.getLogger(__name__)

# Look again at least this often: read rates change the order even when plans do not.
RESCAN_S = 1.0
# A shard whose prefetch failed is not tried again for this long (its readers will ask on
# demand, and get the error).
RETRY_AFTER_S = 30.0
# A URL whose lookup failed (missing, denied, the store down) is left out of the window
# for this long, doubling with each further failure up to the cap: one bad URL in one
# plan must not stop prefetch for every plan on the node, nor be asked for at every scan.
LOOKUP_BACKOFF_S = 5.0
LOOKUP_BACKOFF_MAX_S = 300.0
# How often a download held back for the readers' first shards looks again (it also
# wakes whenever a shard is published).
HOLD_POLL_S = 0.1
# A shard counts as awaited by its reader for this long after the reader came to it even
# before its download starts: the reader's open may still be looking the object up, and
# its own next shard's lookup can answer first. After that, only while it downloads.
ARRIVAL_GRACE_S = 1.0


class Prefetcher:
    """Keeps the lookahead window of every plan resident. Run :meth:`run` as a task."""

    def __init__(
        self,
        planner: Planner,
        fetcher: Fetcher,
        metrics: Metrics,
        *,
        lookahead_bytes: int,
        concurrency: int,
    ) -> None:
        self.planner = planner
        self.fetcher = fetcher
        self.metrics = metrics
        self.lookahead_bytes = lookahead_bytes
        # Leave a slot for demand misses whenever there is more than one.
        self.limit = max(1, concurrency - 1)
        self._active: dict[str, asyncio.Task[None]] = {}
        self._failed: dict[str, float] = {}
        # URL -> (retry after, current backoff) for lookups that failed.
        self._unknown: dict[str, tuple[float, float]] = {}
        self._wake = asyncio.Event()
        # Seconds until the first planned shard that is not resident is needed.
        self.lead_s = math.inf
        # Whether the last pass held prefetches back for a reader's shard (see fill).
        self.holding = False
        planner.on_change(self._wake.set)

    def wake(self) -> None:
        """Look at the plans again soon (a fetch finished, a shard left the hot tier)."""
        self._wake.set()

    async def run(self) -> None:
        """Fill the window whenever something changes, until cancelled."""
        try:
            while True:
                self._wake.clear()
                await self.fill()
                self.metrics.prefetch_lead_seconds.set(min(self.lead_s, 1e9))
                self.metrics.plans.set(len(self.planner.plans()))
                # asyncio.wait, not wait_for or asyncio.timeout: in Python 3.11 wait_for
                # loses a cancel that comes in the turn its wait completes (a finished
                # fetch sets _wake; the shutdown then waits out its drain time), and
                # timeout can leave a stray cancel when it fires in that turn.
                woken = asyncio.ensure_future(self._wake.wait())
                # Holding for a reader's shard: its publication ends the hold, whoever
                # fetched it (a reader's demand does not wake the prefetcher).
                published = asyncio.ensure_future(
                    self.fetcher.hot.changed(RESCAN_S) if self.holding else asyncio.sleep(RESCAN_S)
                )
                try:
                    await asyncio.wait(
                        {woken, published}, timeout=RESCAN_S, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    woken.cancel()
                    published.cancel()
        finally:
            for task in self._active.values():
                task.cancel()

    async def fill(self) -> None:
        """One pass over the window: start the prefetches it needs, up to the slot limit."""
        lead = math.inf
        now = time.monotonic()
        self._failed = {url: until for url, until in self._failed.items() if until > now}
        # A failed lookup that no plan has brought back for a long while is forgotten, so
        # URLs that clients stopped naming do not accumulate.
        stale = now - LOOKUP_BACKOFF_MAX_S
        self._unknown = {u: entry for u, entry in self._unknown.items() if entry[0] > stale}
        reading = self.planner.at_cursors()
        self.holding = bool(self._awaited())
        for when, url, info in self._window(self.planner.upcoming()):
            if info is not None and self.fetcher.resident(info) is not None:
                continue
            lead = min(lead, when)
            if self.fetcher.fetching(url) or self._failed.get(url, 0.0) > now:
                continue
            if self.holding and url not in reading:
                # A reader has nothing to read until its shard is in: the link is its
                # alone (with the other readers' first shards). A prefetch started now
                # would share the link with it and delay that reader's first batch; it
                # starts when the shard is in, one download's time later.
                continue
            if len(self._active) >= self.limit:
                break
            task = self._prefetch(url, looked_up=info is not None)
            self._active[url] = asyncio.create_task(task, name=f"prefetch {url}")
        self.lead_s = lead

    async def hold(self, url: str) -> None:
        """Wait (before taking a download slot) while fetching ``url`` would share the link
        with a reader's shard that the reader waits for, and only readers that wait for
        theirs need ``url``: a reader's own next shard, asked for as a demand while its
        first is still arriving (``Fetcher.gate``). A shard another reader can use now, or
        one no plan names, is not held; nothing waits for a download that is not under
        way, so the hold ends when those downloads end, whichever way."""
        while self._held(url):
            await self.fetcher.hot.changed(HOLD_POLL_S)

    def _held(self, url: str) -> bool:
        if url in self.planner.at_cursors():
            return False
        awaited = self._awaited()
        return bool(awaited) and self.planner.needed_only_by(
            url, lambda plan: plan.current() in awaited
        )

    def _awaited(self) -> set[str]:
        """The shards readers are at and wait for: not resident, and downloading, or come
        to within ``ARRIVAL_GRACE_S`` (the reader's open may still be looking them up)."""
        now = self.planner.clock()
        hot, fetcher = self.fetcher.hot, self.fetcher
        return {
            url
            for plan in self.planner.plans()
            if (url := plan.current()) is not None
            and hot.latest(url) is None
            and (fetcher.fetching(url) or now - plan.cursor_at < ARRIVAL_GRACE_S)
        }

    # I27: prefetch brings only what can stay.
    def _window(
        self, upcoming: Iterator[tuple[float, str]]
    ) -> list[tuple[float, str, ObjectInfo | None]]:
        """The planned shards, soonest first, until their bytes reach the lookahead (the
        shard that crosses it included), with what is known of them. Nothing is asked of
        the store: a shard not fetched yet counts as the mean size of those known (its GET
        corrects it), or, while none is known, as the share of the lookahead that lets the
        window hold as many shards as may be prefetched at once.

        The window also ends where its shards would no longer fit the hot tier together,
        so prefetch brings only what can stay until it is read: a shard beyond that,
        fetched into room free now, would be the first to go when the shards needed
        before it arrive, and be fetched again (a dataset twice the hot tier fetched
        1.03-1.09x itself in its cold epoch). Each shard counts what its download
        reserves (sizes not known yet: the mean of those known; none known: not
        counted, the lookahead's share bounds the window then); room that readers hold
        on shards behind their cursors is not there to count."""
        out: list[tuple[float, str, ObjectInfo | None]] = []
        budget = self.lookahead_bytes
        now = time.monotonic()
        typical = self.fetcher.typical_size_bytes()
        guess = typical or max(1, self.lookahead_bytes // self.limit)
        hot = self.fetcher.hot
        room = hot.capacity_bytes - hot.pinned_bytes(except_urls=self.planner.at_cursors())
        for when, url in upcoming:
            if budget <= 0:
                break
            if self._unknown.get(url, (0.0, 0.0))[0] > now:
                continue
            info = self.fetcher.known(url)
            size = info.size if info is not None else typical
            if size is not None:
                room -= reservation_bytes(size)
                if room < 0:
                    break
            out.append((when, url, info))
            budget -= guess if info is None else info.size
        return out

    def _lookup_failed(self, url: str, exc: CachedError) -> None:
        """Leave ``url`` out of the window for a while; warn on its first failure only
        (its readers get the error themselves when they open it)."""
        _, backoff = self._unknown.get(url, (0.0, 0.0))
        if not backoff:
            log.warning(
                "prefetch skips %s: %s (retried with backoff; other shards go on)", url, exc
            )
        backoff = min(LOOKUP_BACKOFF_MAX_S, backoff * 2 or LOOKUP_BACKOFF_S)
        self._unknown[url] = (time.monotonic() + backoff, backoff)
        self.metrics.prefetches.labels("lookup_failed").inc()

    async def _prefetch(self, url: str, *, looked_up: bool) -> None:
        try:
            resident = await self.fetcher.prefetch(url)
            self._unknown.pop(url, None)
            self.metrics.prefetches.labels("ok" if resident else "not_admitted").inc()
            if not resident:
                # Not admitted: nothing resident may give way to it yet. Readers' progress
                # changes that; until then do not ask again at every scan.
                self._failed[url] = time.monotonic() + RESCAN_S
        except CachedError as exc:
            if not looked_up:
                # Its GET was its first lookup (missing, denied, the store down).
                self._lookup_failed(url, exc)
                return
            self.metrics.prefetches.labels("failed").inc()
            self._failed[url] = time.monotonic() + RETRY_AFTER_S
            log.warning("prefetch of %s failed: %s", url, exc)
        finally:
            self._active.pop(url, None)
            self._wake.set()
