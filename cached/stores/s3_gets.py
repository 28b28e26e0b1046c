"""The S3 GETs: one streamed GET for a small object, parallel ranged GETs in a sliding
window for a large one; both hand the sink their bytes in order, checked once as they
pass (:class:`_Verifier`: the store's checksum, else a plain-MD5 ETag, else the size), and
a body damaged in transit is fetched again whole (:meth:`S3Gets._until_intact`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ..errors import VerifyError
from . import checksums
from .base import ObjectInfo, Opened, Rewind, Sink
from .retry import CORRUPT
from .s3_client import S3Client, _Corrupted, _get_object, _s3_location, _SinkFailed

log = logging.getLogger(__name__)

# An ETag that is the object's MD5: single-part uploads (PUT, POST, copy) without SSE-KMS
# or SSE-C. Multipart uploads get "<md5 of the part md5s>-<parts>", which cannot be
# recomputed without knowing the part boundaries the uploader chose, so those objects get
# the size check only (their transport is still covered by TCP and TLS checksums). So do
# encrypted objects whose ETag is not an MD5 although it looks like one: see _etag_is_md5.
_PLAIN_MD5 = re.compile(r"^[0-9a-f]{32}$")
# Hash in a worker thread above this size: hashlib releases the GIL, and a 16 MiB part
# would otherwise hold the event loop for tens of milliseconds.
_HASH_IN_THREAD_BYTES = 1 << 20


class _Verifier:
    """Counts the bytes as they go to the sink and checks each of them once: against the
    store's full-object checksum where the object has one (``info.checksum``: CRC64NVME,
    CRC32C or CRC32, see :mod:`.checksums`), else against a plain-MD5 ETag, else by size
    alone. Bytes are checked in delivery order, so a resumed transfer stays covered."""

    def __init__(self, info: ObjectInfo, verify: bool) -> None:
        self._info = info
        etag = (info.etag or "").strip('"').lower()
        self._store = checksums.Running(info.checksum) if verify and info.checksum else None
        md5 = self._store is None and verify and _PLAIN_MD5.match(etag)
        self._expected_md5 = etag if md5 else None
        self._md5 = hashlib.md5(usedforsecurity=False) if md5 else None
        self.delivered = 0

    def not_md5(self) -> None:
        """The server says the ETag is not an MD5 after all (encryption): size check only."""
        self._md5 = None

    def _hash(self, run: Sequence[bytes]) -> None:
        for data in run:
            if self._store is not None:
                self._store.update(data)
            elif self._md5 is not None:
                self._md5.update(data)

    async def deliver(self, run: Sequence[bytes], sink: Sink) -> None:
        """Check a run of chunks and hand it to the sink, overlapping the two for large
        runs."""
        size = sum(map(len, run))
        self.delivered += size
        if self._store is None and self._md5 is None:
            await sink(run)
        elif size < _HASH_IN_THREAD_BYTES:
            self._hash(run)
            await sink(run)
        else:
            await asyncio.gather(asyncio.to_thread(self._hash, run), sink(run))

    def finish(self) -> None:
        """Raise :class:`VerifyError` unless every byte arrived and the checksum matches."""
        url = self._info.url
        if self.delivered != self._info.size:
            raise VerifyError(
                f"{url}: size mismatch: expected {self._info.size} bytes, got "
                f"{self.delivered}; the object changed or the transfer was cut; fetch it again"
            )
        store = self._store
        if store is not None and not store.matches():
            raise _Corrupted(
                f"{url}: {store.algorithm.upper()} mismatch: expected {store.expected} (the "
                f"store's checksum of the object), got {store.value()}; the bytes were "
                "corrupted in transit; fetch it again"
            )
        if self._md5 is not None:
            got = self._md5.hexdigest()
            if got != self._expected_md5:
                raise _md5_mismatch(url, str(self._expected_md5), got)


def _md5_mismatch(url: str, expected: str, got: str) -> _Corrupted:
    return _Corrupted(
        f"{url}: MD5 mismatch: expected {expected} (the ETag), got {got}; the bytes were "
        "corrupted in transit; fetch it again (if this store's ETags are not MD5s, set "
        "[s3] verify_checksum = false)"
    )


def _etag_is_md5(response: dict[str, Any], aws: bool) -> bool:
    """Whether a GET response's ETag can be an MD5 of the bytes, judging by its encryption.

    SSE-C and SSE-KMS ETags are not MD5s. SSE-S3 (AES256) ETags are on AWS, where every
    object now has it; S3-compatible stores (MinIO) derive theirs differently, so there
    an encrypted object gets the size check only.
    """
    if response.get("SSECustomerAlgorithm"):
        return False
    sse = response.get("ServerSideEncryption")
    return not sse or (sse == "AES256" and aws)


async def _read(body: Any, amount: int) -> bytes:
    data: bytes = await body.read(amount)
    return data


async def _chunk(content: Any) -> bytes:
    """The next chunk of an aiohttp body as it came off the socket (b"" at its end).
    ``read(n)`` would join every chunk buffered so far into new bytes: one more copy of
    every byte, into freshly faulted memory, for nothing (D35)."""
    while True:
        data, end_of_http_chunk = await content.readchunk()
        # (b"", True) marks a chunked encoding's chunk boundary, not the end.
        if data or not end_of_http_chunk:
            return data  # type: ignore[no-any-return]


def _chunks_of(body: Any, amount: int) -> Callable[[], Awaitable[bytes]]:
    """How to take ``body``'s next chunk: as received where the body is aiohttp's,
    else ``read(amount)``."""
    content = getattr(getattr(body, "raw_stream", None), "content", None)
    if content is not None and hasattr(content, "readchunk"):
        return lambda: _chunk(content)
    return lambda: _read(body, amount)


async def _read_span(body: Any, length: int) -> bytes:
    """The next ``length`` bytes of ``body`` (fewer if it ends first), leaving the rest
    unread: the first part of a whole-object GET."""
    chunks: list[bytes] = []
    got = 0
    while got < length:
        data = await _read(body, length - got)
        if not data:
            break
        chunks.append(data)
        got += len(data)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _unsent(opened: Opened | None) -> Callable[[], int]:
    """The requests an attempt sends that reads ``opened``'s body while it has one: none
    (the open's GET, already paid for, answers it), else one."""
    return lambda: 0 if opened is not None and opened.unread else 1


class _OpenedGet(Opened):
    """A GET of a whole object whose headers have arrived (see :meth:`S3Source.open`)."""

    def _discard(self, response: Any) -> None:
        response["Body"].close()


class S3Gets(S3Client):
    """The GETs of :class:`~cached.stores.s3.S3Source` that stream into a sink."""

    async def _stream_verified(
        self, info: ObjectInfo, sink: Sink, opened: Opened | None, rewind: Rewind | None
    ) -> None:
        """The object into ``sink``, checked (see :meth:`S3Source.stream_to_sink`)."""

        async def stream() -> None:
            verifier = _Verifier(info, self._cfg.verify_checksum)
            if info.size > self._cfg.part_size_bytes:
                await self._fetch_parts(info, sink, verifier, opened)
            else:
                await self._fetch_stream(info, sink, verifier, opened)
            verifier.finish()

        attempts = self._policy.attempts if rewind is not None else 1
        await self._until_intact(stream, attempts, rewind)

    async def _until_intact(
        self, fetch: Callable[[], Awaitable[None]], attempts: int, again: Rewind | None
    ) -> None:
        """Run ``fetch`` (one whole fetch) until its bytes pass their checksum, ``attempts``
        times at most, each retry reported as ``corrupt`` and preceded by ``again()``."""
        for attempt in range(1, attempts + 1):
            try:
                await fetch()
                return
            except _Corrupted as exc:
                if attempt == attempts:
                    raise
                log.warning("%s; fetching it again (attempt %d of %d)", exc, attempt + 1, attempts)
            if self._on_retry is not None:
                self._on_retry(CORRUPT)
            await asyncio.sleep(self._policy.backoff_s(attempt))
            if again is not None:
                await again()

    def _get_params(self, info: ObjectInfo, first: int | None, last: int) -> dict[str, str]:
        loc = _s3_location(info.url)
        params = {"Bucket": loc.bucket, "Key": loc.key}
        if first is not None:
            params["Range"] = f"bytes={first}-{last}"
        if info.etag:
            # I20: every GET names the version it continues.
            params["IfMatch"] = f'"{info.etag}"'
        return params

    async def _fetch_stream(
        self, info: ObjectInfo, sink: Sink, verifier: _Verifier, opened: Opened | None
    ) -> None:
        """One GET, streamed in chunks; a retry asks only for the bytes not yet delivered.
        The first attempt reads ``opened``'s body if there is one."""
        client = self._client
        chunk = self.chunk_size_bytes

        async def attempt() -> None:
            start = verifier.delivered
            if info.size > 0 and start >= info.size:
                return
            response = opened.take() if opened is not None else None
            if response is None:
                # The first attempt takes the whole object; a resumed one, the rest of it.
                params = self._get_params(info, start or None, info.size - 1)
                response = await _get_object(client, **params)
            body = response["Body"]
            if not _etag_is_md5(response, self._aws):
                verifier.not_md5()
            async with body:
                expected = info.size - start
                length = int(response.get("ContentLength", expected))
                if length != expected:
                    raise VerifyError(
                        f"{info.url}: size mismatch: expected {info.size} bytes, the server "
                        f"sends {length} from byte {start}; look the object up again"
                    )
                # Chunks come in the sizes the socket gives. They are handed over in
                # runs of about `chunk` bytes (one trip to the writer's thread each),
                # never joined: the one copy of a byte is the write into the file.
                held: list[bytes] = []
                size = 0
                next_chunk = _chunks_of(body, chunk)

                async def flush() -> None:
                    nonlocal size
                    run = tuple(held)
                    held.clear()
                    size = 0
                    try:
                        await verifier.deliver(run, sink)
                    except Exception as exc:
                        raise _SinkFailed(exc) from exc

                while True:
                    try:
                        data = await next_chunk()
                    except Exception:
                        # The bytes that did arrive are good (the checksum still checks
                        # them): hand them over, so that the retry asks only for the rest.
                        if held:
                            await flush()
                        raise
                    if data:
                        held.append(data)
                        size += len(data)
                    if held and (not data or size >= chunk):
                        await flush()
                    if not data:
                        return

        await self._call(f"GET {info.url}", info.url, attempt, _unsent(opened))

    async def _get_part(
        self,
        info: ObjectInfo,
        first: int,
        last: int,
        verifier: _Verifier,
        opened: Opened | None = None,
    ) -> bytes:
        """One ranged GET, retried whole: a part is delivered only once it is complete.
        The first attempt at the first part reads ``opened``'s body if there is one."""
        client = self._client
        params = self._get_params(info, first, last)

        async def attempt() -> bytes:
            whole = opened.take() if opened is not None else None
            response = whole or await _get_object(client, **params)
            if not _etag_is_md5(response, self._aws):
                verifier.not_md5()
            async with response["Body"] as body:
                # A whole-object GET is read up to the part's end and closed there.
                data = await (_read_span(body, last - first + 1) if whole else _read(body, -1))
            if len(data) != last - first + 1:
                raise VerifyError(
                    f"{info.url}: size mismatch in bytes {first}-{last}: expected "
                    f"{last - first + 1} bytes, got {len(data)}; the object is not the "
                    "expected size; look it up again"
                )
            return data

        return await self._call(
            f"GET {info.url} bytes={first}-{last}", info.url, attempt, _unsent(opened)
        )

    async def _fetch_parts(
        self, info: ObjectInfo, sink: Sink, verifier: _Verifier, opened: Opened | None
    ) -> None:
        """Ranged GETs in a sliding window: start parts ahead, hand them over in order.
        The first part comes from ``opened``'s body if there is one."""
        size, step = info.size, self._cfg.part_size_bytes
        ranges = ((a, min(a + step, size) - 1) for a in range(0, size, step))
        window: deque[asyncio.Task[bytes]] = deque()

        def start_next() -> None:
            span = next(ranges, None)
            if span is not None:
                whole = opened if span[0] == 0 else None
                window.append(asyncio.create_task(self._get_part(info, *span, verifier, whole)))

        try:
            for _ in range(self._cfg.part_concurrency):
                start_next()
            while window:
                data = await window[0]
                window.popleft()
                # Refill before the sink works, so the network stays busy while it writes.
                start_next()
                await verifier.deliver((data,), sink)
        finally:
            # On any failure (a part, the sink, cancellation) stop the parts still running.
            for task in window:
                task.cancel()
            await asyncio.gather(*window, return_exceptions=True)
