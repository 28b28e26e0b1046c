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
import errno
import functools
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

from .errors import CachedError, CacheFull, FetchError
from .lookups import Lookups
from .metrics import Metrics
from .once import seen
from .slots import DEMAND, PREFETCH, Held, PrioritySlots
from .sources.base import ObjectChanged, ObjectInfo, Opened, Rewind, Sink
from .sources.retry import StoreUnavailable
from .tiers.checks import Checks
from .tiers.hot import HotTier, NotAdmitted, Shard, ShardWriter

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
# How often a reader's open ahead looks whether the prefetcher started on its shard (or
# on the GET that asks for its version).
AHEAD_POLL_S = 0.25
# Times an open follows an object replaced while it was being downloaded, before it
# gives up (an object rewritten faster than it can be read).
CHANGED_RETRIES = 3
# Attempts of a download whose writes find the disk full (another program filled it):
# each removes its partial file, evicts and GETs again.
DISK_FULL_ATTEMPTS = 3
# How long a GET that answered (its body held at the CRT for native.HOLD_S, 5 s, or a
# botocore body on an open connection) waits for evicted files to leave the disk before
# its body is dropped; the bytes then come with a new GET once there is room.
HELD_UNLINK_WAIT_S = 1.0
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


class SourceLike(Protocol):
    """What the fetcher needs of the remote tiers (``cached.sources.chain.TierChain``)."""

    @property
    def revalidate_s(self) -> float: ...

    async def head(self, url: str) -> ObjectInfo: ...

    async def open(self, url: str, landing: Path | None = None) -> Opened: ...

    async def fetch(
        self,
        info: ObjectInfo,
        sink: Sink,
        *,
        rewind: Rewind | None = None,
        opened: Opened | None = None,
        into: Path | None = None,
        landed: Callable[[], None] | None = None,
    ) -> bool: ...

    def promote_enabled(self, info: ObjectInfo) -> bool: ...

    async def promote(self, info: ObjectInfo, path: Path) -> None: ...


class GaveWay(Exception):
    """A reader's open ahead (asked to give way) found no room for its shard: the tier
    holds what the reader reads now. It is answered "not resident", and the reader asks
    again, as a demand, when it gets there (docs/protocol.md, ``give_way``)."""


def shard_id(info: ObjectInfo) -> str:
    """The content address of a shard: its endpoint, URL and version."""
    return _content_address(info.endpoint, info.url, info.version)


@functools.lru_cache(maxsize=1 << 14)  # every request asks: remembered, not rehashed
def _content_address(endpoint: str, url: str, version: str) -> str:
    ident = f"{endpoint}\0{url}\0{version}".encode()
    return hashlib.sha256(ident).hexdigest()[:32]


@dataclass
class _Opening:
    """A GET of a URL whose version is not known yet, shared by all who ask for the URL
    meanwhile. ``info`` is set from its headers; its task then goes on to download the
    shard from that body, unless the hot tier has it or another download brings it."""

    # The most urgent asker's: the download slot and the reservation follow it.
    priority: int
    info: asyncio.Future[ObjectInfo]
    task: asyncio.Task[Shard | None] | None = None


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
        self._inflight: dict[str, asyncio.Task[Shard]] = {}
        self._opening: dict[str, _Opening] = {}  # by URL
        self._promotions: set[asyncio.Task[None]] = set()
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
        """A reservation in the hot tier waited (:mod:`.tiers.waits`): counted."""
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
        if priority == AHEAD:
            info = await self._answered_soon(url, deadline, revalidate=revalidate)
            if info is not None:
                return info
            priority = DEMAND
        if give_way and not self.hot.room_now(self.typical_size_bytes() or 0):
            return await self.lookups.get(url, revalidate=revalidate)  # it will give way
        return await self._open(url, priority)

    async def _answered_soon(
        self, url: str, deadline: float, *, revalidate: bool
    ) -> ObjectInfo | None:
        """The store's answer about ``url`` once someone else's GET has it, or None at
        ``deadline``. Sends nothing; raises what that GET raised (not found...)."""
        while (left := deadline - time.monotonic()) > 0:
            known = self.lookups.fresh(url, revalidate=revalidate)
            if known is not None:
                return known
            opening = self._opening.get(url)
            if opening is None:
                await self.hot.changed(min(left, AHEAD_POLL_S))
                continue
            try:
                return await asyncio.wait_for(asyncio.shield(opening.info), left)
            except TimeoutError:
                return None
        return None

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

    def _start_opening(self, url: str, priority: int) -> _Opening:
        loop = asyncio.get_running_loop()
        opening = _Opening(priority, loop.create_future())
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

    async def _fetch_opened(self, url: str, opening: _Opening) -> Shard | None:
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
                return await self._download(sid, info, opening.priority, held, opened)
        finally:
            held.give_back()

    def _claim(self, sid: str, info: ObjectInfo) -> bool:
        """Whether the running opening is to download ``sid`` from its GET's body: not
        when the hot tier has the shard (found by the version the GET gave) or another
        download of it is under way. If so, it is registered as that download."""
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
            shard = await self._usable(await self._resident_soon(sid, left))
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

    async def _resident_soon(self, sid: str, timeout_s: float) -> Shard | None:
        """The shard once someone else brings it into the hot tier, or None after
        ``timeout_s``. Starts no download."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            shard = self.hot.get(sid)
            if shard is not None:
                return shard
            task = self._inflight.get(sid)
            if task is not None and not task.done():
                # Its failure (not admitted, not found) is for its own callers to see.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(task), left)
            else:
                await self.hot.changed(min(left, AHEAD_POLL_S))
        return None

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
            return await self._download(sid, info, priority, held)
        finally:
            held.give_back()

    async def _download(
        self, sid: str, info: ObjectInfo, priority: int, held: Held, opened: Opened | None = None
    ) -> Shard:
        """Reserve room for the shard and stream it in, from ``opened``'s body if given,
        under the download slot ``held`` (see :meth:`_stream_in`); counted, logged, and
        promoted from the cold tier if that is asked for."""
        tier = info.tier
        started = time.monotonic()
        try:
            shard = await self._stream_in(sid, info, priority, held, opened)
        except CachedError as exc:
            self.metrics.fetches.labels(tier, type(exc).__name__).inc()
            # A shard that failed must be looked up again next time (it may be fixed).
            self.lookups.forget(info.url)
            if isinstance(exc, StoreUnavailable):
                self.lookups.unreachable(exc, info.url)
            if isinstance(exc, ObjectChanged):
                log.info("%s changed while it was fetched: %s", info.url, exc)
            else:
                log.warning("fetch of %s failed: %s", info.url, exc)
            raise
        except OSError as exc:
            self.metrics.fetches.labels(tier, "OSError").inc()
            raise FetchError(f"writing {info.url} to the hot tier failed: {exc}") from exc
        self.metrics.fetches.labels(tier, "ok").inc()
        self.metrics.fetched_bytes.labels(tier).inc(info.size)
        self.metrics.fetch_seconds.observe(time.monotonic() - started)
        log.info(
            "fetched %s from the %s tier (%d bytes) in %.2fs",
            info.read_url,
            tier,
            info.size,
            time.monotonic() - started,
        )
        if self.sources.promote_enabled(info):
            self._promote(shard, info)
        return shard

    async def _stream_in(
        self, sid: str, info: ObjectInfo, priority: int, held: Held, opened: Opened | None
    ) -> Shard:
        """Reserve room and stream the shard into the hot tier. A write that finds the
        disk full (ENOSPC: the room the tier saw was taken meanwhile) removes its partial
        file, evicts by the policy, and the download starts over with a new GET, up to
        :data:`DISK_FULL_ATTEMPTS` in all.

        The download slot ``held`` is given back once the bytes are in (before a check
        over the file, the MD5 of an ETag, on the native path): that check, the index and
        the publication are local work, and the next GET starts meanwhile (D48). The room
        stays reserved until the shard is published."""
        for attempt in range(1, DISK_FULL_ATTEMPTS + 1):
            await held.take(priority, sid)  # a new GET after a full disk: a slot again
            writer = await self._reserve(sid, info, priority, opened)

            async def again(writer: ShardWriter = writer) -> None:
                await held.take(priority, sid)  # a GET again after a failed check
                await writer.rewind()

            try:
                wrote = await self.sources.fetch(
                    info,
                    writer.write,
                    rewind=again,
                    opened=opened,
                    into=writer.path,
                    landed=held.give_back,
                )
                held.give_back()
                # wrote: the source wrote the file itself (the native path)
                return await writer.publish(info.size if wrote else None)
            except OSError as exc:
                writer.abort()
                if exc.errno not in _DISK_FULL or attempt == DISK_FULL_ATTEMPTS:
                    raise
                self.metrics.fetches.labels(info.tier, "disk_full").inc()
                evicted = self.hot.disk_full(writer.shard.reserved_bytes)
                log.warning(
                    "the disk holding the hot tier was full while %s was written (%s); "
                    "evicted %d bytes, fetching it again",
                    info.url,
                    exc.strerror,
                    evicted,
                )
                opened = None  # its body is spent
            except BaseException:
                writer.abort()
                raise
        raise AssertionError("unreachable")

    async def _reserve(
        self, sid: str, info: ObjectInfo, priority: int, opened: Opened | None
    ) -> ShardWriter:
        """Room for the shard in the hot tier, before any byte lands (the hard bound).

        A GET that has answered does not wait for room: its connection would sit for up
        to ``pin_wait_s`` with the store sending into it (a native GET's body is held for
        5 s at most). It waits :data:`HELD_UNLINK_WAIT_S` at most for evicted files to
        leave the disk. Without room then its body is closed unread, and the bytes come
        with a new GET (``If-Match``) once there is room. A prefetch never waits for
        readers (:class:`NotAdmitted`; the caller closes the body).
        """
        prefetch = priority == PREFETCH
        if opened is not None and not prefetch:
            try:
                return await self.hot.reserve(sid, info, wait_s=0, unlink_wait_s=HELD_UNLINK_WAIT_S)
            except CacheFull:
                opened.close()
        return await self.hot.reserve(sid, info, prefetch=prefetch)

    def _promote(self, shard: Shard, info: ObjectInfo) -> None:
        """Write a shard read from the cold tier back to the warm tier, in the background,
        from the hot tier's verified copy (pinned meanwhile, so it stays on disk)."""
        self.hot.pin(shard)

        async def upload() -> None:
            try:
                await self.sources.promote(info, self.hot.path(shard))
                self.metrics.promotions.labels("ok").inc()
                log.info("promoted %s from %s to the warm tier", info.url, info.read_url)
            except CachedError as exc:
                self.metrics.promotions.labels("failed").inc()
                log.warning("promotion of %s to the warm tier failed: %s", info.url, exc)
            finally:
                self.hot.unpin(shard)

        task = asyncio.create_task(upload(), name=f"promote {info.url}")
        self._promotions.add(task)
        task.add_done_callback(self._promotions.discard)

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
        if self._promotions:
            await asyncio.gather(*self._promotions, return_exceptions=True)
