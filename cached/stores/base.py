"""The interface every remote tier implements (warm: S3/MinIO; file://; cold: either)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, Protocol

from cached_wire.urls import ShardURL, parse

from ..errors import FetchError

# Receives the object's bytes in order, exactly once each, as runs of one or more chunks
# (as they came off the socket: never joined, so a byte is copied once on its way to the
# hot tier's file); may apply back-pressure by awaiting.
Sink = Callable[[Sequence[bytes]], Awaitable[None]]
# Tells the sink to forget every byte it was given: the object is sent again from byte 0.
Rewind = Callable[[], Awaitable[None]]


def located(url: str, scheme: str, kind: str) -> ShardURL:
    """``url`` parsed, a :class:`FetchError` where it is not a shard URL of ``scheme``
    (``kind`` names one in the message: "an s3:// URL")."""
    try:
        parsed = parse(url)
    except ValueError as exc:
        raise FetchError(str(exc)) from exc
    if parsed.scheme != scheme:
        raise FetchError(f"{url}: not {kind}")
    return parsed


class ObjectChanged(FetchError):
    """The object is no longer the version it was looked up as (S3 answered 412 to
    ``If-Match``, or a file's mtime moved): look it up again and fetch the new version.
    Nothing of the new version reached the sink."""


@dataclass(frozen=True)
class ObjectInfo:
    """What a source knows of an object before fetching it.

    ``version`` is the content identity used for the cache address: the ETag for S3,
    ``"<size>-<mtime_ns>"`` for files.

    ``url`` is always the URL the client asked for: the hot tier and the clients address
    shards by it, whichever tier served the bytes. ``tier`` names that tier (``"warm"``
    or ``"cold"``) for metrics and status; ``source_url`` is where the bytes are read
    from when that is not ``url`` (the cold tier's copy), and ``endpoint`` is then the
    cold tier's endpoint, so the content address differs from the warm object's.
    """

    url: str
    endpoint: str
    size: int
    version: str
    etag: str | None = None
    tier: str = "warm"
    source_url: str | None = None
    # The store's checksum of the whole object, "<algorithm>:<base64>" (e.g.
    # "crc64nvme:AAAA..."), when it has one that the daemon can compute: the bytes are
    # checked against it once, as they stream in. None: MD5 of a plain ETag, or size only.
    checksum: str | None = None

    @property
    def read_url(self) -> str:
        """Where the bytes are read from: ``source_url`` if set, else ``url``."""
        return self.source_url or self.url


class Opened:
    """An object whose GET has answered with its headers and whose body is not read yet:
    ``info`` (what the headers say, as a HEAD would) and the response to stream it from.

    ``async with await source.open(url) as opened:``; leaving closes a body that nobody
    took (:meth:`take`), which drops its connection without reading the rest. So one GET
    both describes an object and brings its bytes; a caller that finds it needs no bytes
    (the version is resident already) pays no download.
    """

    def __init__(self, info: ObjectInfo, response: Any = None) -> None:
        # Mutable: a tier chain relabels what its cold tier found (ObjectInfo.url).
        self.info = info
        self._response = response

    @property
    def unread(self) -> bool:
        """Whether it still holds a body nobody took."""
        return self._response is not None

    def take(self) -> Any:
        """The response, once (the taker streams and closes it); None after that, or if
        the source holds none (a file) or it was closed."""
        response, self._response = self._response, None
        return response

    def close(self) -> None:
        """Close the body unless it was taken; the connection is dropped, not reused."""
        response = self.take()
        if response is not None:
            self._discard(response)

    def _discard(self, response: Any) -> None:
        """Release a response nobody reads (the source's kind of response)."""

    async def __aenter__(self) -> Opened:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Source(Protocol):
    """A remote tier: look an object up, then fetch it into a file or stream it in
    order into a sink, whichever the caller wants (:meth:`fetches_to_file` says which
    is the cheaper)."""

    async def head(self, url: str) -> ObjectInfo:
        """Return the object's size and version. Raises ``ObjectNotFound`` or ``FetchError``."""
        ...

    async def open(self, url: str, landing: Path | None = None) -> Opened:
        """Start reading the object: its description as :meth:`head` gives it, from the
        answer that also carries its bytes (one request, not two). Raises as :meth:`head`.

        ``landing``: a file (in the hot tier) the source may write the body into as it
        arrives, no sooner than :meth:`fetch_to_file` lets it (the native path); it is removed
        if the body is not taken."""
        ...

    async def fetches_to_file(self, info: ObjectInfo, opened: Opened | None = None) -> bool:
        """Whether :meth:`fetch_to_file` is this object's cheaper way in: the source
        writes the file itself, with no Python per byte (the native S3 path). Otherwise
        a caller that has a sink of its own streams to it (:meth:`stream_to_sink`)."""
        ...

    async def stream_to_sink(
        self,
        info: ObjectInfo,
        sink: Sink,
        *,
        rewind: Rewind | None = None,
        opened: Opened | None = None,
    ) -> None:
        """Stream the object's bytes, in order, into ``sink``; verify size and checksum.

        ``opened``: the :meth:`open` that described ``info``; its body is streamed
        rather than asking again (the caller still closes it, if it is not taken).
        Retries transient failures within a bounded budget. With ``rewind``, a body that
        fails its checksum is fetched again whole, within the same budget, after
        ``rewind()``. Raises ``VerifyError`` on a size or checksum mismatch,
        ``FetchTimeout`` when the budget runs out, ``ObjectNotFound`` when the object
        disappeared, ``ObjectChanged`` when it was replaced, ``FetchError`` otherwise.
        """
        ...

    async def fetch_to_file(
        self,
        info: ObjectInfo,
        path: Path,
        *,
        rewind: Rewind | None = None,
        opened: Opened | None = None,
        landed: Callable[[], None] | None = None,
    ) -> None:
        """Write the object's bytes into ``path``: the file then holds exactly the
        verified object, not synced. Retries, ``opened`` and errors as
        :meth:`stream_to_sink`.

        ``landed()`` is called when every byte is in ``path`` and a check over the file
        is left (the MD5 of an ETag): the caller may give back what it holds for the
        transfer (its download slot, D48); a fetch again after a failed check calls
        ``rewind()`` first. A source with no way of its own to write files streams into
        it (:func:`stream_to_file`).
        """
        ...


async def stream_to_file(
    source: Source,
    info: ObjectInfo,
    path: Path,
    *,
    rewind: Rewind | None = None,
    opened: Opened | None = None,
) -> None:
    """:meth:`Source.fetch_to_file` for a source that only streams: its
    :meth:`Source.stream_to_sink` into ``path`` (written in worker threads; a rewind
    empties the file, then calls ``rewind``)."""
    fh: BinaryIO = await asyncio.to_thread(open, path, "wb")

    async def write(run: Sequence[bytes]) -> None:
        await asyncio.to_thread(fh.writelines, run)

    async def again() -> None:
        await asyncio.to_thread(_emptied, fh)
        if rewind is not None:
            await rewind()

    try:
        await source.stream_to_sink(info, write, rewind=again, opened=opened)
    finally:
        await asyncio.to_thread(fh.close)


def _emptied(fh: BinaryIO) -> None:
    fh.seek(0)
    fh.truncate()


class Router:
    """A source made of others: each fetch goes to the one that holds the object
    (:meth:`_reader`), which implements :class:`Source`'s fetches."""

    async def _reader(self, info: ObjectInfo) -> tuple[Source, ObjectInfo]:
        """The source that reads ``info``'s object, and ``info`` as that source knows it."""
        raise NotImplementedError

    async def fetches_to_file(self, info: ObjectInfo, opened: Opened | None = None) -> bool:
        """Whether the object's source writes files itself (see :meth:`Source.fetches_to_file`)."""
        source, read = await self._reader(info)
        return await source.fetches_to_file(read, opened)

    async def stream_to_sink(
        self,
        info: ObjectInfo,
        sink: Sink,
        *,
        rewind: Rewind | None = None,
        opened: Opened | None = None,
    ) -> None:
        """Stream the object from its source into ``sink`` (see :meth:`Source.stream_to_sink`)."""
        source, read = await self._reader(info)
        await source.stream_to_sink(read, sink, rewind=rewind, opened=opened)

    async def fetch_to_file(
        self,
        info: ObjectInfo,
        path: Path,
        *,
        rewind: Rewind | None = None,
        opened: Opened | None = None,
        landed: Callable[[], None] | None = None,
    ) -> None:
        """Write the object from its source into ``path`` (see :meth:`Source.fetch_to_file`)."""
        source, read = await self._reader(info)
        await source.fetch_to_file(read, path, rewind=rewind, opened=opened, landed=landed)


class OwnsStack:
    """An async context manager whose resources live on one :class:`AsyncExitStack`
    (``self._stack``, set by the subclass's ``__aenter__``); leaving closes them all."""

    _stack: AsyncExitStack | None = None

    def _closed(self) -> None:
        """Forget what the stack held (clients, sources); called as it closes."""

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack, self._stack = self._stack, None
        self._closed()
        if stack is not None:
            await stack.aclose()
