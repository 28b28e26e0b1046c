"""The ZeroMQ ROUTER: client requests -> hot tier -> reply frames (protocol v1).

Each request is handled in its own task, so one client's demand miss never blocks another
client's hits. Payload frames are memoryview slices of the shard's mmap, sent with
``copy=False``: the bytes go from the page cache to the socket without a Python copy.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from cached_client.protocol import PROTOCOL_VERSION, ErrorCode, Header, Op, decode, encode, error
from cached_client.protocol import ProtocolError as WireProtocolError
from cached_client.urls import parse

from . import __version__
from .errors import CachedError, OutOfRange, ProtocolError, VersionMismatch
from .fetcher import AHEAD, DEMAND, PREFETCH, Fetcher, shard_id
from .metrics import Metrics
from .planner import Planner
from .tiers.hot import HotTier, Shard

log = logging.getLogger(__name__)

# Requests handled at once; past it the server stops reading and ZeroMQ queues push back.
MAX_ACTIVE_REQUESTS = 1024
# Frames below this are copied into ZeroMQ, larger ones sent zero-copy from the mmap.
# Zero-copy costs a reference hand-off through pyzmq's garbage-collector thread per frame
# (29% of the daemon's CPU at 100 KB frames); a copy of 1 MiB costs less (docs/decisions.md).
COPY_THRESHOLD_BYTES = 1 << 20
# An open's flags -> how the fetcher treats a miss.
_PRIORITY = {"demand": DEMAND, "prefetch": PREFETCH, "ahead": AHEAD}


class Leases:
    """Which stream holds which shard. A held shard is pinned; a lease lapses after a timeout
    without requests, so a killed client cannot pin shards forever."""

    def __init__(self, hot: HotTier, timeout_s: float) -> None:
        self.hot = hot
        self.timeout_s = timeout_s
        self._held: dict[tuple[str, str], tuple[Shard, float]] = {}

    def hold(self, stream: str, shard: Shard) -> None:
        """Pin ``shard`` for ``stream`` (once per pair) and refresh the lease."""
        key = (stream, shard.shard_id)
        if key not in self._held:
            self.hot.pin(shard)
        self._held[key] = (shard, time.monotonic() + self.timeout_s)

    def release(self, stream: str, shard_id: str) -> None:
        """Drop the stream's lease on a shard, if any."""
        held = self._held.pop((stream, shard_id), None)
        if held is not None:
            self.hot.unpin(held[0])

    def expire(self) -> int:
        """Release lapsed leases; returns how many."""
        now = time.monotonic()
        lapsed = [key for key, (_, until) in self._held.items() if until < now]
        for stream, sid in lapsed:
            self.release(stream, sid)
        return len(lapsed)

    def streams(self) -> int:
        """Streams holding at least one lease."""
        return len({stream for stream, _ in self._held})


def _str(header: Header, name: str) -> str:
    value = header.get(name)
    if not isinstance(value, str) or not value:
        raise ProtocolError(f"request field {name!r} must be a non-empty string")
    return value


def _url(header: Header) -> str:
    url = _str(header, "url")
    parse(url)  # ValueError naming the URL: a bad request, not a failed fetch
    return url


def _int(header: Header, name: str, low: int = 0) -> int:
    value = header.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ProtocolError(f"request field {name!r} must be an integer >= {low}")
    return value


class Server:
    """Serves protocol v1 on one ZeroMQ endpoint. An async context manager (binds/closes)."""

    def __init__(
        self,
        endpoint: str,
        fetcher: Fetcher,
        hot: HotTier,
        metrics: Metrics,
        *,
        lease_timeout_s: float = 120.0,
        max_read_samples: int = 4096,
        max_plan_shards: int = 1_000_000,
        status: Callable[[], dict[str, Any]] | None = None,
        planner: Planner | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.fetcher = fetcher
        self.hot = hot
        self.metrics = metrics
        self.leases = Leases(hot, lease_timeout_s)
        self.planner = planner if planner is not None else Planner(lease_timeout_s)
        self.max_plan_shards = max_plan_shards
        self.max_read_samples = max_read_samples
        self._status = status or (lambda: {})
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._active = asyncio.Semaphore(MAX_ACTIVE_REQUESTS)
        self.bound_endpoint = endpoint
        # Changes with every start: a client that sees a new one re-sends what it lost.
        self.instance = uuid.uuid4().hex

    async def __aenter__(self) -> Server:
        if self.endpoint.startswith("ipc://"):
            path = Path(self.endpoint[len("ipc://") :])
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise CachedError(
                    f"cannot create the socket's directory {path.parent} ([server] socket "
                    f"{self.endpoint}): {exc.strerror or exc}; create it for the daemon's user "
                    "(under systemd, RuntimeDirectory= does), or choose another socket"
                ) from exc
            if path.exists() and await _answers(self._ctx, self.endpoint):  # noqa: ASYNC240
                raise CachedError(
                    f"another cached daemon is already serving at {self.endpoint}; "
                    "stop it or choose another [server] socket"
                )
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # Replies to a vanished client fail loudly instead of queueing or dropping silently.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.copy_threshold = COPY_THRESHOLD_BYTES
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            raise CachedError(f"cannot bind {self.endpoint}: {exc}") from exc
        self.bound_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        log.info("serving on %s", self.bound_endpoint)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close(linger=0)
        self._ctx.term()

    async def serve(self) -> None:
        """Receive requests until cancelled; each runs in its own task."""
        assert self._sock is not None, "use `async with Server(...)` first"
        while True:
            frames = await self._sock.recv_multipart(copy=True)
            await self._active.acquire()
            task = asyncio.create_task(self._handle(frames))
            self._tasks.add(task)
            task.add_done_callback(self._done)

    async def expire_leases(self) -> None:
        """Release lapsed leases and drop quiet plans periodically, until cancelled."""
        while True:
            await asyncio.sleep(max(0.05, min(self.leases.timeout_s, self.planner.timeout_s) / 4))
            if self.leases.expire():
                log.info("released leases of streams that went quiet")
            if self.planner.expire():
                log.info("dropped the plans of streams that went quiet")
            self.metrics.streams.set(self.leases.streams())

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._active.release()

    async def _handle(self, frames: list[bytes]) -> None:
        ident, body = frames[0], frames[1:]
        request_id: Any = None
        op = "?"
        payload: list[Any] = []
        try:
            if not body:
                raise ProtocolError("empty message: expected a header frame")
            header = decode(body[0])
            request_id = header.get("id")
            op = str(header.get("op"))
            reply, payload = await self._dispatch(op, header)
            reply["id"] = request_id
            reply["ok"] = True
            result = "ok"
        except CachedError as exc:
            reply, result = error(request_id, exc.code, str(exc)), exc.code.value
        except (WireProtocolError, ValueError) as exc:
            reply, result = error(request_id, ErrorCode.BAD_REQUEST, str(exc)), "bad_request"
        except Exception as exc:
            log.exception("request %s failed", op)
            reply, result = (
                error(request_id, ErrorCode.INTERNAL, f"internal error: {exc}"),
                "internal",
            )
        if op not in Op.__members__.values():
            op = "unknown"
        self.metrics.requests.labels(op, result).inc()
        assert self._sock is not None
        try:
            await self._sock.send_multipart([ident, encode(reply), *payload], copy=False)
        except zmq.ZMQError as exc:
            # The client went away (EHOSTUNREACH): nothing to deliver, nothing to keep.
            log.debug("reply to a vanished client dropped: %s", exc)

    async def _dispatch(self, op: str, header: Header) -> tuple[Header, list[Any]]:
        if op == Op.HELLO:
            version = header.get("v")
            if version != PROTOCOL_VERSION:
                raise VersionMismatch(
                    f"client speaks protocol v{version}, this daemon speaks "
                    f"v{PROTOCOL_VERSION}; upgrade cached-client or the daemon"
                )
            return {
                "v": PROTOCOL_VERSION,
                "server": f"cached/{__version__}",
                "instance": self.instance,
            }, []
        if op == Op.OPEN:
            return await self._open(header), []
        if op == Op.READ:
            return await self._read(header)
        if op == Op.CLOSE:
            url = _url(header)
            info = await self.fetcher.info(url)
            self.leases.release(_str(header, "stream"), shard_id(info))
            return {}, []
        if op == Op.STATUS:
            return {"status": self._status()}, []
        if op == Op.PLAN:
            self._plan(header)
            return {}, []
        raise ProtocolError(f"unknown op {op!r}; expected one of {', '.join(Op)}")

    async def _shard(self, header: Header, *, count: bool) -> tuple[Shard, str]:
        """The shard a request names, fetched on a miss, and the stream's lease on it.
        Opens count as hits or misses; reads (which follow an open) do not."""
        url, stream = _url(header), _str(header, "stream")
        kind = (
            "ahead" if header.get("ahead") else "prefetch" if header.get("prefetch") else "demand"
        )
        started = time.monotonic()
        shard, hit = await self.fetcher.ensure(url, _PRIORITY[kind])
        if count and hit:
            self.metrics.hits.inc()
        elif count:
            self.metrics.misses.labels(kind).inc()
            if kind == "demand":
                self.metrics.demand_wait_seconds.observe(time.monotonic() - started)
        if header.get("pin", True):
            self.leases.hold(stream, shard)
        return shard, stream

    def _plan(self, header: Header) -> None:
        key = _str(header, "plan")
        urls = header.get("urls")
        if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
            raise ProtocolError("request field 'urls' must be a list of strings")
        if len(urls) > self.max_plan_shards:
            raise ProtocolError(f"a plan may name at most {self.max_plan_shards} shards")
        for url in set(urls):
            parse(url)  # a bad URL fails the plan now, not a prefetch later
        job = header.get("job", "")
        self.planner.update(
            key, urls, cursor=_int(header, "cursor") if "cursor" in header else 0, job=str(job)
        )

    def _advance(self, header: Header) -> None:
        """Reads name the stream's plan and position: the cursor rides along for free."""
        key = header.get("plan")
        if isinstance(key, str) and key:
            self.planner.advance(key, _int(header, "pos"))

    async def _open(self, header: Header) -> Header:
        shard, _ = await self._shard(header, count=True)
        assert shard.index is not None
        return {
            "url": shard.url,
            # Once per shard: lets a client that never waited long enough to ping notice
            # a restart (and tell the new daemon its plan again).
            "instance": self.instance,
            "samples": len(shard.index.samples),
            "size": shard.index.size_bytes,
            "payload": shard.index.payload_bytes,
        }

    async def _read(self, header: Header) -> tuple[Header, list[Any]]:
        start = _int(header, "start")
        count = _int(header, "count", low=1)
        if count > self.max_read_samples:
            raise ProtocolError(f"count {count} exceeds the limit of {self.max_read_samples}")
        self._advance(header)
        shard, stream = await self._shard(header, count=False)
        index = shard.index
        assert index is not None
        n = len(index.samples)
        if start > n:
            raise OutOfRange(f"{shard.url} has {n} samples; cannot read from sample {start}")
        stop = min(n, start + count)
        exts = header.get("exts")
        if exts is not None and not (
            isinstance(exts, list) and all(isinstance(e, str) for e in exts)
        ):
            raise ProtocolError("request field 'exts' must be a list of strings")
        wanted = None if exts is None else frozenset(exts)
        view = self.hot.view(shard)
        samples: list[Any] = []
        frames: list[memoryview] = []
        nbytes = 0
        for sample in index.samples[start:stop]:
            members = [m for m in sample.members if wanted is None or m.ext in wanted]
            samples.append([sample.key, [[m.ext, m.size] for m in members]])
            for m in members:
                frames.append(view[m.offset : m.offset + m.size])
                nbytes += m.size
        if stop == n:
            self.leases.release(stream, shard.shard_id)
        self.metrics.served_samples.inc(stop - start)
        self.metrics.served_bytes.inc(nbytes)
        return {"start": start, "next": stop, "end": stop == n, "samples": samples}, frames


async def _answers(ctx: zmq.asyncio.Context, endpoint: str) -> bool:
    """Whether a daemon already answers at ``endpoint`` (so we must not steal its socket)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        await sock.send(encode({"op": Op.HELLO, "id": 0, "v": PROTOCOL_VERSION}))
        return bool(await sock.poll(300))
    finally:
        sock.close(linger=0)
