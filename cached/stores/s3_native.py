"""The glue between :class:`~cached.stores.s3.S3Source` and the native path
(:mod:`.native`, awscrt): a native GET held at its headers, the HEAD that asks the store
for the checksum a ranged GET cannot carry, and the GET into a file with its checks over
the file (the store's checksum, else the MD5 of a plain ETag).
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import mmap
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from . import checksums, native
from .base import ObjectChanged, ObjectInfo, Opened, Rewind
from .s3_client import _Corrupted, _s3_location
from .s3_gets import _PLAIN_MD5, S3Gets, _etag_is_md5, _md5_mismatch

# HEADs that find no full-object checksum, none having found one, before a native open
# stops asking for one where the ETag is an MD5 (the store keeps none: RGW 16.2, older
# MinIO); see S3Source._store_checksum.
CHECKSUM_PROBES = 4


class _OpenedNative(Opened):
    """A native GET held at its headers (see :meth:`S3Source.open` ``landing``), and the
    HEAD that asks for the store's checksum of it, if one does
    (:meth:`S3Source._store_checksum`)."""

    def __init__(
        self, info: ObjectInfo, response: Any, checksum: asyncio.Future[str | None] | None
    ) -> None:
        super().__init__(info, response)
        self.checksum = checksum

    def take_checksum(self) -> asyncio.Future[str | None] | None:
        """The HEAD's answer to come, once (its taker awaits or cancels it)."""
        checksum, self.checksum = self.checksum, None
        return checksum

    def _discard(self, response: Any) -> None:
        response.abort()
        checksum = self.take_checksum()
        if checksum is not None:
            checksum.cancel()


def _as_response(headers: Mapping[str, str]) -> dict[str, Any]:
    """A native GET's headers (lower-case names) as botocore's response fields that
    :meth:`S3Source._describe` and :func:`_etag_is_md5` read."""
    response: dict[str, Any] = {
        "ContentLength": int(headers.get("content-length", -1)),
        "ServerSideEncryption": headers.get("x-amz-server-side-encryption"),
        "SSECustomerAlgorithm": headers.get("x-amz-server-side-encryption-customer-algorithm"),
    }
    if "etag" in headers:
        response["ETag"] = headers["etag"]
    if "last-modified" in headers:
        with suppress(TypeError, ValueError):
            response["LastModified"] = email.utils.parsedate_to_datetime(headers["last-modified"])
    for name, value in headers.items():
        if name.startswith("x-amz-checksum-") and name != "x-amz-checksum-type":
            response["Checksum" + name.removeprefix("x-amz-checksum-").upper()] = value
    if "x-amz-checksum-type" in headers:
        response["ChecksumType"] = headers["x-amz-checksum-type"]
    return response


@contextmanager
def _mapped(path: Path) -> Iterator[memoryview]:
    """A file's bytes, mapped read-only (blocking; an empty file is an empty view), for
    one hashing call over all of them without the GIL."""
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            yield memoryview(b"")
            return
        with mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as mapped, memoryview(mapped) as view:
            yield view


def _land(landing: Path, path: Path, checksum: str | None) -> bool:
    """Move a native open's body from its landing file to ``path`` (one worker thread for
    both steps); whether it matches ``checksum`` (``"algorithm:base64"``; None: nothing to
    check), which the open's GET knew nothing of to give the CRT."""
    os.replace(landing, path)
    return checksum is None or _file_matches(path, checksum)


def _file_matches(path: Path, checksum: str) -> bool:
    """Whether a file's bytes have the store's checksum ``"algorithm:base64"`` (blocking)."""
    running = checksums.Running(checksum)
    with _mapped(path) as view:
        running.update(view)
    return running.matches()


def _md5_of_file(path: Path) -> str:
    """The MD5 of a file, hex (blocking)."""
    with _mapped(path) as view:
        return hashlib.md5(view, usedforsecurity=False).hexdigest()


class S3Native(S3Gets):
    """The native half of :class:`~cached.stores.s3.S3Source`: GETs into a file."""

    def _store_checksum(self, info: ObjectInfo) -> asyncio.Future[str | None] | None:
        """The store's full-object checksum of a native open's object, asked for by a HEAD
        that runs while the body comes (no latency added); None where none is asked for.

        The open's GET is ranged (the CRT's first part), and no store sends a full-object
        checksum with a range. An ETag that is no MD5 (a multipart upload's) leaves only the
        size without one, so a HEAD always asks. A plain-MD5 ETag checks the bytes too, at
        1.4 ms of CPU per MB against 0.05 for a CRC64NVME (D47): with ``[s3]
        checksum_head`` a HEAD asks there too, one more request per object, unless the
        store is known to keep none (the first :data:`CHECKSUM_PROBES` HEADs found none:
        RGW 16.2).
        """
        if not self._cfg.verify_checksum:
            return None
        if _PLAIN_MD5.match((info.etag or "").lower()):
            if not self._cfg.checksum_head or self._keeps_checksums is False:
                return None
            if self._keeps_checksums is None:
                if self._checksum_probes >= CHECKSUM_PROBES:
                    return None  # enough asked already: their answers will tell
                self._checksum_probes += 1
        head = asyncio.ensure_future(self._checksum_by_head(info))
        # A HEAD whose fetch failed first is cancelled, not awaited: its own failure, if
        # any, is no news then (and asyncio would log it as never retrieved).
        head.add_done_callback(lambda done: done.cancelled() or done.exception())
        return head

    async def _checksum_by_head(self, info: ObjectInfo) -> str | None:
        described = await self.head(info.url)
        if described.version != info.version:
            raise ObjectChanged(f"{info.url}: the object changed while it was opened")
        if described.checksum is not None:
            self._keeps_checksums = True
        elif self._keeps_checksums is None:
            self._checksum_misses += 1
            if self._checksum_misses >= CHECKSUM_PROBES:
                self._keeps_checksums = False
        return described.checksum

    async def _fetch_native(
        self,
        info: ObjectInfo,
        path: Path,
        held: native.NativeGet | None = None,
        asked: asyncio.Future[str | None] | None = None,
        *,
        landed: Callable[[], None] | None = None,
        again: Rewind | None = None,
    ) -> None:
        """GET the object into ``path`` through the native client, and verify it: the
        store's checksum by the CRT, else the MD5 of a plain ETag over the file, and the
        size. Each GET is retried whole (a failed one leaves holes, not a prefix).
        ``held``: the open's GET (:meth:`open`), whose body comes first, into its landing
        file, which then replaces ``path`` (held past its hold, a fresh GET brings it:
        ``hold_expired``); ``asked``, the HEAD for the checksum it could not ask the CRT
        for, is awaited once the body is in (its checksum, in C over the file, stands for
        the MD5). ``landed``, ``again``: :meth:`fetch_to_file`'s ``landed`` and ``rewind``,
        around the MD5 over the file."""
        client = self._native
        assert client is not None
        if info.size == 0:
            # The CRT would spend two GETs (a 416 to its ranged first part, then the
            # whole); there is nothing to fetch, and an empty file is no tar either.
            if held is not None:
                held.abort()
            await asyncio.to_thread(path.write_bytes, b"")
            return
        loc = _s3_location(info.url)
        verify = self._cfg.verify_checksum
        checksum = info.checksum if verify else None
        etag = (info.etag or "").lower()

        async def get() -> native.Got:
            nonlocal held, asked, checksum
            first, held = held, None
            if first is None:
                head, asked = asked, None
                checksum = (head and await head) or checksum
                return await client.get(
                    loc.bucket, loc.key, path, size=info.size, etag=info.etag, checksum=checksum
                )
            try:
                got = await first.finish(info.size)
                head, asked = asked, None
                checksum = (head and await head) or checksum  # later attempts: the CRT checks it
                intact = await asyncio.to_thread(_land, first.path, path, checksum)
            except BaseException:
                first.path.unlink(missing_ok=True)
                raise
            if not intact:
                raise native.Corrupted(f"{(checksum or '').partition(':')[0].upper()} mismatch")
            return got

        def parts() -> int:
            # The open's GET sent (and paid for) the first part of the held one.
            return client.requests_for(info.size) - (held is not None)

        async def fetch() -> None:
            try:
                got = await self._call(f"GET {info.url}", info.url, get, parts)
            except native.Corrupted as exc:
                raise _Corrupted(
                    f"{info.url}: {exc}; the bytes were corrupted in transit; fetch it again"
                ) from exc
            md5 = checksum is None and verify and _PLAIN_MD5.match(etag)
            if md5 and _etag_is_md5(_as_response(got.headers), self._aws):
                if landed is not None:
                    landed()  # the hash reads the file, not the link
                found = await asyncio.to_thread(_md5_of_file, path)
                if found != etag:
                    raise _md5_mismatch(info.url, etag, found)

        try:
            await self._until_intact(fetch, self._policy.attempts, again)
        finally:
            if held is not None:  # the open's GET never ran (a failure before it)
                held.abort()
