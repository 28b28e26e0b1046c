"""Bounded concurrent downloads into the hot tier, with in-flight deduplication.

``ensure(url)`` returns the READY shard for a URL, fetching it if needed. Two callers
asking for one shard share one download. A demand miss (a reader waiting) takes the next
free download slot before any prefetch does.

The object's version comes from :class:`~cached.lookups.Lookups` (revalidated at opens
after ``[s3] revalidate_s``; the resident copy's during an outage). A URL the hot tier
holds no copy of and whose version is not known costs one GET, not a HEAD and a GET: its
headers give the version (and so the shard id), and its body is the download
(:meth:`Fetcher._open`; docs/decisions.md, D27). A resident copy is revalidated with a
HEAD: there is no download to share a GET with. An object replaced during its download
(``ObjectChanged``) is looked up again and the new version fetched. A resident shard
reloaded at start is served once the hot tier may serve it (checked, or checked member
by member as it is read).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

from .ahead import Opening, answered_soon, resident_soon
from .errors import CachedError, CacheFull, FetchError
from .hot.checks import Checks
from .hot.tier import HotTier, NotAdmitted, Shard
from .landing import Landing, SourceLike, shard_id
from .lookups import Lookups
from .metrics import Metrics
from .once import seen
from .slots import DEMAND, PREFETCH, Held, PrioritySlots
from .stores.base import ObjectChanged, ObjectInfo

__all__ = [
    "AHEAD",
    "DEMAND",
    "PREFETCH",
    "Fetcher",
    "GaveWay",
    "PrioritySlots",
    "SourceLike",
    "shard_id",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

# Not a download priority: a reader's open ahead of its position. It waits for the shard
# to become resident (the prefetcher decides what to fetch ahead) and is fetched on demand
# only if it is still missing after ``[cache] pin_wait_s``; the reader asks again as a
# demand when it gets there first.
AHEAD = 2
# How often a reader's open ahead that the eviction policy did not admit asks again.
ADMISSION_RETRY_S = 0.05
# Times an open follows an object replaced while it was being downloaded, before it
# gives up (an object rewritten faster than it can be read).
CHANGED_RETRIES = 3


class GaveWay(Exception):
    """A reader's open ahead (asked to give way) found no room for its shard: the tier
    holds what the reader reads now. It is answered "not resident", and the reader asks
    again, as a demand, when it gets there (docs/protocol.md, ``give_way``)."""


class Fetcher:
    """Downloads shards into the hot tier, at most ``concurrency`` at once."""

    def __init__(
        self,
        sources: SourceLike,
        hot: HotTier,
        concurrency: int,
        metrics: Metrics,
        *,
        next_use: Callable[[str], float] | None = None,
    ) -> None:
        # Awaited by each download before it takes a slot (the prefetcher's hold for the
        # readers' first shards, ``Prefetcher.hold``); set once by the daemon.
        self.gate: Callable[[str], Awaitable[None]] | None = None
        self.sources = sources
        self.hot = hot
        self.metrics = metrics
        # Queued prefetches go in order of need (``Planner.next_use`` of their URL).
        self._urls: dict[str, str] = {}
        urgency = None if next_use is None else (lambda sid: next_use(self._urls.get(sid, "")))
        self._slots = PrioritySlots(concurrency, keep=1, urgency=urgency)
        self.lookups = Lookups(
            sources.head,
            self._offline,
            revalidate_s=sources.revalidate_s,
            on_answer=self._answered,
        )
        self._landing = Landing(sources, hot, metrics, self.lookups)
        self._inflight: dict[str, asyncio.Task[Shard]] = {}
        self._opening: dict[str, Opening] = {}  # by URL
        metrics.store_reachable.set_function(lambda: float(self.lookups.health.reachable))
        hot.on_corrupt(lambda _shard, found: metrics.corrupt_shards.labels(found).inc())
        hot.on_wait(self._waited)
        self.checks = Checks(hot)
        # Reloaded shards are read back in the background; readiness does not wait.
        self._checking: asyncio.Task[None] | None = None
        with contextlib.suppress(RuntimeError):  # no running loop: nothing to check in
            self._checking = asyncio.get_running_loop().create_task(
                self.checks.verify_all(), name="check reloaded shards"
            )

    async def info(self, url: str, *, revalidate: bool = False) -> ObjectInfo:
        """The object's size and version (see :meth:`Lookups.get`): what is known, or with
        ``revalidate`` (an open) asked again once older than ``[s3] revalidate_s``."""
        return await self.lookups.get(url, revalidate=revalidate)

    def known(self, url: str) -> ObjectInfo | None:
        """What is known of ``url`` without asking the store: the last answer, whatever
        its age, else the hot tier's copy's own description; None for a URL not fetched
        yet (its size comes with its GET)."""
        return self.lookups.fresh(url) or self._offline(url)

    def typical_size_bytes(self) -> int | None:
        """The mean size of the objects known (:meth:`Lookups.typical_size_bytes`)."""
        return self.lookups.typical_size_bytes()

    def store_status(self) -> dict[str, Any]:
        """The store's reachability for ``/status``: ``{"reachable", "since", "last_error"}``."""
        return self.lookups.health.status()

    def _offline(self, url: str) -> ObjectInfo | None:
        """What the hot tier's copy of ``url`` says of itself, to serve it without the store."""
        shard = self.hot.latest(url)
        if shard is None or shard.info is None or shard_id(shard.info) != shard.shard_id:
            return None  # not resident, or from a sidecar that predates its origin
        return shard.info

    def _waited(self, wait: str, seconds: float, timed_out: bool) -> None:
        """A reservation in the hot tier waited (:mod:`.hot.waits`): counted."""
        self.metrics.hot_waits.labels(wait).observe(seconds)
        if timed_out:
            self.metrics.hot_wait_timeouts.labels(wait).inc()

    def _answered(self, info: ObjectInfo) -> None:
        """The store described ``info``: a resident copy from an old sidecar learns it."""
        shard = self.resident(info)
        if shard is not None and shard.info is None:
            self.checks.record_origin(shard, info)

    def resident(self, info: ObjectInfo) -> Shard | None:
        """The READY shard for this object, if the hot tier has it (a look, not a use)."""
        return self.hot.get(shard_id(info), access=False)

    # I66: asks nothing of the store and fetches nothing.
    def resident_fresh(self, url: str) -> Shard | None:
        """The READY shard for ``url`` if the store's answer about it is young enough for
        an open (``[s3] revalidate_s``) and the hot tier has that version: what an open
        would find at once. Nothing is asked of the store or fetched."""
        info = self.lookups.fresh(url, revalidate=True)
        return self.resident(info) if info is not None else None

    async def ensure(
        self, url: str, priority: int = DEMAND, *, revalidate: bool = True, give_way: bool = False
    ) -> tuple[Shard, bool]:
        """The READY shard for ``url`` and whether it was already resident (a hit).

        ``revalidate``: an open, which asks the store again about an answer older than
        ``[s3] revalidate_s``; reads pass False and keep to the version known. A URL
        whose version must be asked and that the hot tier holds no copy of costs one GET.
        Raises ``FetchError`` (``ObjectNotFound``...), ``NotATarError`` or ``CacheFull``.

        ``give_way``: an open the reader does not wait for yet (ahead, or the next shard
        while it reads the one before) that finds no room for its shard (``AHEAD``: once
        it has waited for the prefetcher) raises :class:`GaveWay` instead of waiting for
        room or failing with ``CacheFull``: a small tier serves its reader one shard at
        a time. With no room for a shard of the typical size, its lookup is a HEAD, not
        a GET whose body would be dropped.
        """
        # An open ahead waits for others' downloads this long in all, its lookup included.
        deadline = time.monotonic() + self.hot.pin_wait_s

        async def attempt(info: ObjectInfo) -> tuple[Shard, bool]:
            return await self._ensure(info, priority, deadline, give_way)

        return await self._following_changes(
            url, priority, attempt, revalidate=revalidate, deadline=deadline, give_way=give_way
        )

    # I20: two versions never mix.
    async def _following_changes(
        self,
        url: str,
        priority: int,
        attempt: Callable[[ObjectInfo], Awaitable[T]],
        *,
        revalidate: bool,
        deadline: float = 0.0,
        give_way: bool = False,
    ) -> T:
        """``attempt(info)`` with the object's description (:meth:`_lookup`); if the
        object was replaced while it downloaded (``ObjectChanged``), again with the
        version the store has now, up to ``CHANGED_RETRIES`` times in all."""
        for tries in range(1, CHANGED_RETRIES + 1):
            info = await self._lookup(
                url, priority, revalidate=revalidate, deadline=deadline, give_way=give_way
            )
            try:
                return await attempt(info)
            except ObjectChanged:
                if tries == CHANGED_RETRIES:
                    raise
            revalidate = True  # the failed download forgot the answer: ask again
        raise AssertionError("unreachable")

    async def _lookup(
        self, url: str, priority: int, *, revalidate: bool, deadline: float, give_way: bool
    ) -> ObjectInfo:
        """The object's description: the answer known (:meth:`Lookups.fresh`); for a URL
        the hot tier holds a copy of, a HEAD (a revalidation, with no download to share
        a GET with) or, while the store is down, the copy's own; else the headers of the
        GET that downloads it (:meth:`_open`). An open ahead sends nothing until
        ``deadline``: it takes the answer of someone else's GET (the prefetcher's), and
        only then asks as a demand would."""
        known = self.lookups.fresh(url, revalidate=revalidate)
        if known is not None:
            return known
        if self.hot.latest(url) is not None or not self.lookups.health.reachable:
            return await self.lookups.get(url, revalidate=revalidate)
        # I26: an open ahead never fetches by itself.
        if priority == AHEAD:
            info = await answered_soon(
                self.lookups, self._opening, self.hot, url, deadline, revalidate=revalidate
            )
            if info is not None:
                return info
            priority = DEMAND
        if give_way and not self.hot.room_now(self.typical_size_bytes() or 0):
            return await self.lookups.get(url, revalidate=revalidate)  # it will give way
        return await self._open(url, priority)

    # I22: one GET per cold URL (the open's GET is the download's).
    async def _open(self, url: str, priority: int) -> ObjectInfo:
        """The object's description from the headers of a GET of it, which goes on to
        download the shard (:meth:`_fetch_opened`). One GET per URL at a time, however
        many ask: each waits for the headers, then joins the download or finds the
        shard resident as any caller does (:meth:`_bring_in`)."""
        opening = self._opening.get(url)
        if opening is None:
            opening = self._start_opening(url, priority)
        elif priority < opening.priority:
            # A reader waits now: the GET goes first, and what it brings is no prefetch.
            opening.priority = priority
            self._slots.promote(url, priority)
        return await asyncio.shield(opening.info)

    def _start_opening(self, url: str, priority: int) -> Opening:
        loop = asyncio.get_running_loop()
        opening = Opening(priority, loop.create_future())
        opening.info.add_done_callback(seen)
        task = loop.create_task(self._fetch_opened(url, opening), name=f"fetch {url}")
        opening.task = task
        self._opening[url] = opening
        self._urls[url] = url  # its slot is queued by URL: the shard id is not known yet

        def settle(done: asyncio.Task[Shard | None]) -> None:
            if self._opening.get(url) is opening:
                del self._opening[url]
                self._urls.pop(url, None)
            seen(done)
            if opening.info.done():
                return
            # It ended before the headers came: cancelled (a shutdown), or a bug.
            if done.cancelled():
                opening.info.cancel()
            else:
                opening.info.set_exception(
                    done.exception() or FetchError(f"{url}: the GET ended without an answer")
                )

        task.add_done_callback(settle)
        return opening

    async def _fetch_opened(self, url: str, opening: Opening) -> Shard | None:
        """An opening's task: a download slot, the GET, the answer its headers give;
        then the download from its body, unless the hot tier has that shard already or
        another download of it is under way (None: the body is closed unread)."""
        await self._slot(opening.priority, url, url)
        held = Held(self._slots)
        try:
            try:
                opened = await self.sources.open(url, self.hot.landing())
            except CachedError as exc:
                # The download's GET failed: a fetch that failed, under the tier asked
                # first (which tier answered is not known before the headers).
                self.metrics.fetches.labels("warm", type(exc).__name__).inc()
                self.lookups.failed(url, exc)
                opening.info.set_exception(exc)
                return None
            async with opened:
                info = opened.info
                self.lookups.remember(info)
                sid = shard_id(info)
                claimed = self._claim(sid, info)
                opening.info.set_result(info)
                if not claimed:
                    return None
                return await self._landing.download(sid, info, opening.priority, held, opened)
        finally:
            held.give_back()

    def _claim(self, sid: str, info: ObjectInfo) -> bool:
        """Whether the running opening is to download ``sid`` from its GET's body: not
        when the hot tier has the shard (found by the version the GET gave) or another
        download of it is under way. If so, it is registered as that download."""
        # I22: a copy already here costs no GET.
        if self.hot.get(sid, access=False) is not None:
            return False
        running = self._inflight.get(sid)
        if running is not None and not running.done():
            return False
        task = asyncio.current_task()
        assert task is not None
        # From here on the task's result is this shard, or its failure: a download as
        # _start's are, for others to join.
        self._track(sid, info.url, cast("asyncio.Task[Shard]", task))
        return True

    async def _usable(self, shard: Shard | None) -> Shard | None:
        """``shard`` if it may be served now: a reloaded shard without member checksums
        is checked first (dropped, and None, if it fails)."""
        if shard is None or not self.checks.needs_check(shard):
            return shard
        return shard if await self.checks.verify(shard) else None

    async def _ensure(
        self, info: ObjectInfo, priority: int, deadline: float, give_way: bool = False
    ) -> tuple[Shard, bool]:
        sid = shard_id(info)
        # Spared by eviction from its publication until the caller pins it (no await
        # between our return and its pin), or it may be gone before the caller's turn.
        # I11: the shard a reader waits for survives until it is pinned.
        with self.hot.wanted(sid):
            try:
                return await self._bring_in(sid, info, priority, deadline, give_way)
            except CacheFull:
                if not give_way:
                    raise
                raise GaveWay(info.url) from None

    async def _bring_in(
        self, sid: str, info: ObjectInfo, priority: int, deadline: float, give_way: bool
    ) -> tuple[Shard, bool]:
        """``_ensure``'s work, for a caller that holds ``hot.wanted(sid)``. An open ahead
        waits for someone else's download until ``deadline``; then, with ``give_way``, it
        fetches only if there is room now (:class:`GaveWay`)."""
        shard = await self._usable(self.hot.get(sid))
        if shard is not None:
            return shard, True
        if priority == AHEAD:
            left = deadline - time.monotonic()
            shard = await self._usable(await resident_soon(self.hot, self._inflight, sid, left))
            if shard is not None:
                return shard, False
            priority = DEMAND
        running = self._inflight.get(sid)
        if give_way and (running is None or running.done()) and not self.hot.room_now(info.size):
            raise GaveWay(info.url)
        deadline = 0.0
        while True:
            task = await self._join(sid, info, priority)
            if priority == DEMAND:
                # A reader waits: a download queued as a prefetch goes first now.
                self._slots.promote(sid, DEMAND)
            # Shield: one waiter giving up (a client gone) must not cancel the shared download.
            try:
                shard = await asyncio.shield(task)
            except NotAdmitted:
                # The prefetch gave way to shards needed sooner. A prefetch request
                # (``cached prefetch``) waits until the rule admits it, as readers move on;
                # then, or after ``pin_wait_s``, or for a reader waiting now, it fetches on
                # demand (the user asked for this shard).
                if priority == PREFETCH:
                    deadline = deadline or time.monotonic() + self.hot.pin_wait_s
                    if time.monotonic() < deadline:
                        await asyncio.sleep(ADMISSION_RETRY_S)
                        continue
                priority = DEMAND
                continue
            # Eviction spares it (hot.wanted), but a copy found corrupt between its
            # publication and this waiter's turn is dropped: fetch it again.
            if self.hot.get(sid) is shard:
                return shard, False

    def fetching(self, url: str) -> bool:
        """Whether ``url`` is being fetched, at any version (or waits for a slot)."""
        return url in self._opening or url in self._urls.values()

    async def prefetch(self, url: str) -> bool:
        """Fetch ``url`` ahead of its readers, if the eviction policy admits it (it
        would displace only shards needed later). Returns whether the shard is resident.
        The version is revalidated first (as an open would), so that a prefetch does not
        bring a version the reader's open will find replaced; a URL not known yet costs
        one GET, as for an open."""

        async def attempt(latest: ObjectInfo) -> bool:
            if self.resident(latest) is not None:
                return True
            try:
                await asyncio.shield(await self._join(shard_id(latest), latest, PREFETCH))
            except NotAdmitted:
                return False
            return True

        return await self._following_changes(url, PREFETCH, attempt, revalidate=True)

    async def _join(self, sid: str, info: ObjectInfo, priority: int) -> asyncio.Task[Shard]:
        """The download of ``sid`` under way, or a new one at ``priority``.

        A GET of the URL whose headers are not in yet (an open that did not know the
        object) is waited for first: it claims the shard's download if the version is the
        same, and is joined, rather than a second GET of the object beside it."""
        if info.url in self._opening:
            with contextlib.suppress(Exception):  # its failure is its own callers' to see
                await self._open(info.url, priority)
        # I21: one download per shard.
        task = self._inflight.get(sid)
        if task is None or task.done():  # done: its callback has not cleared it yet
            return self._start(sid, info, priority)
        return task

    def _start(self, sid: str, info: ObjectInfo, priority: int) -> asyncio.Task[Shard]:
        task = asyncio.create_task(self._fetch(sid, info, priority), name=f"fetch {info.url}")
        self._track(sid, info.url, task)
        return task

    def _track(self, sid: str, url: str, task: asyncio.Task[Shard]) -> None:
        """Register ``task`` as the download of ``sid``: others join it, until it ends."""
        self._inflight[sid] = task
        self._urls[sid] = url

        def forget(done: asyncio.Task[Shard]) -> None:
            if self._inflight.get(sid) is done:  # not a newer download of the same shard
                del self._inflight[sid]
                self._urls.pop(sid, None)

        task.add_done_callback(forget)

    async def _slot(self, priority: int, key: str, url: str) -> None:
        """A download slot for ``url`` (queued as ``key``), once the gate lets it go."""
        if self.gate is not None:
            await self.gate(url)
        await self._slots.acquire(priority, key)

    async def _fetch(self, sid: str, info: ObjectInfo, priority: int) -> Shard:
        """Download a shard whose version is known: a slot, room, a GET (``If-Match``)."""
        await self._slot(priority, sid, info.url)
        held = Held(self._slots)
        try:
            return await self._landing.download(sid, info, priority, held)
        finally:
            held.give_back()

    async def stop(self) -> None:
        """Cancel the downloads and lookups under way and wait for them; each download
        removes its partial file as it ends (``writer.abort``). At shutdown, once no request
        waits on them and before the sources close, so none outlives the S3 client."""
        # The background checks stop at their next read; their threads are not waited for.
        self.checks.close()
        openings = (o.task for o in self._opening.values())
        tasks = {
            t for t in (*self._inflight.values(), *openings, self._checking) if t and not t.done()
        }
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await self.lookups.stop()

    async def drain(self) -> None:
        """Wait for promotions under way (at shutdown, within the daemon's drain time)."""
        await self._landing.drain()
