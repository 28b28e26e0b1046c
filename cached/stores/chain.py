"""The tier chain below the hot tier: warm (S3/MinIO, or file://), then cold.

On a warm miss (the key does not exist, or it is archived and not restored) a URL under
``[cold] warm_prefix`` is looked up at the same relative key under ``cold_prefix``: a
second bucket, another S3 endpoint, or an archive path. The :class:`ObjectInfo` of a cold
hit keeps the URL the client asked for (the hot tier and the clients address shards by
it) and records where the bytes really are (``source_url``) and which tier that is.
With ``promote = true`` the daemon then writes the verified shard back to the warm tier,
so that the next node or job finds it there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, TypeVar

from ..config import ColdConfig, S3Config
from ..errors import FetchError, ObjectArchived, ObjectNotFound
from . import Sources
from .base import ObjectInfo, Opened, OwnsStack, Router, Source
from .pacing import RequestPacer
from .retry import OnRetry
from .s3 import S3Source

__all__ = ["COLD", "WARM", "TierChain"]

WARM = "warm"
COLD = "cold"

T = TypeVar("T")


async def _head(source: Source, url: str) -> ObjectInfo:
    return await source.head(url)


def _opener(landing: Path | None) -> Callable[[Source, str], Awaitable[Opened]]:
    """Open in each tier asked, each with a landing file of its own: a request the warm
    tier dropped may still remove its file as it ends (native.NativeGet.abort), and must
    not take the cold tier's with it."""
    asked = itertools.count()

    async def _open(source: Source, url: str) -> Opened:
        n = next(asked)
        if landing is None or n == 0:
            return await source.open(url, landing)
        return await source.open(url, landing.with_name(f"{landing.stem}-{n}{landing.suffix}"))

    return _open


class TierChain(Router, OwnsStack):
    """The remote tiers in order, behind one :class:`~cached.stores.base.Source` (what
    the fetcher uses).

    ``async with TierChain(cfg.s3, cfg.cold, on_retry=...) as tiers:``. The warm tier is
    a :class:`~cached.stores.Sources` router (by scheme). The cold tier, if ``cold`` is
    configured, reads ``file://`` paths through that router's file source and ``s3://``
    keys through its S3 client, or through a second client of its own when
    ``[cold] endpoint_url`` names another endpoint; like the warm one, that client is
    created on first use. Without a cold tier this behaves exactly like ``Sources``.

    Only a miss falls through to the cold tier: access denied, timeouts and other
    failures of the warm tier propagate, so that an outage is seen as one rather than
    turning silently into (slower, possibly billed) archive reads.

    ``pacer``: the warm endpoint's request budget (:mod:`.pacing`); a cold tier on an
    endpoint of its own paces itself at the same ``[s3] max_requests_per_s``.
    """

    def __init__(
        self,
        s3: S3Config | None = None,
        cold: ColdConfig | None = None,
        on_retry: OnRetry | None = None,
        *,
        session: Any = None,
        pacer: RequestPacer | None = None,
    ) -> None:
        self._s3_cfg = s3 if s3 is not None else S3Config()
        self._cold_cfg = cold if cold is not None else ColdConfig()
        self._on_retry = on_retry
        self._session = session
        self._warm = Sources(self._s3_cfg, on_retry, session=session, pacer=pacer)
        self._stack: AsyncExitStack | None = None
        self._cold_s3: S3Source | None = None
        self._lock = asyncio.Lock()

    @property
    def cold(self) -> ColdConfig:
        """The ``[cold]`` configuration this chain follows."""
        return self._cold_cfg

    @property
    def revalidate_s(self) -> float:
        """How long the tiers' answer about an object is trusted (``[s3] revalidate_s``)."""
        return self._s3_cfg.revalidate_s

    async def __aenter__(self) -> TierChain:
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(self._warm)
            self._stack = stack.pop_all()
        return self

    def _closed(self) -> None:
        self._cold_s3 = None

    async def _cold_source(self, cold_url: str) -> Source:
        """The source that reads the cold tier's ``cold_url``."""
        if self._cold_cfg.endpoint_url is None:
            # Same endpoint as [s3] (another bucket or prefix), or a file:// archive.
            return await self._warm.source_for(cold_url)
        if self._cold_s3 is not None:
            return self._cold_s3
        async with self._lock:  # one client, however many misses ask at once
            if self._cold_s3 is None:
                if self._stack is None:
                    raise RuntimeError("TierChain is not open: use `async with TierChain(...)`")
                cfg = dataclasses.replace(
                    self._s3_cfg,
                    endpoint_url=self._cold_cfg.endpoint_url,
                    region=self._cold_cfg.region,
                )
                source = S3Source(cfg, self._on_retry, session=self._session)
                self._cold_s3 = await self._stack.enter_async_context(source)
            return self._cold_s3

    async def head(self, url: str) -> ObjectInfo:
        """Look ``url`` up in the warm tier, then (on a miss it covers) in the cold tier.

        A cold hit is returned with ``url`` unchanged, ``source_url`` the cold URL,
        ``tier == "cold"`` and the cold endpoint. Raises :class:`ObjectNotFound` naming
        both URLs when both tiers miss (:class:`ObjectArchived` if the cold copy is
        archived too), and whatever the warm tier raised when the cold tier does not
        cover ``url``.
        """
        info, cold_url = await self._find(url, _head)
        return info if cold_url is None else _as_cold(info, url, cold_url)

    async def open(self, url: str, landing: Path | None = None) -> Opened:
        """Start reading ``url`` (see :meth:`Source.open`) from the tier :meth:`head`
        would find it in; its ``info`` is what :meth:`head` would return."""
        opened, cold_url = await self._find(url, _opener(landing))
        if cold_url is not None:
            opened.info = _as_cold(opened.info, url, cold_url)
        return opened

    async def _find(
        self, url: str, ask: Callable[[Source, str], Awaitable[T]]
    ) -> tuple[T, str | None]:
        """``ask`` the warm tier about ``url``, then, on a miss the cold tier covers, the
        cold tier about its copy; with the cold URL when the cold tier answered."""
        try:
            return await ask(self._warm, url), None
        except ObjectNotFound as warm_miss:
            cold_url = self._cold_cfg.cold_url(url)
            if cold_url is None:
                raise
            source = await self._cold_source(cold_url)
            try:
                return await ask(source, cold_url), cold_url
            except ObjectNotFound as cold_miss:
                kind = ObjectArchived if isinstance(cold_miss, ObjectArchived) else ObjectNotFound
                raise kind(
                    f"{url}: not in the warm tier nor in the cold tier at {cold_url} "
                    f"(warm: {warm_miss}; cold: {cold_miss})"
                ) from cold_miss

    async def _reader(self, info: ObjectInfo) -> tuple[Source, ObjectInfo]:
        """The tier :meth:`head` (or :meth:`open`) found the object in, and ``info`` as
        that tier knows it: the sources read ``info.url``, so a cold copy's is its
        ``source_url`` (and the errors name the URL actually read)."""
        if info.source_url is None:
            return self._warm, info
        source_url = info.source_url
        source = (
            await self._cold_source(source_url)
            if info.tier == COLD
            else await self._warm.source_for(source_url)
        )
        return source, dataclasses.replace(info, url=source_url)

    def promote_enabled(self, info: ObjectInfo) -> bool:
        """Whether a shard fetched with ``info`` should be written back to the warm tier."""
        return self._cold_cfg.promote and info.tier == COLD

    async def promote(self, info: ObjectInfo, path: Path) -> None:
        """Upload ``path`` (the shard, already verified in the hot tier) to ``info.url``.

        The write is conditional (see :meth:`S3Source.put` ``if_absent``): an object that
        appeared in the warm tier since the miss, written by another node's promotion or
        by anyone else, is left as it is. Raises ``ValueError`` unless
        :meth:`promote_enabled`, :class:`FetchError` when the upload fails (the shard in
        the hot tier is unaffected; the next miss elsewhere just reads the cold tier).
        """
        if not self.promote_enabled(info):
            raise ValueError(f"{info.url}: promotion is off or the shard is not from the cold tier")
        warm = await self._warm.source_for(info.url)
        if not isinstance(warm, S3Source):  # config validation requires an s3:// warm_prefix
            raise FetchError(f"{info.url}: the warm tier is not S3; cannot promote to it")
        await warm.put(info.url, path, info.size, if_absent=True)


def _as_cold(info: ObjectInfo, url: str, cold_url: str) -> ObjectInfo:
    """The cold tier's answer about ``cold_url``, as the answer about ``url``."""
    return dataclasses.replace(info, url=url, source_url=cold_url, tier=COLD)
