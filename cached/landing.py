"""Landing one download in the hot tier: room reserved before any byte, the bytes in
(into the file by the source itself on the native path, else through the shard's
writer), publication, and what follows: the metrics, the log line, a disk found full
(evict and GET again), and the cold tier's promotion to the warm tier.

:class:`Landing` is the fetcher's last step (:meth:`~cached.fetcher.Fetcher`); it takes
a download slot as given and gives it back once the bytes are in (D48).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import hashlib
import logging
import time
from pathlib import Path
from typing import Protocol

from .errors import CachedError, CacheFull, FetchError
from .hot.tier import HotTier, Shard, ShardWriter
from .lookups import Lookups
from .metrics import Metrics
from .slots import PREFETCH, Held
from .stores.base import ObjectChanged, ObjectInfo, Opened, Source
from .stores.retry import StoreUnavailable

log = logging.getLogger(__name__)

# Attempts of a download whose writes find the disk full (another program filled it):
# each removes its partial file, evicts and GETs again.
DISK_FULL_ATTEMPTS = 3
# How long a GET that answered (its body held at the CRT for native.HOLD_S, 5 s, or a
# botocore body on an open connection) waits for evicted files to leave the disk before
# its body is dropped; the bytes then come with a new GET once there is room.
HELD_UNLINK_WAIT_S = 1.0
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


class SourceLike(Source, Protocol):
    """What the fetcher needs of the remote tiers (``cached.stores.chain.TierChain``):
    a :class:`~cached.stores.base.Source`, how long its answers hold, and promotion."""

    @property
    def revalidate_s(self) -> float: ...

    def promote_enabled(self, info: ObjectInfo) -> bool: ...

    async def promote(self, info: ObjectInfo, path: Path) -> None: ...


def shard_id(info: ObjectInfo) -> str:
    """The content address of a shard: its endpoint, URL and version."""
    return _content_address(info.endpoint, info.url, info.version)


@functools.lru_cache(maxsize=1 << 14)  # every request asks: remembered, not rehashed
def _content_address(endpoint: str, url: str, version: str) -> str:
    ident = f"{endpoint}\0{url}\0{version}".encode()
    return hashlib.sha256(ident).hexdigest()[:32]


class Landing:
    """Brings a shard whose download slot is held into the hot tier, from ``sources``;
    counts it in ``metrics`` and has ``lookups`` forget an object whose fetch failed."""

    def __init__(
        self, sources: SourceLike, hot: HotTier, metrics: Metrics, lookups: Lookups
    ) -> None:
        self.sources = sources
        self.hot = hot
        self.metrics = metrics
        self._lookups = lookups
        self._promotions: set[asyncio.Task[None]] = set()

    async def download(
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
            self._lookups.forget(info.url)
            if isinstance(exc, StoreUnavailable):
                self._lookups.unreachable(exc, info.url)
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

    # I25: the download slot is held for the GET, not the local work after it.
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
                if await self.sources.fetches_to_file(info, opened):
                    # The source writes the file itself (the native path): the index
                    # and checksums are made in one pass over it as it is published.
                    await self.sources.fetch_to_file(
                        info, writer.path, rewind=again, opened=opened, landed=held.give_back
                    )
                    held.give_back()
                    return await writer.publish(info.size)
                await self.sources.stream_to_sink(info, writer.write, rewind=again, opened=opened)
                held.give_back()
                return await writer.publish()
            except OSError as exc:
                writer.abort()
                if exc.errno not in _DISK_FULL or attempt == DISK_FULL_ATTEMPTS:
                    raise
                self.metrics.fetches.labels(info.tier, "disk_full").inc()
                # I7: ENOSPC evicts what it can and the shard is fetched again.
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

    async def drain(self) -> None:
        """Wait for promotions under way (at shutdown, within the daemon's drain time)."""
        if self._promotions:
            await asyncio.gather(*self._promotions, return_exceptions=True)
