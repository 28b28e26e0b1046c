"""``file:///abs/path`` shards: a local or shared file system as a remote tier.

Blocking calls (stat, open, read) run in worker threads, so a slow network file system
stalls one fetch, never the event loop. The version is ``"<size>-<mtime_ns>"``: there is
no checksum to trust, so the file must keep its size and mtime while it is read.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ..errors import FetchError, ObjectNotFound, VerifyError
from .base import (
    ObjectChanged,
    ObjectInfo,
    Opened,
    OwnsStack,
    Rewind,
    Sink,
    located,
    stream_to_file,
)

ENDPOINT = "file://"
_MIN_CHUNK = 1 << 20
_MAX_CHUNK = 8 << 20


def _path(url: str) -> str:
    return located(url, "file", "a file:// URL").path


def _os_error(url: str, exc: OSError) -> FetchError:
    if isinstance(exc, FileNotFoundError):
        return ObjectNotFound(f"{url}: no such file; check the path")
    if isinstance(exc, PermissionError):
        return FetchError(f"{url}: permission denied; check the daemon user's access to it")
    return FetchError(f"{url}: cannot read: {exc}")


def _version(st: os.stat_result) -> str:
    return f"{st.st_size}-{st.st_mtime_ns}"


class FileSource(OwnsStack):
    """Reads ``file://`` URLs; implements :class:`~cached.stores.base.Source`.

    An async context manager for symmetry with :class:`~cached.stores.s3.S3Source`; it
    holds no resource between calls.
    """

    def __init__(self, chunk_size_bytes: int = 4 << 20) -> None:
        if not _MIN_CHUNK <= chunk_size_bytes <= _MAX_CHUNK:
            raise ValueError(
                f"chunk_size_bytes must be between {_MIN_CHUNK} and {_MAX_CHUNK}, "
                f"not {chunk_size_bytes}"
            )
        self.chunk_size_bytes = chunk_size_bytes

    async def __aenter__(self) -> FileSource:
        return self

    async def head(self, url: str) -> ObjectInfo:
        """Stat the file. Raises :class:`ObjectNotFound` if it is missing."""
        path = _path(url)
        try:
            st = await asyncio.to_thread(os.stat, path)
        except OSError as exc:
            raise _os_error(url, exc) from exc
        if not stat.S_ISREG(st.st_mode):
            raise FetchError(f"{url}: not a regular file")
        return ObjectInfo(url=url, endpoint=ENDPOINT, size=st.st_size, version=_version(st))

    async def open(self, url: str, landing: Path | None = None) -> Opened:
        """:meth:`head`'s answer, holding nothing: a stat costs no round trip to save
        (``landing`` is unused)."""
        return Opened(await self.head(url))

    async def fetches_to_file(self, info: ObjectInfo, opened: Opened | None = None) -> bool:
        """False: a file is copied through Python either way, so a caller's own sink
        (which does its work as the bytes pass) is the cheaper way."""
        return False

    async def fetch_to_file(
        self,
        info: ObjectInfo,
        path: Path,
        *,
        rewind: Rewind | None = None,
        opened: Opened | None = None,
        landed: Callable[[], None] | None = None,
    ) -> None:
        """Copy the file into ``path`` as :meth:`stream_to_sink` streams it (``landed``
        is unused: no check over the file is left)."""
        await stream_to_file(self, info, path, rewind=rewind, opened=opened)

    async def stream_to_sink(
        self,
        info: ObjectInfo,
        sink: Sink,
        *,
        rewind: Rewind | None = None,
        opened: Opened | None = None,
    ) -> None:
        """Stream the file into ``sink`` in chunks, in order.

        Raises :class:`ObjectNotFound` if the file is gone, :class:`VerifyError` if its
        size differs from ``info.size`` (before or while reading), :class:`ObjectChanged`
        if it was rewritten (same size, new mtime) since :meth:`head`. At most
        ``info.size`` bytes ever reach the sink. ``rewind`` is unused: a file has no
        checksum to fail; so is ``opened``, which holds no open file.
        """
        path = _path(info.url)
        try:
            # Unbuffered: each read goes straight into a fresh bytes object for the sink.
            fh: BinaryIO = await asyncio.to_thread(open, path, "rb", buffering=0)
        except OSError as exc:
            raise _os_error(info.url, exc) from exc
        try:
            await self._stream(fh, info, sink)
        except OSError as exc:
            if isinstance(exc, FetchError):
                raise
            raise _os_error(info.url, exc) from exc
        finally:
            fh.close()

    async def _stream(self, fh: BinaryIO, info: ObjectInfo, sink: Sink) -> None:
        before = await asyncio.to_thread(os.fstat, fh.fileno())
        self._check(info, before, "")
        remaining = info.size
        while remaining > 0:
            data = await asyncio.to_thread(fh.read, min(self.chunk_size_bytes, remaining))
            if not data:
                raise VerifyError(
                    f"{info.url}: size mismatch: expected {info.size} bytes, the file ended "
                    f"after {info.size - remaining}; it shrank while being read"
                )
            remaining -= len(data)
            await sink((data,))
        # One more byte tells a file that grew (or is still being written) from a whole one.
        if await asyncio.to_thread(fh.read, 1):
            raise VerifyError(
                f"{info.url}: size mismatch: expected {info.size} bytes, the file is longer; "
                "it grew while being read"
            )
        after = await asyncio.to_thread(os.fstat, fh.fileno())
        self._check(info, after, " while being read")

    @staticmethod
    def _check(info: ObjectInfo, st: os.stat_result, when: str) -> None:
        if st.st_size != info.size:
            raise VerifyError(
                f"{info.url}: size mismatch: expected {info.size} bytes, the file has "
                f"{st.st_size}; it changed{when}; look it up and fetch it again"
            )
        if _version(st) != info.version:
            raise ObjectChanged(
                f"{info.url}: the file changed{when} (version {_version(st)}, expected "
                f"{info.version}); look it up and fetch it again"
            )
