"""The warm and cold tiers (the stores). ``base`` defines the interface; ``s3`` and ``file``
implement it.

:class:`Sources` routes a shard URL to its tier by scheme and owns the tiers' clients.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from aiobotocore.session import AioSession
from cached_wire.urls import parse

from ..config import S3Config
from ..errors import FetchError
from .base import ObjectInfo, Opened, OwnsStack, Router, Sink, Source
from .file import FileSource
from .pacing import RequestPacer
from .retry import OnRetry
from .s3 import S3Source

__all__ = ["FileSource", "ObjectInfo", "Opened", "S3Source", "Sink", "Source", "Sources"]

log = logging.getLogger(__name__)


class Sources(Router, OwnsStack):
    """Every remote tier behind one :class:`~cached.stores.base.Source`, dispatching on the URL
    scheme.

    ``async with Sources(cfg.s3, on_retry=...) as sources:``. The S3 client is created
    on the first ``s3://`` URL, so a daemon that only reads ``file://`` shards never
    walks the AWS credential chain (whose instance-metadata probe can take seconds off
    EC2). All S3 URLs share that one client, its connection pool and ``pacer``, the
    request budget (:mod:`.pacing`; None: one of ``[s3] max_requests_per_s``). ``session`` is
    passed to :class:`S3Source`; without one, a session is made at the start, in a
    thread, and reads S3's service model and endpoint rules there (botocore's JSON: about
    0.1 s of CPU), so that the first ``s3://`` URL does not spend them on the event loop
    while every other request waits (docs/decisions.md, D29). That reads files only: no
    credentials, no network.
    """

    def __init__(
        self,
        s3: S3Config | None = None,
        on_retry: OnRetry | None = None,
        *,
        session: Any = None,
        pacer: RequestPacer | None = None,
    ) -> None:
        self._s3_cfg = s3 if s3 is not None else S3Config()
        self._on_retry = on_retry
        self._session = session
        self._pacer = pacer
        self._stack: AsyncExitStack | None = None
        self._by_scheme: dict[str, Source] = {}
        self._lock = asyncio.Lock()
        self._warming: asyncio.Future[AioSession | None] | None = None

    async def __aenter__(self) -> Sources:
        self._stack = AsyncExitStack()
        self._by_scheme["file"] = await self._stack.enter_async_context(FileSource())
        if self._session is None:
            self._warming = asyncio.ensure_future(asyncio.to_thread(_warmed_session))
        return self

    def _closed(self) -> None:
        self._by_scheme.clear()
        if self._warming is not None:
            self._warming.cancel()  # the thread ends on its own, a moment later

    async def source_for(self, url: str) -> Source:
        """The tier that serves ``url``; raises :class:`FetchError` for a bad URL."""
        try:
            scheme = parse(url).scheme
        except ValueError as exc:
            raise FetchError(str(exc)) from exc
        source = self._by_scheme.get(scheme)
        if source is not None:
            return source
        async with self._lock:  # one client, however many URLs ask at once
            if self._stack is None:
                raise RuntimeError("Sources is not open: use `async with Sources(cfg)`")
            if scheme not in self._by_scheme and scheme == "s3":
                s3 = S3Source(
                    self._s3_cfg,
                    self._on_retry,
                    session=await self._s3_session(),
                    pacer=self._pacer,
                )
                self._by_scheme["s3"] = await self._stack.enter_async_context(s3)
            return self._by_scheme[scheme]

    async def _s3_session(self) -> Any:
        """The session to create the S3 client from: the one given, else the one warmed at
        the start (None, a fresh one, should warming it have failed)."""
        if self._session is not None or self._warming is None:
            return self._session
        return await self._warming

    async def head(self, url: str) -> ObjectInfo:
        """Look ``url`` up in its tier (see :meth:`Source.head`)."""
        return await (await self.source_for(url)).head(url)

    async def open(self, url: str, landing: Path | None = None) -> Opened:
        """Start reading ``url`` from its tier (see :meth:`Source.open`)."""
        return await (await self.source_for(url)).open(url, landing)

    async def _reader(self, info: ObjectInfo) -> tuple[Source, ObjectInfo]:
        """The tier that serves ``info.url``, and ``info`` as it is."""
        return await self.source_for(info.url), info


def _warmed_session() -> AioSession | None:
    """A botocore session whose loader holds what creating an S3 client reads (the
    service model, the endpoint rules, the partitions and defaults); run in a thread.
    None if that fails: it is only a head start, the client then reads them itself."""
    try:
        session = AioSession()
        loader = session.get_component("data_loader")
        for name in ("endpoints", "partitions", "sdk-default-configuration", "_retry"):
            loader.load_data_with_path(name)
        for kind in ("service-2", "endpoint-rule-set-1"):
            loader.load_service_model("s3", kind, api_version=None)
    except Exception as exc:
        log.debug("reading botocore's S3 model ahead failed: %s", exc)
        return None
    return session
