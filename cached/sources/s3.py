"""The warm tier: S3 and S3-compatible stores (MinIO) through one aiobotocore client.

Large objects download as parallel ranged GETs in a sliding window, small ones as one
streamed GET; both hand the sink their bytes in order and verify size and, where the
ETag allows, MD5. Every request runs under the bounded retries of :mod:`.retry`.
:meth:`S3Source.open` describes an object from a GET's headers, whose body
:meth:`S3Source.fetch` then streams: a cold object costs one request, not a HEAD and a
GET (docs/decisions.md, D27).
Objects in an archive storage class that are not restored raise :class:`ObjectArchived`.
:meth:`S3Source.put` uploads a local file (the cold tier's promotion to the warm tier).
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import logging
import math
import mmap
import os
import re
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

from aiobotocore.config import AioConfig
from aiobotocore.httpsession import AIOHTTPSession
from aiobotocore.session import AioSession
from botocore import exceptions as boto_exc
from cached_wire.urls import ShardURL, parse

from ..config import S3Config
from ..errors import CachedError, FetchError, ObjectArchived, ObjectNotFound, VerifyError
from . import checksums, native
from .base import ObjectChanged, ObjectInfo, Opened, OwnsStack, Rewind, Sink
from .pacing import RequestPacer
from .retry import CORRUPT, OnRetry, RetryPolicy, retrying

T = TypeVar("T")
log = logging.getLogger(__name__)

# An ETag that is the object's MD5: single-part uploads (PUT, POST, copy) without SSE-KMS
# or SSE-C. Multipart uploads get "<md5 of the part md5s>-<parts>", which cannot be
# recomputed without knowing the part boundaries the uploader chose, so those objects get
# the size check only (their transport is still covered by TCP and TLS checksums). So do
# encrypted objects whose ETag is not an MD5 although it looks like one: see _etag_is_md5.
_PLAIN_MD5 = re.compile(r"^[0-9a-f]{32}$")
# HEADs that find no full-object checksum, none having found one, before a native open
# stops asking for one where the ETag is an MD5 (the store keeps none: RGW 16.2, older
# MinIO); see S3Source._store_checksum.
CHECKSUM_PROBES = 4
# Hash in a worker thread above this size: hashlib releases the GIL, and a 16 MiB part
# would otherwise hold the event loop for tens of milliseconds.
_HASH_IN_THREAD_BYTES = 1 << 20
_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NoSuchBucket", "NotFound"})
_DENIED_CODES = frozenset({"403", "AccessDenied", "Forbidden", "InvalidAccessKeyId"})
_CHANGED_CODES = frozenset({"412", "PreconditionFailed"})
# Storage classes whose objects must be restored before a GET works. GLACIER_IR (Instant
# Retrieval) is not among them: it reads like STANDARD.
_ARCHIVE_CLASSES = frozenset({"GLACIER", "DEEP_ARCHIVE"})
# Intelligent-Tiering's opt-in archive tiers: StorageClass stays INTELLIGENT_TIERING.
_ARCHIVE_STATUSES = frozenset({"ARCHIVE_ACCESS", "DEEP_ARCHIVE_ACCESS"})
# S3's multipart limits: every part but the last at least 5 MiB, at most 10,000 parts.
_MIN_UPLOAD_PART = 5 << 20
_MAX_UPLOAD_PARTS = 10_000
_MAX_PUT = 5 << 30  # the largest single PUT S3 accepts


class _Corrupted(VerifyError):
    """The body failed its checksum (its MD5 against the ETag, or a checksum the store
    sent with it): bytes were damaged in transit. Worth another try: the stored copy
    matched that checksum when it was written."""


class _SinkFailed(Exception):
    """Carries an exception raised by the caller's sink through the retry loop untouched."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


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


def _status_and_code(exc: boto_exc.ClientError) -> tuple[int, str, str]:
    response: dict[str, Any] = exc.response or {}
    error: dict[str, Any] = response.get("Error", {})
    code = str(error.get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if not isinstance(status, int):
        status = int(code) if code.isdigit() else 0
    # Ceph RGW sends an empty <Message> (botocore: None); the code says it all there.
    return status, code, str(error.get("Message") or "")


def _archived(url: str, storage_class: str, restore: str | None) -> ObjectArchived:
    if restore is not None and 'ongoing-request="true"' in restore:
        state = "a restore is in progress; wait for it to finish"
    else:
        state = "not restored; restore it (aws s3api restore-object)"
    return ObjectArchived(
        f"{url} is archived ({storage_class}) and {state}, or configure [cold] "
        "to read it from a cold tier"
    )


def _archive_state(response: dict[str, Any]) -> str | None:
    """The archive class of a HEAD response's object if it cannot be read now, else None.

    A finished restore (``Restore: ongoing-request="false", expiry-date=...``) leaves a
    readable copy while the object keeps its storage class, so it counts as readable.
    """
    storage = str(response.get("StorageClass") or "")
    status = str(response.get("ArchiveStatus") or "")
    if storage not in _ARCHIVE_CLASSES and status not in _ARCHIVE_STATUSES:
        return None
    restore = response.get("Restore")
    if restore is not None and 'ongoing-request="false"' in str(restore):
        return None
    return status or storage


def _translate(exc: Exception, url: str, endpoint: str) -> Exception:
    """Map a permanent botocore failure to the daemon's errors, saying what to do next."""
    if isinstance(exc, CachedError):
        return exc
    if isinstance(exc, boto_exc.ClientError):
        status, code, message = _status_and_code(exc)
        if code == "InvalidObjectState":
            # A GET of an archived object: S3 answers 403, which is not "access denied".
            error: dict[str, Any] = (exc.response or {}).get("Error", {})
            return _archived(url, str(error.get("StorageClass") or "archive"), None)
        if status == 404 or code in _NOT_FOUND_CODES:
            return ObjectNotFound(
                f"{url}: not found at {endpoint} ({code or status}); "
                "check the URL and that the bucket exists"
            )
        if status == 403 or code in _DENIED_CODES:
            return FetchError(
                f"{url}: access denied by {endpoint} ({code or status}); check the AWS "
                "credentials the daemon runs with and the bucket policy"
            )
        if status == 412 or code in _CHANGED_CODES:
            return ObjectChanged(
                f"{url}: the object changed since it was looked up (its ETag no longer "
                "matches); look it up and fetch it again"
            )
        if status == 416 or code == "InvalidRange":
            return VerifyError(
                f"{url}: the object is shorter than the expected size; it changed since "
                "it was looked up; look it up and fetch it again"
            )
        detail = f": {message}" if message else ""
        return FetchError(f"{url}: {endpoint} answered {status} {code}{detail}")
    if isinstance(exc, boto_exc.NoCredentialsError | boto_exc.PartialCredentialsError):
        return FetchError(
            f"{url}: no usable AWS credentials: set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or give the node a role"
        )
    if isinstance(exc, boto_exc.FlexibleChecksumError):
        # The store sent a checksum of the body (x-amz-checksum-*) and the body did not
        # match it: damaged in transit, like an MD5 mismatch.
        return _Corrupted(f"{url}: checksum mismatch reported by botocore: {exc}")
    if isinstance(exc, boto_exc.BotoCoreError):
        return FetchError(f"{url}: {type(exc).__name__}: {exc}")
    return exc


# aiobotocore is untyped: these helpers give its two calls a typed edge.
async def _head_object(client: Any, bucket: str, key: str, checksum: bool) -> dict[str, Any]:
    # With ChecksumMode the store includes its full-object checksum (S3 sends it only when
    # asked; stores that do not know the header ignore it).
    extra = {"ChecksumMode": "ENABLED"} if checksum else {}
    response: dict[str, Any] = await client.head_object(Bucket=bucket, Key=key, **extra)
    return response


async def _get_object(client: Any, **params: str) -> dict[str, Any]:
    response: dict[str, Any] = await client.get_object(**params)
    return response


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


def _ask_for_checksum(params: dict[str, Any], **_: Any) -> None:
    """botocore hook: a whole-object GET asks for the store's full-object checksum.

    A header rather than the ``ChecksumMode`` parameter, which would also make botocore
    hash the body (the verifier does that, once; D24). Ranged GETs carry no full-object
    checksum, so they do not ask.
    """
    headers = params.setdefault("headers", {})
    if "Range" not in headers:
        headers["x-amz-checksum-mode"] = "ENABLED"


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


def _unsent(opened: Opened | None) -> Callable[[], int]:
    """The requests an attempt sends that reads ``opened``'s body while it has one: none
    (the open's GET, already paid for, answers it), else one."""
    return lambda: 0 if opened is not None and opened.unread else 1


class _OpenedGet(Opened):
    """A GET of a whole object whose headers have arrived (see :meth:`S3Source.open`)."""

    def _discard(self, response: Any) -> None:
        response["Body"].close()


async def _request(method: Any, **params: Any) -> dict[str, Any]:
    """Any other client call (the upload ones), with a typed result."""
    response: dict[str, Any] = await method(**params)
    return response


def _exists_already(exc: BaseException) -> bool:
    """Whether a conditional write (``If-None-Match: *``) failed because the key exists.

    412: it exists. 409 ConditionalRequestConflict: another writer is completing the
    same key right now; either way someone else's copy wins and ours is not needed.
    """
    if not isinstance(exc, boto_exc.ClientError):
        return False
    status, code, _ = _status_and_code(exc)
    return status == 412 or code in _CHANGED_CODES or code == "ConditionalRequestConflict"


def _read_exactly(fd: int, length: int, offset: int, path: Path) -> bytes:
    """``length`` bytes of ``fd`` at ``offset``; VerifyError if the file is shorter."""
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise VerifyError(
            f"{path}: expected {length} bytes at offset {offset}, read {len(data)}; "
            "the file shrank while being uploaded"
        )
    return data


class _HTTPSession(AIOHTTPSession):  # type: ignore[misc]  # aiobotocore is untyped
    """aiobotocore's HTTP session, with aiohttp's own retry switched off.

    aiohttp sends a GET or HEAD once more when its connection fails before the answer
    (ClientOSError, ServerDisconnectedError: RFC 9112's retry on a persistent connection).
    That retry is outside the budget of :mod:`.retry` and uncounted in
    ``cached_fetch_retries_total``; the budget's own retry covers the same failure.
    """

    async def _get_session(self, proxy_url: Any) -> Any:
        session = await super()._get_session(proxy_url)
        # Private in aiohttp; tests/test_fault_isolation.py fails if it stops working.
        session._retry_connection = False
        return session


class S3Source(OwnsStack):
    """Reads ``s3://bucket/key`` objects; implements :class:`~cached.sources.base.Source`.

    Use as ``async with S3Source(cfg) as src:``. It owns one aiobotocore client, hence
    one connection pool (``max_pool_connections``) for the whole daemon. Credentials come
    from the standard AWS chain. ``on_retry(reason)`` is called for every retry with one
    of :data:`~cached.sources.retry.RETRY_REASONS`, for the daemon's metrics.
    ``pacer`` is the request budget every request to the endpoint takes from (see
    :mod:`.pacing`); None makes one of ``[s3] max_requests_per_s``.
    ``session`` is the ``AioSession`` to create the client from; None makes a fresh one.
    Passing one in lets many short-lived sources (tests) share botocore's parsed service
    models, which otherwise cost about 0.1 s per client.
    """

    def __init__(
        self,
        cfg: S3Config,
        on_retry: OnRetry | None = None,
        *,
        session: Any = None,
        pacer: RequestPacer | None = None,
    ) -> None:
        if cfg.part_size_bytes <= 0 or cfg.part_concurrency <= 0:
            raise ValueError("part_size_bytes and part_concurrency must be positive")
        self._cfg = cfg
        self._policy = RetryPolicy.from_s3_config(cfg)
        self.pacer = pacer if pacer is not None else RequestPacer(cfg.max_requests_per_s)
        self._on_retry = on_retry
        self._session = session
        self._stack: AsyncExitStack | None = None
        self._client: Any = None
        self._native: native.NativeClient | None = None
        self._endpoint = ""
        self._aws = cfg.endpoint_url is None
        # Whether the store keeps full-object checksums (None: not known yet), learned from
        # the HEADs a native open sends for them (:meth:`_store_checksum`): how many were
        # sent to find out, and how many found none.
        self._keeps_checksums: bool | None = None
        self._checksum_probes = 0
        self._checksum_misses = 0
        # Reads from a streamed GET are gathered up to this size before the sink sees them:
        # fewer, larger writes and checksum calls downstream (bench/fetch_cpu.py, in git
        # history: 4 MiB took 0.95 ms of CPU per MB against 1.14 at 1 MiB), while memory
        # stays small.
        self.chunk_size_bytes = min(cfg.part_size_bytes, 4 << 20)

    async def __aenter__(self) -> S3Source:
        config = AioConfig(
            s3={"addressing_style": self._cfg.addressing_style},
            max_pool_connections=self._cfg.max_pool_connections,
            connect_timeout=self._cfg.connect_timeout_s,
            read_timeout=self._cfg.read_timeout_s,
            # Ours are explicit and bounded (see retry.py); botocore's would multiply them.
            retries={"total_max_attempts": 1},
            http_session_cls=_HTTPSession,
            # Bodies are checked once, by _Verifier, against the checksum the HEAD gave;
            # botocore checking them too would hash every byte twice.
            response_checksum_validation="when_required",
        )
        async with AsyncExitStack() as stack:
            self._client = await stack.enter_async_context(
                (self._session or AioSession()).create_client(
                    "s3",
                    endpoint_url=self._cfg.endpoint_url,
                    region_name=self._cfg.region,
                    config=config,
                )
            )
            self._endpoint = str(self._client.meta.endpoint_url)
            if self._cfg.verify_checksum:
                self._client.meta.events.register("before-call.s3.GetObject", _ask_for_checksum)
            self._native = self._native_client()
            self._stack = stack.pop_all()
        return self

    def _native_client(self) -> native.NativeClient | None:
        """awscrt's client for this endpoint, if ``[s3] native_fetch`` asks for it and it
        can serve the endpoint (else None, and GETs stream through aiobotocore)."""
        if not self._cfg.native_fetch:
            return None
        why = native.unsupported(self._cfg, self._endpoint)
        if why is not None:
            log.info("fetching through botocore, not the native path: %s", why)
            return None
        return native.NativeClient(self._cfg, self._endpoint, self._frozen_credentials)

    async def _frozen_credentials(self) -> tuple[str, str, str | None] | None:
        """The credentials botocore signs with now (refreshed by it when they expire), for
        the native client to sign with too; None: none were found."""
        # Private in botocore: the one credential object the client signs with, so both
        # paths sign as the same principal whatever the chain found.
        credentials = getattr(self._client._request_signer, "_credentials", None)
        if credentials is None:
            return None
        frozen = await credentials.get_frozen_credentials()
        return frozen.access_key, frozen.secret_key, frozen.token

    @property
    def fetches_natively(self) -> bool:
        """Whether GETs into a file take the native path (awscrt), not aiobotocore."""
        return self._native is not None

    def _closed(self) -> None:
        if self._native is not None:
            self._native.close()
        self._native = None
        self._client = None

    @property
    def endpoint(self) -> str:
        """The endpoint URL the client talks to (part of every object's cache identity)."""
        return self._endpoint

    def _require_client(self) -> Any:
        if self._client is None:
            raise RuntimeError("S3Source is not open: use `async with S3Source(cfg) as src`")
        return self._client

    async def _call(
        self,
        what: str,
        url: str,
        op: Callable[[], Awaitable[T]],
        cost: Callable[[], int] | None = None,
    ) -> T:
        """One request under the retry budget and the request budget, permanent errors
        translated. ``cost()``: the requests the next attempt sends (1 without it)."""
        try:
            return await retrying(
                op,
                policy=self._policy,
                what=what,
                on_retry=self._on_retry,
                pacer=self.pacer,
                cost=cost,
            )
        except _SinkFailed as failed:
            # The sink's own error, as it raised it: not ours to retry or rename.
            raise failed.error from failed.error.__cause__
        except Exception as exc:
            translated = _translate(exc, url, self._endpoint)
            if translated is exc:
                raise
            raise translated from exc

    async def head(self, url: str) -> ObjectInfo:
        """Look the object up: its size, and its ETag as the version.

        Raises :class:`ObjectNotFound` (404, no retries), :class:`FetchError` (403 and
        other failures), :class:`FetchTimeout` when the retry budget runs out on timeouts.
        """
        client = self._require_client()
        loc = _s3_location(url)
        verify = self._cfg.verify_checksum
        response = await self._call(
            f"HEAD {url}", url, lambda: _head_object(client, loc.bucket, loc.key, verify)
        )
        archived = _archive_state(response)
        if archived is not None:
            restore = response.get("Restore")
            raise _archived(url, archived, None if restore is None else str(restore))
        return self._describe(url, response)

    async def open(self, url: str, landing: Path | None = None) -> Opened:
        """GET the whole object and stop at its headers: the object as :meth:`head`
        describes it (size, ETag, the store's checksum), and the body, unread, for
        :meth:`fetch` (``opened=``) to stream. Close it (``async with``) if it is not
        fetched. Raises as :meth:`head` does.

        ``landing``: a file the native path may write the body into (created; removed
        when the body is not taken). With it, on the native path, the GET is awscrt's,
        its body held back at the CRT until :meth:`fetch` lets it come into that file.
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

    def _describe(self, url: str, response: dict[str, Any]) -> ObjectInfo:
        """The object as a HEAD's, or a whole-object GET's, headers describe it."""
        size = int(response["ContentLength"])
        etag = str(response.get("ETag", "")).strip('"') or None
        if etag is None:
            # Some S3-compatible stores omit the ETag; fall back to the file-like identity.
            modified = response.get("LastModified")
            stamp = modified.timestamp() if modified is not None else 0
            version = f"{size}-{stamp}"
        else:
            version = etag
        return ObjectInfo(
            url=url,
            endpoint=self._endpoint,
            size=size,
            version=version,
            etag=etag,
            checksum=checksums.from_response(response) if self._cfg.verify_checksum else None,
        )

    async def fetch(
        self,
        info: ObjectInfo,
        sink: Sink,
        *,
        rewind: Rewind | None = None,
        opened: Opened | None = None,
        into: Path | None = None,
        landed: Callable[[], None] | None = None,
    ) -> bool:
        """Stream the object into ``sink`` in order, then verify size and (plain) MD5.

        Objects above ``part_size_bytes`` download as ranged GETs with at most
        ``part_concurrency`` in flight: memory stays within ``(part_concurrency + 1) x
        part_size_bytes``. Every GET carries ``If-Match: <ETag>``, so an object replaced
        mid-download fails with :class:`ObjectChanged` instead of mixing two versions.
        A failed part is retried alone; a failed single GET resumes at the first byte
        the sink has not seen. Exceptions raised by ``sink`` propagate unchanged.

        With ``opened`` (the :meth:`open` that described ``info``) the first attempt
        reads that GET's body, whole or, above ``part_size_bytes``, its first part (the
        rest of it is left unread; the other parts come as ranged GETs); retries and
        the other parts carry ``If-Match`` with the ETag it gave.

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
                if into is not None and self._native is not None:
                    await self._fetch_native(
                        info, into, held, checksum, landed=landed, again=rewind
                    )
                    return True
                if held is not None:
                    held.abort()  # nowhere to write it natively: botocore asks again
            finally:
                # Answered and used, or no longer wanted (a failure first, an empty object,
                # or the botocore GET, which asks for the checksum itself).
                if checksum is not None:
                    checksum.cancel()
            opened = None
        elif into is not None and self._native is not None and not (opened and opened.unread):
            # A body already answering through botocore is read where it is: asking
            # again would cost a request and its first bytes' latency.
            await self._fetch_native(info, into, landed=landed, again=rewind)
            return True

        async def stream() -> None:
            verifier = _Verifier(info, self._cfg.verify_checksum)
            if info.size > self._cfg.part_size_bytes:
                await self._fetch_parts(info, sink, verifier, opened)
            else:
                await self._fetch_stream(info, sink, verifier, opened)
            verifier.finish()

        attempts = self._policy.attempts if rewind is not None else 1
        await self._until_intact(stream, attempts, rewind)
        return False

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
        the MD5). ``landed``, ``again``: :meth:`fetch`'s, around the MD5 over the file."""
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

    def upload_part_size(self, size: int) -> int:
        """The part size :meth:`put` uses for a ``size``-byte multipart upload.

        ``[s3] part_size``, raised to S3's 5 MiB minimum (every part but the last) and
        to whatever keeps the upload within 10,000 parts.
        """
        return max(self._cfg.part_size_bytes, _MIN_UPLOAD_PART, math.ceil(size / _MAX_UPLOAD_PARTS))

    async def put(self, url: str, path: Path, size: int, *, if_absent: bool = False) -> None:
        """Upload the local file ``path``, which must hold ``size`` bytes, to ``url``.

        A file of at most ``[s3] part_size`` goes up as one PUT; a larger one as a
        multipart upload of :meth:`upload_part_size` parts, at most ``part_concurrency``
        in flight (memory stays within that many parts). The file is read in worker
        threads; every request runs under the retry budget, and a failed or cancelled
        multipart upload is aborted so that its parts are not left behind (and billed).

        ``if_absent`` makes the write conditional (``If-None-Match: *``): if the key
        exists by the time the upload completes, it is left as it is and ``put`` returns
        without error. That also makes a retried write safe when the first attempt did
        land but its answer was lost.

        Raises :class:`VerifyError` if the file is not ``size`` bytes, :class:`FetchError`
        (or its subclasses, as for reads) when the store refuses or keeps failing.
        """
        client = self._require_client()
        loc = _s3_location(url)
        fd = await asyncio.to_thread(os.open, path, os.O_RDONLY)
        try:
            actual = (await asyncio.to_thread(os.fstat, fd)).st_size
            if actual != size:
                raise VerifyError(
                    f"{path}: expected {size} bytes to upload to {url}, the file has "
                    f"{actual}; it changed since it was written"
                )
            condition = {"IfNoneMatch": "*"} if if_absent else {}
            if size <= min(self._cfg.part_size_bytes, _MAX_PUT):
                data = await asyncio.to_thread(_read_exactly, fd, size, 0, path)

                async def put_once() -> bool:
                    try:
                        await _request(
                            client.put_object,
                            Bucket=loc.bucket,
                            Key=loc.key,
                            Body=data,
                            **condition,
                        )
                    except Exception as exc:
                        if if_absent and _exists_already(exc):
                            return False
                        raise
                    return True

                written = await self._call(f"PUT {url}", url, put_once)
            else:
                written = await self._put_multipart(url, fd, path, size, condition=condition)
        finally:
            os.close(fd)
        if not written:
            log.info("%s already exists; not overwritten", url)

    async def _put_multipart(
        self, url: str, fd: int, path: Path, size: int, *, condition: dict[str, str]
    ) -> bool:
        """The multipart half of :meth:`put`; False if the key exists (``condition``)."""
        client = self._require_client()
        loc = _s3_location(url)
        key = {"Bucket": loc.bucket, "Key": loc.key}
        created = await self._call(
            f"POST {url}?uploads",
            url,
            lambda: _request(client.create_multipart_upload, **key),
        )
        upload_id = str(created["UploadId"])
        step = self.upload_part_size(size)
        slots = asyncio.Semaphore(self._cfg.part_concurrency)

        async def upload(number: int, offset: int) -> dict[str, Any]:
            async with slots:  # the read is inside, so memory holds only the parts in flight
                data = await asyncio.to_thread(
                    _read_exactly, fd, min(step, size - offset), offset, path
                )
                response = await self._call(
                    f"PUT {url} part {number}",
                    url,
                    lambda: _request(
                        client.upload_part,
                        **key,
                        UploadId=upload_id,
                        PartNumber=number,
                        Body=data,
                    ),
                )
            return {"PartNumber": number, "ETag": response["ETag"]}

        async def complete(parts: list[dict[str, Any]]) -> bool:
            if condition and await self._exists(client, key):
                return False
            try:
                await _request(
                    client.complete_multipart_upload,
                    **key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                    **condition,
                )
            except Exception as exc:
                if condition and _exists_already(exc):
                    return False
                raise
            return True

        completed = False
        try:
            tasks = [
                asyncio.create_task(upload(n, offset))
                for n, offset in enumerate(range(0, size, step), start=1)
            ]
            try:
                parts = await asyncio.gather(*tasks)
            finally:
                # On any failure stop the parts still running before aborting the upload.
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            completed = await self._call(f"POST {url}?uploadId", url, lambda: complete(list(parts)))
            return completed
        finally:
            if not completed:
                # Also when the key already existed: a refused completion leaves the
                # upload open. Shielded, so that a cancelled put still cleans up.
                await asyncio.shield(self._abort(client, url, key, upload_id))

    async def _exists(self, client: Any, key: dict[str, str]) -> bool:
        """Whether the key exists now: the check before a conditional completion.

        Ceph RGW 16.2 ignores ``If-None-Match`` on CompleteMultipartUpload (it honours it
        on PUT) and would overwrite an object that appeared meanwhile. The HEAD narrows
        that race to one round trip; where the header works, the store still decides.
        Errors other than 404 propagate, to the retry budget of the completion.
        """
        try:
            await _request(client.head_object, **key)
        except boto_exc.ClientError as exc:
            if _status_and_code(exc)[0] == 404:
                return False
            raise
        return True

    async def _abort(self, client: Any, url: str, key: dict[str, str], upload_id: str) -> None:
        """Best effort: one attempt; a bucket lifecycle rule catches what this misses."""
        with suppress(Exception):
            await _request(client.abort_multipart_upload, **key, UploadId=upload_id)
            return
        log.warning(
            "%s: could not abort multipart upload %s; its parts remain until a lifecycle "
            "rule (AbortIncompleteMultipartUpload) removes them",
            url,
            upload_id,
        )

    def _get_params(self, info: ObjectInfo, first: int | None, last: int) -> dict[str, str]:
        loc = _s3_location(info.url)
        params = {"Bucket": loc.bucket, "Key": loc.key}
        if first is not None:
            params["Range"] = f"bytes={first}-{last}"
        if info.etag:
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


def _s3_location(url: str) -> ShardURL:
    try:
        parsed = parse(url)
    except ValueError as exc:
        raise FetchError(str(exc)) from exc
    if parsed.scheme != "s3":
        raise FetchError(f"{url}: not an s3:// URL")
    return parsed
