"""The warm tier: S3 and S3-compatible stores (MinIO) through one aiobotocore client.

:class:`S3Source` is the rooms below put together, and picks the path a fetch takes:
the client with its error translation (:mod:`.s3_client`), the streamed and ranged GETs
with their checks (:mod:`.s3_gets`), the GET into a file on the native path
(:mod:`.s3_native`), and the uploads (:mod:`.s3_uploads`). :meth:`S3Source.open`
describes an object from a GET's headers, whose body a fetch then reads: a cold object
costs one request, not a HEAD and a GET (docs/decisions.md, D27). Objects in an archive
storage class that are not restored raise :class:`ObjectArchived`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ..errors import ObjectArchived
from . import native
from .base import ObjectInfo, Opened, Rewind, Sink, stream_to_file
from .s3_client import S3Client, _get_object, _s3_location
from .s3_gets import _OpenedGet
from .s3_native import CHECKSUM_PROBES, S3Native, _as_response, _OpenedNative
from .s3_uploads import S3Uploads

__all__ = ["CHECKSUM_PROBES", "S3Client", "S3Source"]


class S3Source(S3Native, S3Uploads):
    """Reads ``s3://bucket/key`` objects; implements :class:`~cached.stores.base.Source`.

    Use as ``async with S3Source(cfg) as src:``. It owns one aiobotocore client, hence
    one connection pool (``max_pool_connections``) for the whole daemon. Credentials come
    from the standard AWS chain. ``on_retry(reason)`` is called for every retry with one
    of :data:`~cached.stores.retry.RETRY_REASONS`, for the daemon's metrics.
    ``pacer`` is the request budget every request to the endpoint takes from (see
    :mod:`.pacing`); None makes one of ``[s3] max_requests_per_s``.
    ``session`` is the ``AioSession`` to create the client from; None makes a fresh one.
    Passing one in lets many short-lived sources (tests) share botocore's parsed service
    models, which otherwise cost about 0.1 s per client.
    """

    async def open(self, url: str, landing: Path | None = None) -> Opened:
        """GET the whole object and stop at its headers: the object as :meth:`head`
        describes it (size, ETag, the store's checksum), and the body, unread, for
        :meth:`stream_to_sink` or :meth:`fetch_to_file` (``opened=``) to read. Close it
        (``async with``) if it is not fetched. Raises as :meth:`head` does.

        ``landing``: a file the native path may write the body into (created; removed
        when the body is not taken). With it, on the native path, the GET is awscrt's,
        its body held back at the CRT until :meth:`fetch_to_file` lets it come into that
        file.
        """
        client = self._require_client()
        loc = _s3_location(url)
        native_client = self._native
        if native_client is not None and landing is not None:

            async def opening() -> Any:
                return await native_client.open(loc.bucket, loc.key, landing)

            op: Callable[[], Awaitable[Any]] = opening
        else:

            async def get() -> Any:
                return await _get_object(client, Bucket=loc.bucket, Key=loc.key)

            op = get
        try:
            response = await self._call(f"GET {url}", url, op)
        except ObjectArchived:
            # A GET's 403 does not say whether a restore is under way; a HEAD does (it
            # raises that ObjectArchived). An error path: the extra request is no cost.
            await self.head(url)
            raise
        if isinstance(response, native.NativeGet):
            try:
                info = self._describe(url, _as_response(response.headers.headers))
            except BaseException:
                response.abort()
                raise
            return _OpenedNative(info, response, self._store_checksum(info))
        try:
            info = self._describe(url, response)
        except BaseException:
            response["Body"].close()
            raise
        return _OpenedGet(info, response)

    def _native_for(self, opened: Opened | None) -> bool:
        """Whether a fetch to a file takes the native path: there is a native client, and
        no body already answering through botocore (read where it is: asking again would
        cost a request and its first bytes' latency)."""
        if self._native is None:
            return False
        return isinstance(opened, _OpenedNative) or not (opened is not None and opened.unread)

    async def fetches_to_file(self, info: ObjectInfo, opened: Opened | None = None) -> bool:
        """Whether :meth:`fetch_to_file` writes the file itself, with no Python per byte
        (the native path, awscrt), rather than streaming it through a sink."""
        return self._native_for(opened)

    async def stream_to_sink(
        self,
        info: ObjectInfo,
        sink: Sink,
        *,
        rewind: Rewind | None = None,
        opened: Opened | None = None,
    ) -> None:
        """Stream the object into ``sink`` in order, then verify size and checksum.

        Objects above ``part_size_bytes`` download as ranged GETs with at most
        ``part_concurrency`` in flight: memory stays within ``(part_concurrency + 1) x
        part_size_bytes``. Every GET carries ``If-Match: <ETag>``, so an object replaced
        mid-download fails with :class:`ObjectChanged` instead of mixing two versions.
        A failed part is retried alone; a failed single GET resumes at the first byte
        the sink has not seen. Exceptions raised by ``sink`` propagate unchanged.

        With ``opened`` (the :meth:`open` that described ``info``) the first attempt
        reads that GET's body, whole or, above ``part_size_bytes``, its first part (the
        rest of it is left unread; the other parts come as ranged GETs); retries and
        the other parts carry ``If-Match`` with the ETag it gave. A native open's body
        has nowhere to go here: it is dropped and botocore asks again.

        A body that fails its checksum (the MD5 of a plain ETag, or an
        ``x-amz-checksum-*`` the store sends) was damaged on the way, in a part that
        cannot be told: with ``rewind`` it is fetched again whole after ``rewind()``, up to
        ``[s3] retry_attempts`` times in all, each retry reported as ``corrupt``;
        without it, or when every attempt is damaged, :class:`VerifyError`.
        """
        self._require_client()
        if isinstance(opened, _OpenedNative):
            held, checksum = opened.take(), opened.take_checksum()
            try:
                if held is not None:
                    held.abort()
            finally:
                # No longer wanted: the botocore GET asks for the checksum itself.
                if checksum is not None:
                    checksum.cancel()
            opened = None
        await self._stream_verified(info, sink, opened, rewind)

    async def fetch_to_file(
        self,
        info: ObjectInfo,
        path: Path,
        *,
        rewind: Rewind | None = None,
        opened: Opened | None = None,
        landed: Callable[[], None] | None = None,
    ) -> None:
        """Write the object into ``path``, verified (size and checksum), not synced.

        On the native path (:meth:`fetches_to_file`) the CRT writes it, with no Python per
        byte; each GET is retried whole, and ``landed()`` is called when every byte is in
        and a check over the file is left (the MD5 of an ETag), ``rewind()`` before a
        fetch again after a failed check. Otherwise the bytes stream into the file as
        :meth:`stream_to_sink` would stream them. Raises as :meth:`stream_to_sink`.
        """
        self._require_client()
        if not self._native_for(opened):
            await stream_to_file(self, info, path, rewind=rewind, opened=opened)
            return
        if not isinstance(opened, _OpenedNative):
            await self._fetch_native(info, path, landed=landed, again=rewind)
            return
        held, checksum = opened.take(), opened.take_checksum()
        try:
            await self._fetch_native(info, path, held, checksum, landed=landed, again=rewind)
        finally:
            # Answered and used, or no longer wanted (a failure first, an empty object).
            if checksum is not None:
                checksum.cancel()
