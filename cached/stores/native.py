"""The native fetch path: awscrt's S3 client writes an object's bytes straight to a file.

No Python runs per byte or per chunk: the CRT's threads read the socket and write the
file, and Python sees one headers callback, a progress callback at most once a second,
and the end (docs/decisions.md, D42). The caller (:class:`~cached.stores.s3.S3Source`)
keeps the control plane (HEAD, LIST, credentials) on aiobotocore and its guarantees
around each GET here:

- **retries** are :mod:`.retry`'s, around each whole GET, so that every one is counted
  by reason: the CRT's own are off (``S3RetryMode.NONE``). A failed GET leaves a file
  with holes (parts are written at their offsets as they arrive), so nothing resumes
  from it: the retry fetches the object again whole.
- **checksums**: a full-object CRC32, CRC32C or CRC64NVME the store keeps is checked by
  the CRT as the bytes arrive (``expected_checksum``); a plain-MD5 ETag is checked by
  the caller over the finished file; the size by both.
- **time**: the CRT has only a connect timeout, so each GET gets a deadline here.
- **cancellation**: cancelling the awaiting task cancels the CRT's request and waits for
  its end, so that no CRT thread writes the file after the caller has moved on.

Errors come out as the aiobotocore path's do: an S3 error answer as a botocore
``ClientError`` (so :func:`.retry.transient_reason` and the S3 source's translation
apply unchanged), a dropped connection as ``ConnectionError``, a deadline as
``TimeoutError``, a full disk as ``OSError(ENOSPC)``.

One client per endpoint: the CRT pools connections by host name without the port, so
one client sending to two ports of one host would mix their pools.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import os
import re
import threading
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from botocore import exceptions as boto_exc

from ..config import S3Config
from ..errors import VerifyError
from ..once import seen
from .retry import HoldExpired

try:
    from awscrt import auth, http
    from awscrt import io as crtio
    from awscrt import s3 as crts3
    from awscrt.exceptions import AwsCrtError
except ImportError:  # pragma: no cover - awscrt is a dependency; the aiobotocore path stays
    crts3 = None

# The slowest transfer a GET is allowed before its deadline: [s3] read_timeout_s, plus the
# object's size at this rate. The CRT reports progress per part, not per socket read, so
# a stall cannot be told from a slow part any sooner than this.
SLOWEST_BYTES_PER_S = 1 << 20
# How long a cancelled GET is waited for, at most, before its file is left to the CRT
# (which then writes into an unlinked inode: harmless, freed when it closes the file).
_CANCEL_WAIT_S = 10.0
# The largest part the CRT is given: with 16 MiB parts its threads spent 1.3-1.6 ms of
# kernel time per MB against 0.8 with 8 MiB (its own default), at a lower rate (515-550
# MB/s against 595-625; a /tmp script, 12 x 16 MB from RGW, 4 at once, medians of 4).
CRT_PART_BYTES = 8 << 20
# How long a held GET's CRT thread waits in the headers callback for the event loop to
# let the body come (normally a loop round trip: the tier reserves room at once or not).
HOLD_S = 5.0
# The smallest memory bound the CRT accepts for its part buffers.
_MIN_MEMORY_LIMIT = 256 << 20
_XML_FIELD = re.compile(rb"<(Code|Message)>([^<]*)</\1>")
# CRT errors that say the connection failed (dropped, reset, refused, TLS, DNS): worth a
# new connection, like botocore's connection errors.
_CONNECTION_ERRORS = ("AWS_IO_SOCKET_", "AWS_ERROR_HTTP_", "AWS_IO_DNS_", "AWS_IO_TLS_")
_NO_CONNECTION = frozenset(
    {
        "AWS_IO_SOCKET_CONNECTION_REFUSED",
        "AWS_IO_SOCKET_TIMEOUT",
        "AWS_IO_DNS_INVALID_NAME",
        "AWS_IO_DNS_QUERY_FAILED",
        "AWS_IO_SOCKET_NO_ROUTE_TO_HOST",
        "AWS_IO_SOCKET_NETWORK_DOWN",
    }
)
# Errors whose response had a status: named by the CRT when the body told it nothing more.
_STATUS_OF = {
    "AWS_ERROR_S3_SLOW_DOWN": (503, "SlowDown"),
    "AWS_ERROR_S3_INTERNAL_ERROR": (500, "InternalError"),
}

Credentials = Callable[[], Awaitable[tuple[str, str, str | None] | None]]


def available() -> bool:
    """Whether awscrt's S3 client can be imported here."""
    return crts3 is not None


def unsupported(cfg: S3Config, endpoint_url: str) -> str | None:
    """Why the native path cannot serve ``endpoint_url`` with ``cfg``, or None if it can.

    It cannot where awscrt is missing, where the endpoint has a path (the CRT addresses
    the host only), and where a proxy is configured other than by the environment
    (``HTTP(S)_PROXY``/``NO_PROXY``, which the CRT reads itself): there the aiobotocore
    path fetches, as it always did.
    """
    if not available():
        return "awscrt's S3 client cannot be imported"
    parts = urllib.parse.urlsplit(endpoint_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"the endpoint {endpoint_url} is not an http(s) URL"
    if parts.path not in ("", "/"):
        return f"the endpoint {endpoint_url} has a path"
    return None


def part_size_for(cfg: S3Config) -> int:
    """The part size the CRT is given: ``[s3] part_size``, capped at ``CRT_PART_BYTES``
    (the CRT's CPU, above) unless the store's requests are budgeted (``[s3]
    max_requests_per_s``): there each GET takes a share of the store's request limit,
    so fewer, larger parts fill faster (D45; ``bench/cluster_sim.py --part-mb``)."""
    if cfg.max_requests_per_s:
        return cfg.part_size_bytes
    return min(cfg.part_size_bytes, CRT_PART_BYTES)


@dataclass(frozen=True)
class Got:
    """What a finished GET answered: its status and headers (lower-case names)."""

    status: int
    headers: Mapping[str, str]


class NativeClient:
    """awscrt's ``S3Client`` for one endpoint, writing GETs straight to files.

    ``credentials`` is awaited on the event loop before each GET and returns the
    current ``(access key, secret key, token)``, from the daemon's botocore credential
    chain, so both paths sign as the same principal; None (nothing found) fails the GET
    with botocore's ``NoCredentialsError``. Use :meth:`close` when done.
    """

    def __init__(self, cfg: S3Config, endpoint_url: str, credentials: Credentials) -> None:
        why = unsupported(cfg, endpoint_url)
        if why is not None:
            raise ValueError(f"the native fetch path cannot serve this endpoint: {why}")
        parts = urllib.parse.urlsplit(endpoint_url)
        self._cfg = cfg
        self._host = parts.netloc
        self._virtual = cfg.addressing_style == "virtual"
        self._credentials = credentials
        # The current credentials and a static provider of them, given to each request:
        # the CRT signs its parts with it in C. A delegate provider would call into Python
        # on a CRT thread for every part, each call a hand-off of the GIL.
        self._signer: tuple[tuple[str, str, str | None], Any] | None = None
        elg = crtio.EventLoopGroup(num_threads=min(os.cpu_count() or 1, 4))
        bootstrap = crtio.ClientBootstrap(elg, crtio.DefaultHostResolver(elg))
        secure = parts.scheme == "https"
        part_size = self.part_size = part_size_for(cfg)
        modes = crts3.S3RequestTlsMode
        # No signing config: each request brings its credentials (:meth:`_start`).
        self._client = crts3.S3Client(
            bootstrap=bootstrap,
            region=cfg.region,
            tls_mode=modes.ENABLED if secure else modes.DISABLED,
            tls_connection_options=_tls_options() if secure else None,
            part_size=part_size,
            max_active_connections_override=cfg.max_pool_connections,
            memory_limit=max(_MIN_MEMORY_LIMIT, part_size * cfg.part_concurrency * 2),
            retry_config=crts3.S3RetryConfig(retry_mode=crts3.S3RetryMode.NONE),
            connect_timeout_ms=max(1, round(cfg.connect_timeout_s * 1000)),
        )

    def requests_for(self, size: int) -> int:
        """How many requests a GET of ``size`` bytes sends: one per part, the CRT's
        first (ranged) part included."""
        return max(1, -(-size // self.part_size))

    def close(self) -> None:
        """Drop the client; the CRT shuts its threads down once its requests end."""
        self._client = None

    def _target(self, bucket: str, key: str) -> tuple[str, str]:
        """The Host header and path of ``bucket``/``key`` (path-style unless asked)."""
        quoted = urllib.parse.quote(key, safe="/~")
        if self._virtual:
            return f"{bucket}.{self._host}", f"/{quoted}"
        return self._host, f"/{bucket}/{quoted}"

    async def get(
        self,
        bucket: str,
        key: str,
        path: Path,
        *,
        size: int,
        etag: str | None,
        checksum: str | None,
    ) -> Got:
        """GET ``bucket``/``key`` into ``path`` (created or replaced), whole.

        ``etag`` goes out as ``If-Match`` (on every part); ``checksum``
        (``"algorithm:base64"``) is checked by the CRT as the bytes arrive. Raises as the
        module docstring says; returns once every byte is in the file (not yet synced),
        having checked that ``size`` bytes arrived.
        """
        request = await self._start(bucket, key, path, etag=etag, checksum=checksum, hold=False)
        return await request.finish(size)

    async def open(self, bucket: str, key: str, path: Path) -> NativeGet:
        """GET the whole object into ``path``, and stop at its headers: the body is held
        back (not one byte written) until :meth:`NativeGet.finish`, or dropped by
        :meth:`NativeGet.abort`. One request both describes the object and brings it
        (D27), with no Python per byte. Raises as :meth:`get` does (404, 403...) when the
        store answers with an error instead.

        The CRT gives the headers once its first part (up to :attr:`part_size`) is in its
        memory: a dropped body has crossed the link that far (a whole shard up to 8 MiB),
        and the next GET brings it again."""
        request = await self._start(bucket, key, path, etag=None, checksum=None, hold=True)
        try:
            await request.answered()
        except BaseException:
            await request.cancel()
            await asyncio.to_thread(path.unlink, True)  # missing_ok
            raise
        return request

    async def _start(
        self,
        bucket: str,
        key: str,
        path: Path,
        *,
        etag: str | None,
        checksum: str | None,
        hold: bool,
    ) -> NativeGet:
        client = self._client
        if client is None:
            raise RuntimeError("the native S3 client is closed")
        current = await self._credentials()
        if current is None:
            raise boto_exc.NoCredentialsError()
        if self._signer is None or self._signer[0] != current:
            self._signer = (current, auth.AwsCredentialsProvider.new_static(*current))
        host, target = self._target(bucket, key)
        headers = [("Host", host)]
        if etag:
            # I20: every GET names the version it continues.
            headers.append(("If-Match", f'"{etag}"'))
        checksum_config = _checksum_config(checksum)
        # The CRT opens the file inside make_request, on this thread: creating it there
        # (an inode allocated) took 7 % of the event loop's time in a fill of 4 MB shards
        # (py-spy). Created first in a worker thread, the CRT's open only truncates it. A
        # file left by a cancel here is empty, and goes with its caller's clean-up or at
        # the next start (a .partial).
        await asyncio.to_thread(path.touch)
        got = NativeGet(path, self._cfg.read_timeout_s, hold)
        got.request = client.make_request(
            type=crts3.S3RequestType.GET_OBJECT,
            request=http.HttpRequest("GET", target, http.HttpHeaders(headers)),
            recv_filepath=str(path),
            credential_provider=self._signer[1],
            checksum_config=checksum_config,
            on_headers=got.on_headers,
            on_progress=got.on_progress,
        )
        got.finished = asyncio.wrap_future(got.request.finished_future)
        # A dropped body's request ends with an error nobody awaits (abort() does not wait).
        got.finished.add_done_callback(seen)
        # On the CRT's thread, or here if it is over already: even with no loop left.
        got.request.finished_future.add_done_callback(got.ended)
        return got


class NativeGet:
    """One GET of the native client, writing into :attr:`path`.

    Its callbacks run on CRT threads. Held (``hold``), the headers callback waits there,
    for :data:`HOLD_S` at most, until the event loop lets the body come (:meth:`finish`)
    or drops it (:meth:`abort`): no byte lands on disk before the caller decided (the
    tier's hard bound). The first part is in the CRT's memory by then (its memory limit
    bounds it), and while the callback waits, that CRT thread serves none of its other
    connections.
    """

    def __init__(self, path: Path, read_timeout_s: float, hold: bool) -> None:
        self.path = path
        self.request: Any = None
        self.finished: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._read_timeout_s = read_timeout_s
        self._loop = asyncio.get_running_loop()
        self._answer: asyncio.Future[Got] = self._loop.create_future()
        self._hold = hold
        self._go = threading.Event()
        self._dropped = False
        # Set on the CRT's thread when the hold ran out before the caller decided.
        self._expired = False
        self._received = 0

    # -- on CRT threads ------------------------------------------------------------------

    def on_headers(self, status_code: int, headers: list[tuple[str, str]], **_: Any) -> None:
        got = Got(status_code, {k.lower(): v for k, v in headers})
        self._loop.call_soon_threadsafe(_settle, self._answer, got)
        if not self._hold or status_code >= 300:
            return
        if not self._go.wait(HOLD_S):
            self._expired = True
            # Raised here, it ends the request: the CRT reports it as the failure.
            raise _Dropped(f"the body was not let come within {HOLD_S:.0f}s")
        if self._dropped:
            raise _Dropped("the body was not wanted")

    def on_progress(self, progress: int) -> None:
        self._received += progress

    def ended(self, _: object) -> None:
        """The request is over: let go of it, and of the file if it was dropped. The CRT's
        request holds these callbacks (bound to this object) from native code, where the
        garbage collector cannot see the cycle; held, it would keep the client, its
        threads and sockets alive after :meth:`NativeClient.close`."""
        self.request = None
        if self._dropped:
            # The CRT may have created the file as the request ended (it opens it for the
            # first part it delivers), after :meth:`abort` removed it.
            _unlink(self.path)

    # -- on the event loop ---------------------------------------------------------------

    async def answered(self) -> Got:
        """The headers, once they came; raises what the request failed with before."""
        await asyncio.wait({self._answer, self.finished}, return_when=asyncio.FIRST_COMPLETED)
        if self._answer.done():
            if self._answer.result().status < 300:
                return self._answer.result()
            # An error's headers (404, 403...): the request fails with the store's error,
            # which says what it was, as botocore's would.
            await asyncio.wait({self.finished}, timeout=self._read_timeout_s)
            if not self.finished.done():
                await self.cancel()
                raise TimeoutError(
                    f"the GET answered {self._answer.result().status} and did not end"
                )
        try:
            self.finished.result()
        except Exception as exc:
            raise _translated(exc) from exc
        raise ConnectionError("the GET ended without an answer")

    @property
    def headers(self) -> Got:
        """The headers (after :meth:`answered`)."""
        return self._answer.result()

    def abort(self) -> None:
        """Drop a held body unread: the request ends (not awaited), and the file goes."""
        self._dropped = True
        self._go.set()
        _unlink(self.path)  # and again as the request ends (:meth:`ended`)

    async def cancel(self) -> None:
        """End the request and wait for it (bounded): no CRT thread writes the file after."""
        self._dropped = True
        self._go.set()
        if self.request is not None:
            await _cancelled(self.request, self.finished)

    async def finish(self, size: int) -> Got:
        """Let a held body come, and wait for the end of the request, within its deadline
        (``read_timeout_s`` plus the size at :data:`SLOWEST_BYTES_PER_S`). Checks that
        ``size`` bytes arrived."""
        self._go.set()
        deadline = self._read_timeout_s + size / SLOWEST_BYTES_PER_S
        try:
            async with asyncio.timeout(deadline):
                await asyncio.shield(self.finished)
        except TimeoutError:
            await self.cancel()
            raise TimeoutError(
                f"GET took more than {deadline:.1f}s ([s3] read_timeout_s, plus the "
                f"size at {SLOWEST_BYTES_PER_S >> 20} MiB/s)"
            ) from None
        except asyncio.CancelledError:
            await self.cancel()
            raise
        except Exception as exc:
            if self._expired:
                # The caller took longer than the hold (room, the request budget): the
                # store's answer is gone; the retry asks again (If-Match), counted.
                raise HoldExpired(
                    f"the GET's body was held past {HOLD_S:.0f}s and dropped; fetching it again"
                ) from exc
            raise _translated(exc) from exc
        if self._received != size:
            # A part shorter than asked (a store that answered a range with fewer bytes
            # and an honest length) leaves a hole the CRT does not notice.
            raise VerifyError(
                f"size mismatch: expected {size} bytes, {self._received} arrived; the object "
                "is not the expected size; look it up again"
            )
        return self._answer.result() if self._answer.done() else Got(0, {})


class _Dropped(Exception):
    """A held body its caller did not want (or did not decide on within HOLD_S: then
    :meth:`NativeGet.finish` raises :class:`~.retry.HoldExpired` instead)."""


def _unlink(path: Path) -> None:
    with suppress(OSError):
        path.unlink()


def _settle(future: asyncio.Future[Got], got: Got) -> None:
    if not future.done():
        future.set_result(got)


async def _cancelled(request: Any, finished: asyncio.Future[Any]) -> None:
    """Cancel the CRT's request and wait (bounded, even if cancelled again) for its end:
    the CRT has then closed the file."""
    request.cancel()
    with suppress(BaseException):
        await asyncio.wait_for(asyncio.shield(finished), _CANCEL_WAIT_S)


def _checksum_config(checksum: str | None) -> Any:
    """The CRT's check of a full-object checksum, or None."""
    if checksum is None:
        return None
    algorithm, _, value = checksum.partition(":")
    enum = {
        "crc64nvme": crts3.S3ChecksumAlgorithm.CRC64NVME,
        "crc32c": crts3.S3ChecksumAlgorithm.CRC32C,
        "crc32": crts3.S3ChecksumAlgorithm.CRC32,
    }.get(algorithm)
    if enum is None or not value:
        return None
    base64.b64decode(value, validate=True)  # a malformed value fails here, not in C
    return crts3.S3ChecksumConfig(expected_checksum=value, expected_checksum_algorithm=enum)


def _tls_options() -> Any:
    """The CRT's TLS options: the system's trust store, or ``AWS_CA_BUNDLE``'s, as
    botocore would use."""
    options = crtio.TlsContextOptions()
    bundle = os.environ.get("AWS_CA_BUNDLE")
    if bundle:
        options.override_default_trust_store_from_path(None, bundle)
    return crtio.ClientTlsContext(options).new_connection_options()


class Corrupted(Exception):
    """The CRT found the body's checksum wrong (the caller raises its own VerifyError)."""


def _translated(exc: BaseException) -> BaseException:
    """A CRT failure as the aiobotocore path would have raised it."""
    original = exc  # awscrt is untyped: past the isinstance checks, exc is Any
    if isinstance(exc, crts3.S3ResponseError):
        fields = dict(_XML_FIELD.findall(bytes(exc.body or b"")))
        status = int(exc.status_code or 0)
        code = fields.get(b"Code", b"").decode(errors="replace")
        if not code and exc.name in _STATUS_OF:
            status, code = _STATUS_OF[exc.name]
        message = fields.get(b"Message", b"").decode(errors="replace")
        return _client_error(status, code or str(status), message)
    if not isinstance(exc, AwsCrtError):
        return exc
    name = exc.name
    if name in _STATUS_OF:
        return _client_error(*_STATUS_OF[name], "")
    if name == "AWS_ERROR_S3_RESPONSE_CHECKSUM_MISMATCH":
        return Corrupted(exc.message)
    if name == "AWS_ERROR_NO_SPACE":
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if name in _NO_CONNECTION:
        return ConnectionRefusedError(f"could not connect to the endpoint ({name}: {exc.message})")
    if name.startswith(_CONNECTION_ERRORS):
        return ConnectionError(f"{name}: {exc.message}")
    return original


def _client_error(status: int, code: str, message: str) -> Exception:
    """An S3 error answer as botocore raises it."""
    response = {
        "Error": {"Code": code, "Message": message},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    error: Exception = boto_exc.ClientError(response, "GetObject")
    return error
