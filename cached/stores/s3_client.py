"""The S3 client: one aiobotocore client per endpoint, every request under the retry
and request budgets, and botocore's failures translated into the daemon's errors.

:class:`S3Client` owns the client (and awscrt's, for the native path, :mod:`.native`),
looks objects up (HEAD) and describes them from a response's headers. The GETs
(:mod:`.s3_gets`), the native glue (:mod:`.s3_native`) and the uploads
(:mod:`.s3_uploads`) build on it; :class:`~cached.stores.s3.S3Source` is all of them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any, Self, TypeVar

from aiobotocore.config import AioConfig
from aiobotocore.httpsession import AIOHTTPSession
from aiobotocore.session import AioSession
from botocore import exceptions as boto_exc
from cached_wire.urls import ShardURL

from ..config import S3Config
from ..errors import CachedError, FetchError, ObjectArchived, ObjectNotFound, VerifyError
from . import checksums, native
from .base import ObjectChanged, ObjectInfo, OwnsStack, located
from .pacing import RequestPacer
from .retry import OnRetry, RetryPolicy, retrying

T = TypeVar("T")
log = logging.getLogger(__name__)

_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NoSuchBucket", "NotFound"})
_DENIED_CODES = frozenset({"403", "AccessDenied", "Forbidden", "InvalidAccessKeyId"})
_CHANGED_CODES = frozenset({"412", "PreconditionFailed"})
# Storage classes whose objects must be restored before a GET works. GLACIER_IR (Instant
# Retrieval) is not among them: it reads like STANDARD.
_ARCHIVE_CLASSES = frozenset({"GLACIER", "DEEP_ARCHIVE"})
# Intelligent-Tiering's opt-in archive tiers: StorageClass stays INTELLIGENT_TIERING.
_ARCHIVE_STATUSES = frozenset({"ARCHIVE_ACCESS", "DEEP_ARCHIVE_ACCESS"})


class _Corrupted(VerifyError):
    """The body failed its checksum (its MD5 against the ETag, or a checksum the store
    sent with it): bytes were damaged in transit. Worth another try: the stored copy
    matched that checksum when it was written."""


class _SinkFailed(Exception):
    """Carries an exception raised by the caller's sink through the retry loop untouched."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


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


def _ask_for_checksum(params: dict[str, Any], **_: Any) -> None:
    """botocore hook: a whole-object GET asks for the store's full-object checksum.

    A header rather than the ``ChecksumMode`` parameter, which would also make botocore
    hash the body (the verifier does that, once; D24). Ranged GETs carry no full-object
    checksum, so they do not ask.
    """
    headers = params.setdefault("headers", {})
    if "Range" not in headers:
        headers["x-amz-checksum-mode"] = "ENABLED"


async def _request(method: Any, **params: Any) -> dict[str, Any]:
    """Any other client call (the upload ones), with a typed result."""
    response: dict[str, Any] = await method(**params)
    return response


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


def _s3_location(url: str) -> ShardURL:
    return located(url, "s3", "an s3:// URL")


class S3Client(OwnsStack):
    """The client half of :class:`~cached.stores.s3.S3Source`: the aiobotocore client
    (and awscrt's, where ``[s3] native_fetch`` asks for it), the request under its
    budgets (:meth:`_call`), the HEAD and the description of an object from headers.

    ``on_retry(reason)`` is called for every retry with one of
    :data:`~cached.stores.retry.RETRY_REASONS`; ``pacer`` is the endpoint's request
    budget (:mod:`.pacing`; None makes one of ``[s3] max_requests_per_s``); ``session``
    the ``AioSession`` to create the client from (None: a fresh one).
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

    async def __aenter__(self) -> Self:
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
