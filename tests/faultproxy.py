"""A fault-injecting HTTP reverse proxy for tests: real sockets, real failures.

An aiohttp server on 127.0.0.1, port 0, in a background thread with its own event loop,
forwards every request to an upstream S3 endpoint and passes the answer back, unless a
fault is queued. Faults apply to the next matching requests, in the order queued:

- ``slowdown``: answer 503 with S3's ``SlowDown`` XML error;
- ``error``: answer ``status`` with an S3 error body (500 ``InternalError``, 403
  ``AccessDenied``, ...);
- ``cut``: send the headers (the full Content-Length) and ``after_bytes`` of the body,
  wait ``linger_s`` so the client reads them, then close the connection (with
  ``hard=True``: reset it);
- ``stall``: like ``cut`` but hold the connection silent for ``delay_s`` (a read timeout
  mid-body);
- ``delay``: wait ``delay_s`` before the response headers (a read timeout up front);
- ``corrupt``: flip the byte at ``offset`` of the body (same length);
- ``truncate``: drop the last ``drop_bytes`` of the body, with an honest Content-Length;
- ``reset``: reset the connection as soon as the request arrives, before any answer.

A fault for one object only: ``path=`` its key, ``method=None`` (its HEADs too) and a large
``times`` (every request for it fails). :meth:`FaultProxy.refuse` takes the whole endpoint
down (connections refused, open ones reset) until :meth:`FaultProxy.accept`.

``max_requests_per_s`` makes it a store with a request limit: a token bucket of that rate,
holding ``request_burst`` requests, lets requests through and answers the rest 503
SlowDown (seen as fault ``"limited"``), as S3 does above its rate per prefix.

``rate_bps`` shapes the link: response bodies share that many bytes per second, in
64 KiB chunks served first come first served (a slow remote store, like ``tc tbf``).
``latency_s`` delays every answer by that long (time to first byte; ``netem`` is not
available here).

The Host header is forwarded unchanged, so SigV4 signatures made for the proxy's address
stay valid at a real S3-compatible upstream.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import aiohttp
from aiohttp import web

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "date",
        "server",
    }
)
_CHUNK = 64 << 10
_KINDS = ("slowdown", "error", "cut", "stall", "delay", "corrupt", "truncate", "reset")
_CODES = {500: "InternalError", 403: "AccessDenied", 404: "NoSuchKey", 412: "PreconditionFailed"}
_S3_ERROR = (
    '<?xml version="1.0" encoding="UTF-8"?>\n'
    "<Error><Code>{code}</Code><Message>{message}</Message>"
    "<RequestId>faultproxy</RequestId></Error>"
)


@dataclass
class Fault:
    """One queued fault; ``times`` counts down as matching requests take it."""

    kind: str
    times: int = 1
    method: str | None = "GET"
    status: int = 500
    after_bytes: int = 0
    linger_s: float = 0.05
    delay_s: float = 1.0
    offset: int = 0
    drop_bytes: int = 1
    hard: bool = False
    path: str | None = None  # only requests whose path contains this


@dataclass(frozen=True)
class Seen:
    """A request as the proxy saw it, and the fault (if any) it got."""

    method: str
    path: str
    range: str | None
    if_match: str | None
    fault: str | None
    at: float = 0.0  # time.monotonic() when it arrived


@dataclass(frozen=True)
class Load:
    """The requests the proxy answered and refused (SlowDown, over its request limit),
    the most it answered in any one second, and the seconds from the first answered
    request's arrival to the last's."""

    answered: int
    refused: int
    most_in_1s: int
    span_s: float


class FaultProxy:
    """The running proxy: ``endpoint_url`` to point clients at, ``inject`` to break it."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.endpoint_url = ""
        self.seen: list[Seen] = []
        self._faults: list[Fault] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.rate_bps: float | None = None
        self.max_requests_per_s: float | None = None
        self.request_burst = 1.0
        self._request_tokens: float | None = None
        self._request_stamp = 0.0
        self.latency_s = 0.0
        self._link_free_at = 0.0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self._site: web.SockSite | None = None
        self._port = 0
        self.refusing = False
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    @contextmanager
    def start(cls, upstream: str) -> Iterator[FaultProxy]:
        """Run a proxy in front of ``upstream`` for the duration of the block."""
        proxy = cls(upstream)
        proxy._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(proxy._serve(), proxy._loop).result(10)
            yield proxy
        finally:
            with suppress(Exception):
                asyncio.run_coroutine_threadsafe(proxy._shutdown(), proxy._loop).result(10)
            proxy._loop.call_soon_threadsafe(proxy._loop.stop)
            proxy._thread.join(10)
            proxy._loop.close()

    def inject(
        self,
        kind: str,
        *,
        times: int = 1,
        method: str | None = "GET",
        status: int = 500,
        after_bytes: int = 0,
        linger_s: float = 0.05,
        delay_s: float = 1.0,
        offset: int = 0,
        drop_bytes: int = 1,
        hard: bool = False,
        path: str | None = None,
    ) -> None:
        """Queue ``kind`` for the next ``times`` requests with ``method`` (None: any) and,
        if given, a path containing ``path``."""
        if kind not in _KINDS:
            raise ValueError(f"unknown fault {kind!r}; known: {', '.join(_KINDS)}")
        fault = Fault(
            kind,
            times,
            method,
            status,
            after_bytes,
            linger_s,
            delay_s,
            offset,
            drop_bytes,
            hard,
            path,
        )
        with self._lock:
            self._faults.append(fault)

    def refuse(self) -> None:
        """The endpoint goes down: new connections are refused (nothing listens on the
        port), and requests on connections already open are reset."""
        self.refusing = True
        asyncio.run_coroutine_threadsafe(self._stop_listening(), self._loop).result(10)

    def accept(self) -> None:
        """The endpoint is back, on the same address."""
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        self.refusing = False

    def clear(self) -> None:
        """Drop every queued fault."""
        with self._lock:
            self._faults.clear()

    @property
    def faults_left(self) -> int:
        """How many faulty answers are still queued."""
        with self._lock:
            return sum(f.times for f in self._faults)

    def requests(self, method: str | None = None) -> list[Seen]:
        """The requests seen so far (with ``method`` only, if given)."""
        with self._lock:
            return [s for s in self.seen if method is None or s.method == method]

    def limited_load(self) -> Load:
        """What the store did under ``max_requests_per_s`` so far (:class:`Load`)."""
        with self._lock:
            seen = list(self.seen)
        answered = sorted(s.at for s in seen if s.fault != "limited")
        most, left = 0, 0
        for right, at in enumerate(answered):
            while at - answered[left] >= 1.0:
                left += 1
            most = max(most, right - left + 1)
        span = answered[-1] - answered[0] if answered else 0.0
        refused = sum(1 for s in seen if s.fault == "limited")
        return Load(len(answered), refused, most, span)

    @property
    def link_done_at(self) -> float:
        """``time.monotonic()`` when the shaped link (``rate_bps``) sends, or sent, the
        last byte queued on it so far."""
        return self._link_free_at

    def _admit(self) -> bool:
        """Whether the request limit (``max_requests_per_s``) lets one more through now."""
        rate = self.max_requests_per_s
        if rate is None:
            return True
        with self._lock:
            now = time.monotonic()
            if self._request_tokens is None:
                self._request_tokens = self.request_burst
            else:
                elapsed = now - self._request_stamp
                self._request_tokens = min(
                    self.request_burst, self._request_tokens + elapsed * rate
                )
            self._request_stamp = now
            if self._request_tokens < 1.0:
                return False
            self._request_tokens -= 1.0
            return True

    def _take(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if (fault.method is None or fault.method == method) and (
                    fault.path is None or fault.path in path
                ):
                    fault.times -= 1
                    if fault.times <= 0:
                        self._faults.remove(fault)
                    return fault
        return None

    async def _serve(self) -> None:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # Cancel a handler when its client hangs up (a client that timed out on `delay`).
        self._runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5
        )
        await self._runner.setup()
        await self._listen()
        self.endpoint_url = f"http://127.0.0.1:{self._port}"

    async def _listen(self) -> None:
        assert self._runner is not None
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self._port))
        self._port = sock.getsockname()[1]
        self._site = web.SockSite(self._runner, sock)
        await self._site.start()

    async def _stop_listening(self) -> None:
        if self._site is not None:
            await self._site.stop()
            self._site = None

    async def _shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._answer(request)
        finally:
            with self._lock:
                self.in_flight -= 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        if self.refusing:
            _drop(request, hard=True)
            return web.Response(status=500)  # never sent: the connection is gone
        limited = not self._admit()
        fault = None if limited else self._take(request.method, request.path)
        with self._lock:
            self.seen.append(
                Seen(
                    request.method,
                    request.path,
                    request.headers.get("Range"),
                    request.headers.get("If-Match"),
                    "limited" if limited else fault.kind if fault else None,
                    time.monotonic(),
                )
            )
        if limited:
            return _s3_error(503, "SlowDown", "Please reduce your request rate.")
        if fault is not None and fault.kind == "reset":
            _drop(request, hard=True)
            return web.Response(status=500)  # never sent: the connection is gone
        if fault is not None and fault.kind == "slowdown":
            return _s3_error(503, "SlowDown", "Please reduce your request rate.")
        if fault is not None and fault.kind == "error":
            code = _CODES.get(fault.status, f"Error{fault.status}")
            return _s3_error(fault.status, code, "Injected by faultproxy.")
        if fault is not None and fault.kind == "delay":
            await asyncio.sleep(fault.delay_s)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)

        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        async with self._session.request(
            request.method,
            self.upstream + request.raw_path,
            headers=headers,
            data=await request.read() if request.body_exists else None,
            allow_redirects=False,
        ) as upstream:
            body = await upstream.read()
            status, reason = upstream.status, upstream.reason
            up_headers = [
                (k, v) for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP
            ]
            length = upstream.headers.get("Content-Length")

        if fault is not None and fault.kind == "corrupt" and body:
            at = min(fault.offset, len(body) - 1)
            body = body[:at] + bytes([body[at] ^ 0xFF]) + body[at + 1 :]
        if fault is not None and fault.kind == "truncate":
            body = body[: max(0, len(body) - fault.drop_bytes)]

        response = web.StreamResponse(status=status, reason=reason)
        for k, v in up_headers:
            response.headers[k] = v
        # HEAD has no body; its Content-Length must still say the object's size.
        response.content_length = int(length) if request.method == "HEAD" and length else len(body)
        await response.prepare(request)
        if fault is not None and fault.kind in ("cut", "stall"):
            await response.write(body[: fault.after_bytes])
            if fault.kind == "stall":
                await asyncio.sleep(fault.delay_s)
            else:
                await asyncio.sleep(fault.linger_s)  # let the client read what was sent
            _drop(request, hard=fault.hard)
            return response
        if request.method != "HEAD":
            await self._send(response, body)
        await response.write_eof()
        return response

    async def _send(self, response: web.StreamResponse, body: bytes) -> None:
        if not self.rate_bps:
            await response.write(body)
            return
        loop = asyncio.get_running_loop()
        for at in range(0, len(body), _CHUNK):
            chunk = body[at : at + _CHUNK]
            # The link is one queue: each chunk takes its turn at the shaped rate.
            now = loop.time()
            self._link_free_at = max(now, self._link_free_at) + len(chunk) / self.rate_bps
            await asyncio.sleep(self._link_free_at - now)
            await response.write(chunk)


def _drop(request: web.Request, *, hard: bool) -> None:
    """Close the client's connection: FIN (``hard=False``) or RST (``hard=True``)."""
    transport = request.transport
    if transport is None:
        return
    if hard:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # SO_LINGER with a zero timeout turns close() into a reset.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()
    else:
        transport.close()


def _s3_error(status: int, code: str, message: str) -> web.Response:
    return web.Response(
        status=status,
        body=_S3_ERROR.format(code=code, message=message).encode(),
        content_type="application/xml",
    )
