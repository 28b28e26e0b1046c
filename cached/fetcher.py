"""Bounded concurrent downloads into the hot tier, with in-flight deduplication.

``ensure(url)`` returns the READY shard for a URL, fetching it if needed. Two callers
asking for one shard share one download. A demand miss (a reader waiting) takes the next
free download slot before any prefetch does.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import itertools
import logging
import time
from typing import Protocol

from cached_client.urls import parse

from .errors import CachedError, FetchError
from .metrics import Metrics
from .sources.base import ObjectInfo, Sink
from .tiers.hot import HotTier, Shard

log = logging.getLogger(__name__)

DEMAND = 0
PREFETCH = 1


class PrioritySlots:
    """A semaphore whose waiters are served by priority (lower first), then arrival."""

    def __init__(self, slots: int) -> None:
        self._free = slots
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    async def acquire(self, priority: int) -> None:
        """Wait for a slot."""
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (priority, next(self._seq), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was handed over as we were cancelled
            raise

    def release(self) -> None:
        """Give a slot back, to the most urgent waiter if any."""
        while self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                fut.set_result(None)
                return
        self._free += 1


class SourceLike(Protocol):
    """What the fetcher needs of the remote tiers (``cached.sources.Sources``)."""

    async def head(self, url: str) -> ObjectInfo: ...

    async def fetch(self, info: ObjectInfo, sink: Sink) -> None: ...


def shard_id(info: ObjectInfo) -> str:
    """The content address of a shard: its endpoint, URL and version."""
    ident = f"{info.endpoint}\0{info.url}\0{info.version}".encode()
    return hashlib.sha256(ident).hexdigest()[:32]


class Fetcher:
    """Downloads shards into the hot tier, at most ``concurrency`` at once."""

    def __init__(
        self, sources: SourceLike, hot: HotTier, concurrency: int, metrics: Metrics
    ) -> None:
        self.sources = sources
        self.hot = hot
        self.metrics = metrics
        self._slots = PrioritySlots(concurrency)
        self._infos: dict[str, ObjectInfo] = {}
        self._heads: dict[str, asyncio.Task[ObjectInfo]] = {}
        self._inflight: dict[str, asyncio.Task[Shard]] = {}

    async def info(self, url: str) -> ObjectInfo:
        """The object's size and version, looked up once per URL per daemon lifetime."""
        known = self._infos.get(url)
        if known is not None:
            return known
        task = self._heads.get(url)
        if task is None:
            task = asyncio.create_task(self.sources.head(url))
            self._heads[url] = task
            task.add_done_callback(lambda _t: self._heads.pop(url, None))
        info = await asyncio.shield(task)
        self._infos[url] = info
        return info

    def resident(self, info: ObjectInfo) -> Shard | None:
        """The READY shard for this object, if the hot tier has it."""
        return self.hot.get(shard_id(info))

    async def ensure(self, url: str, priority: int = DEMAND) -> tuple[Shard, bool]:
        """The READY shard for ``url`` and whether it was already resident (a hit).

        Raises ``FetchError`` (``ObjectNotFound``...), ``NotATarError`` or ``CacheFull``.
        """
        info = await self.info(url)
        sid = shard_id(info)
        shard = self.hot.get(sid)
        if shard is not None:
            return shard, True
        while True:
            task = self._inflight.get(sid)
            if task is None:
                task = asyncio.create_task(self._fetch(sid, info, priority), name=f"fetch {url}")
                self._inflight[sid] = task
                task.add_done_callback(lambda _t: self._inflight.pop(sid, None))
            # Shield: one waiter giving up (a client gone) must not cancel the shared download.
            shard = await asyncio.shield(task)
            # Under pressure another download may have evicted it between its publication
            # and this waiter's turn; the caller pins what we return without awaiting.
            if self.hot.get(sid) is shard:
                return shard, False

    async def _fetch(self, sid: str, info: ObjectInfo, priority: int) -> Shard:
        scheme = parse(info.url).scheme
        await self._slots.acquire(priority)
        started = time.monotonic()
        try:
            writer = await self.hot.reserve(sid, info.url, info.version, info.size)
            try:
                await self.sources.fetch(info, writer.write)
                shard = await writer.publish()
            except BaseException:
                writer.abort()
                raise
        except CachedError as exc:
            self.metrics.fetches.labels(scheme, type(exc).__name__).inc()
            # A shard that failed must be looked up again next time (it may be fixed).
            self._infos.pop(info.url, None)
            log.warning("fetch of %s failed: %s", info.url, exc)
            raise
        except OSError as exc:
            self.metrics.fetches.labels(scheme, "OSError").inc()
            raise FetchError(f"writing {info.url} to the hot tier failed: {exc}") from exc
        finally:
            self._slots.release()
        self.metrics.fetches.labels(scheme, "ok").inc()
        self.metrics.fetched_bytes.labels(scheme).inc(info.size)
        self.metrics.fetch_seconds.observe(time.monotonic() - started)
        log.info("fetched %s (%d bytes) in %.2fs", info.url, info.size, time.monotonic() - started)
        return shard
