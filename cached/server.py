"""The ZeroMQ ROUTER: client requests -> hot tier -> reply frames (protocol v1).

Each request is handled in its own task, so one client's demand miss never blocks another
client's hits. Payload frames are memoryview slices of the shard's mmap, sent with
``copy=False``: the bytes go from the page cache to the socket without a Python copy.

The socket is a plain (blocking-API) ZeroMQ socket driven from the event loop by its file
descriptor, received from and sent to without blocking: zmq.asyncio's futures, handlers
and flag enums cost more per request than a local reader's open or read itself did
(docs/decisions.md, D30).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import struct
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import zmq
import zmq.asyncio
from cached_client.protocol import (
    PACKED_MEMBER,
    PROTOCOL_VERSION,
    ErrorCode,
    Header,
    Op,
    decode,
    encode,
    encode_value,
    error,
)
from cached_client.protocol import ProtocolError as WireProtocolError
from cached_client.urls import check_all, parse

from . import __version__, socketmode
from .access import DEFAULT_ALLOW, Access
from .errors import CachedError, OutOfRange, ProtocolError, VersionMismatch
from .fetcher import AHEAD, DEMAND, PREFETCH, Fetcher, shard_id
from .jobs import JobBoard, Report
from .metrics import Metrics
from .planner import Plan, Planner, prepare
from .quota import PerClient
from .tiers.hot import HotTier, Shard, ShardCorrupt
from .tiers.index import Member, Sample, ShardIndex

log = logging.getLogger(__name__)

# Plans longer than this are checked and indexed off the event loop (see _plan), and
# headers larger than this are decoded off it.
PLAN_OFFLOAD_URLS = 10_000
DECODE_OFFLOAD_BYTES = 1 << 20

# Requests handled at once; past it the server stops reading and ZeroMQ queues push back.
MAX_ACTIVE_REQUESTS = 1024
# Frames below this are copied into ZeroMQ, larger ones sent zero-copy from the mmap.
# Zero-copy costs a reference hand-off through pyzmq's garbage-collector thread per frame
# (29% of the daemon's CPU at 100 KB frames); a copy of 1 MiB costs less (docs/decisions.md).
COPY_THRESHOLD_BYTES = 1 << 20
# Requests nest two levels (a plan's list of URLs); deeper JSON is refused when decoded, so
# no handler ever walks (or prints) a structure deep enough to exhaust the stack.
MAX_REQUEST_DEPTH = 8
# An open's flags -> how the fetcher treats a miss.
_PRIORITY = {"demand": DEMAND, "prefetch": PREFETCH, "ahead": AHEAD}
T = TypeVar("T")
# What this daemon understands beyond protocol v1's first form, told in the hello reply:
# "release": an open or read may carry the URLs whose pins the stream gives back, which
# saves a local reader one ``close`` request per shard (D26). "whole": a read of all of a
# shard's samples, which may ask to be answered only if the shard is resident (D33).
# "packed": a local read's layout as one binary frame (D34).
FEATURES = ("release", "whole", "packed")
# URLs one request may release (a reader holds a few pins at a time).
MAX_RELEASED = 64
# A reply the client's queue cannot take yet (its high-water mark) is tried again after
# this long, doubling up to the second figure.
SEND_RETRY_S = (0.001, 0.05)
# A stream counts as live this long after its last read or open, lease or not: a reader
# whose reads take whole shards at once holds each lease only for a moment.
ACTIVE_S = 10.0


class Leases:
    """Which stream holds which shard. A held shard is pinned; a lease lapses after a timeout
    without requests, so a killed client cannot pin shards forever."""

    def __init__(self, hot: HotTier, timeout_s: float, per_client: int = 4096) -> None:
        self.hot = hot
        self.timeout_s = timeout_s
        self._held: dict[tuple[str, str], tuple[Shard, float]] = {}
        self._active: dict[str, float] = {}  # stream -> when it last held a shard
        self.quota = PerClient("pinned shards", per_client, "[server] max_leases_per_client")

    def hold(self, stream: str, shard: Shard, client: bytes = b"") -> None:
        """Pin ``shard`` for ``stream`` (once per pair) and refresh the lease. Raises
        :class:`LimitExceeded` when ``client`` already holds its most leases."""
        key = (stream, shard.shard_id)
        if key not in self._held:
            self.quota.admit(client, key)
            self.hot.pin(shard)
        now = time.monotonic()
        self._held[key] = (shard, now + self.timeout_s)
        self._active[stream] = now

    def release(self, stream: str, shard_id: str) -> None:
        """Drop the stream's lease on a shard, if any."""
        held = self._held.pop((stream, shard_id), None)
        if held is not None:
            self.quota.forget((stream, shard_id))
            self.hot.unpin(held[0])

    def expire(self) -> int:
        """Release lapsed leases; returns how many."""
        now = time.monotonic()
        lapsed = [key for key, (_, until) in self._held.items() if until < now]
        for stream, sid in lapsed:
            self.release(stream, sid)
        return len(lapsed)

    def streams(self) -> int:
        """Streams holding a lease, or that held one in the last :data:`ACTIVE_S`."""
        now = time.monotonic()
        for stream in [s for s, at in self._active.items() if now - at > ACTIVE_S]:
            del self._active[stream]
        return len(self._active.keys() | {stream for stream, _ in self._held})


def _request_id(header: Header) -> int | None:
    """The request's ``id``, echoed in the reply: an integer, or absent."""
    value = header.get("id")
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise ProtocolError("request field 'id' must be an integer")


def _op(header: Header) -> str:
    value = header.get("op")
    if not isinstance(value, str):
        raise ProtocolError(f"request field 'op' must be one of {', '.join(Op)}")
    return value


def _checked_plan(key: str, urls: list[Any], cursor: int, job: str) -> Plan:
    """The plan a request announces, its URLs checked (a bad one fails the plan now, not a
    prefetch later). Pure: runs in a worker thread for long plans."""
    if not all(isinstance(u, str) for u in urls):
        raise ProtocolError("request field 'urls' must be a list of strings")
    check_all(urls)
    return prepare(key, urls, cursor=cursor, job=job)


def _str(header: Header, name: str) -> str:
    value = header.get(name)
    if not isinstance(value, str) or not value:
        raise ProtocolError(f"request field {name!r} must be a non-empty string")
    return value


def _url(header: Header) -> str:
    url = _str(header, "url")
    _valid(url)  # ValueError naming the URL: a bad request, not a failed fetch
    return url


@functools.lru_cache(maxsize=1 << 14)  # a reader names each shard in a few requests
def _valid(url: str) -> None:
    """Raise ``ValueError`` naming ``url`` if it is not a shard URL (remembered if it is)."""
    parse(url)


def _released(header: Header) -> list[str]:
    """The ``release`` field: the URLs whose pins the stream gives back with this request."""
    urls = header["release"]
    if not (isinstance(urls, list) and len(urls) <= MAX_RELEASED):
        raise ProtocolError(f"request field 'release' must list at most {MAX_RELEASED} URLs")
    if not all(isinstance(u, str) and u for u in urls):
        raise ProtocolError("request field 'release' must be a list of URLs")
    return urls


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
        max_plans_per_client: int = 64,
        max_leases_per_client: int = 4096,
        status: Callable[[], dict[str, Any]] | None = None,
        planner: Planner | None = None,
        socket_mode: str = "0660",
        socket_group: str | None = None,
        allow: Sequence[str] = DEFAULT_ALLOW,
        jobs: JobBoard | None = None,
        local_reads: bool = True,
    ) -> None:
        self.endpoint = endpoint
        # Answer reads that ask for it with the shard file's layout, not its bytes.
        self.local_reads = local_reads
        self.socket_mode = socket_mode
        self.socket_group = socket_group
        self.access = Access(allow)
        self.fetcher = fetcher
        self.hot = hot
        self.metrics = metrics
        self.leases = Leases(hot, lease_timeout_s, max_leases_per_client)
        self.planner = planner if planner is not None else Planner(lease_timeout_s)
        self.max_plan_shards = max_plan_shards
        self.jobs = jobs if jobs is not None else JobBoard(metrics)
        self.plan_quota = PerClient("plans", max_plans_per_client, "[server] max_plans_per_client")
        self._plans_lock = asyncio.Lock()
        # Request tasks that are opens ahead (hints, not demands): see drain.
        self._hints: set[asyncio.Task[Any]] = set()
        # The planner's deferred notice of cursor moves (see _advance).
        self._flush: asyncio.TimerHandle | None = None
        metrics.requests_in_flight.set_function(lambda: len(self._tasks))
        self.max_read_samples = max_read_samples
        self._status = status or (lambda: {})
        self._ctx = zmq.Context()
        self._sock: zmq.Socket[bytes] | None = None
        # Set when the socket's descriptor signals (or a send saw messages waiting).
        self._readable = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._active = asyncio.Semaphore(MAX_ACTIVE_REQUESTS)
        self.bound_endpoint = endpoint
        # Changes with every start: a client that sees a new one re-sends what it lost.
        self.instance = uuid.uuid4().hex

    async def __aenter__(self) -> Server:
        gid = None
        if self.endpoint.startswith("ipc://"):
            path = Path(self.endpoint[len("ipc://") :])
            gid = socketmode.resolve_group(self.socket_group)  # before a socket exists
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise CachedError(
                    f"cannot create the socket's directory {path.parent} ([server] socket "
                    f"{self.endpoint}): {exc.strerror or exc}; create it for the daemon's user "
                    "(under systemd, RuntimeDirectory= does), or choose another socket"
                ) from exc
            if path.exists() and await _answers(self.endpoint):  # noqa: ASYNC240
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
        try:
            self._set_socket_access(gid)
        except CachedError:
            sock.close(linger=0)
            raise
        self.bound_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        log.info("serving on %s", self.bound_endpoint)
        return self

    def _set_socket_access(self, gid: int | None) -> None:
        """``[server] socket_mode``/``socket_group`` on the ipc socket, whatever the umask."""
        if not self.endpoint.startswith("ipc://"):
            return
        path = self.endpoint[len("ipc://") :]
        if path.startswith("@"):
            # Linux's abstract namespace: no file, no mode; the network namespace decides.
            log.warning("%s is an abstract socket: [server] socket_mode does not apply", path)
            return
        try:
            socketmode.apply(path, self.socket_mode, gid, self.socket_group)
        except CachedError:
            # Ours (bind replaced any file there): not left behind with the umask's mode.
            Path(path).unlink(missing_ok=True)
            raise
        log.info(
            "socket %s: mode %s, group %s",
            path,
            self.socket_mode,
            self.socket_group or "the daemon's",
        )

    async def drain(self, timeout_s: float) -> None:
        """Let the requests under way finish, for up to ``timeout_s``; the ones still
        waiting then (a download that takes longer) are cancelled and answered
        ``shutting_down``. For shutdown, after :meth:`serve` stopped taking requests and
        before the sources close."""
        if not self._tasks:
            return
        # Opens ahead only wait for the prefetcher, which has stopped; their readers may
        # be gone too. Answered at once, so that a stop after a load is not a 5 s stop.
        for task in self._hints:
            task.cancel()
        _, late = await asyncio.wait(set(self._tasks), timeout=timeout_s)
        for task in late:
            task.cancel()
        if late:
            log.info("%d requests still waiting at shutdown: answered shutting_down", len(late))
            # Bounded: a wait_for that completes in the turn of the cancel loses it
            # (Python 3.11), and the request would go on waiting; it gets a second one.
            _, stuck = await asyncio.wait(late, timeout=timeout_s)
            for task in stuck:
                task.cancel()

    async def __aexit__(self, *exc: object) -> None:
        if self._flush is not None:
            self._flush.cancel()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close(linger=0)
        self._ctx.term()

    async def serve(self) -> None:
        """Receive requests until cancelled; each runs in its own task. The descriptor
        signals changes, not messages: every message waiting is taken whenever it does,
        and ``_send`` looks again after each reply (a send may take the signal)."""
        sock = self._sock
        assert sock is not None, "use `async with Server(...)` first"
        fd = cast(int, sock.getsockopt(zmq.FD))
        loop = asyncio.get_running_loop()
        loop.add_reader(fd, self._readable.set)
        try:
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
                except zmq.Again:
                    self._readable.clear()
                    if not _waiting(sock):
                        await self._readable.wait()
                    continue
                await self._active.acquire()
                task = asyncio.create_task(self._handle(frames))
                self._tasks.add(task)
                task.add_done_callback(self._done)
        finally:
            loop.remove_reader(fd)

    async def _send(self, frames: list[Any]) -> None:
        """Send a reply without blocking; one the client's queue cannot take yet is tried
        again a moment later. Raises ``zmq.ZMQError`` for a client that went away."""
        sock = self._sock
        assert sock is not None
        delay, most = SEND_RETRY_S
        while True:
            try:
                sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                pass
            finally:
                if _waiting(sock):
                    self._readable.set()
            await asyncio.sleep(delay)
            delay = min(most, delay * 2)

    async def expire_leases(self) -> None:
        """Release lapsed leases and drop quiet plans periodically, until cancelled."""
        while True:
            await asyncio.sleep(max(0.05, min(self.leases.timeout_s, self.planner.timeout_s) / 4))
            if self.leases.expire():
                log.info("released leases of streams that went quiet")
            async with self._plans_lock:
                dropped = self.planner.drop_lapsed()
                for _ in self.planner.unindexing(dropped):
                    await asyncio.sleep(0)
            if dropped:
                log.info("dropped the plans of streams that went quiet")
                self.plan_quota.retain({plan.key for plan in self.planner.plans()})
            self.metrics.streams.set(self.leases.streams())

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._hints.discard(task)
        self._active.release()

    async def _handle(self, frames: list[bytes]) -> None:
        ident, body = frames[0], frames[1:]
        request_id: Any = None
        op = "?"
        payload: list[Any] = []
        cancelled = False
        try:
            if not body:
                raise ProtocolError("empty message: expected a header frame")
            # A plan of a million URLs is a 40 MB header: parsed off the event loop.
            if len(body[0]) > DECODE_OFFLOAD_BYTES:
                header = await asyncio.to_thread(decode, body[0], max_depth=MAX_REQUEST_DEPTH)
            else:
                header = decode(body[0], max_depth=MAX_REQUEST_DEPTH)
            request_id = _request_id(header)
            op = _op(header)
            if header.get("ahead"):
                task = asyncio.current_task()
                if task is not None:  # a hint: not worth a wait at shutdown (see drain)
                    self._hints.add(task)
            await self._check_access(op, header)
            reply, payload = await self._dispatch(op, header, ident)
            reply["id"] = request_id
            reply["ok"] = True
            result = "ok"
        except asyncio.CancelledError:
            # Shutdown: the client must not wait for an answer that never comes, nor take
            # this for a failure. It re-sends the request to the next daemon.
            message = "the cached daemon is shutting down before it could answer"
            reply, result = error(request_id, ErrorCode.SHUTTING_DOWN, message), "shutting_down"
            cancelled = True
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
        try:
            await self._send([ident, _encode(reply), *payload])
        except zmq.ZMQError as exc:
            # The client went away (EHOSTUNREACH): nothing to deliver, nothing to keep.
            log.debug("reply to a vanished client dropped: %s", exc)
        if cancelled:
            raise asyncio.CancelledError

    async def _check_access(self, op: str, header: Header) -> None:
        """``[server] allow``: every URL the request names, before anything is fetched.
        Fields of the wrong type are left to the op's own checks (``bad_request``)."""
        if op == Op.PLAN:
            named = header.get("urls")
        elif op in (Op.OPEN, Op.READ, Op.CLOSE):
            released = header.get("release")
            named = [header.get("url"), *(released if isinstance(released, list) else [])]
        else:
            return
        # An oversized plan is refused by _plan (bad_request) without this costly walk.
        if isinstance(named, list) and len(named) <= self.max_plan_shards:
            urls = [u for u in named if isinstance(u, str)]
            if op == Op.PLAN or not self.access.settled(urls):
                await self.access.check(urls, remember=op != Op.PLAN)

    async def _dispatch(
        self, op: str, header: Header, client: bytes = b""
    ) -> tuple[Header, list[Any]]:
        """Run one request; ``client`` is the connection's routing id (for the caps)."""
        if op in (Op.OPEN, Op.READ) and "release" in header:
            # First: the pins given back make room for the shard this request may fetch.
            await self._release(_released(header), _str(header, "stream"))
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
                "features": list(FEATURES),
            }, []
        if op == Op.OPEN:
            return await self._open(header, client), []
        if op == Op.READ:
            return await self._read(header, client)
        if op == Op.CLOSE:
            await self._release([_url(header)], _str(header, "stream"))
            return {}, []
        if op == Op.STATUS:
            return {"status": self._status()}, []
        if op == Op.PLAN:
            await self._plan(header, client)
            return {}, []
        if op == Op.REPORT:
            self.jobs.report(Report.parse(header))
            return {}, []
        raise ProtocolError(f"unknown op {op!r}; expected one of {', '.join(Op)}")

    async def _release(self, urls: list[str], stream: str) -> None:
        """The stream is done with these shards: their pins go (``close``, or the
        ``release`` field of its next open or read)."""
        for url in urls:
            info = await self.fetcher.info(url)
            self.leases.release(stream, shard_id(info))

    async def _shard(
        self, header: Header, client: bytes, *, count: bool
    ) -> tuple[Shard, str, bool]:
        """The shard a request names, fetched on a miss, the stream's lease on it, and
        whether it was resident when the request came (a hit). Opens count as hits or
        misses; reads (which follow an open) do not."""
        url, stream = _url(header), _str(header, "stream")
        kind = (
            "ahead" if header.get("ahead") else "prefetch" if header.get("prefetch") else "demand"
        )
        started = time.monotonic()
        # Opens ask the store again after [s3] revalidate_s; reads keep the version known.
        shard, hit = await self.fetcher.ensure(url, _PRIORITY[kind], revalidate=count)
        if count and hit:
            self.metrics.hits.inc()
        elif count:
            self.metrics.misses.labels(kind).inc()
            if kind == "demand":
                self.metrics.demand_wait_seconds.observe(time.monotonic() - started)
        if header.get("pin", True):
            self.leases.hold(stream, shard, client)
        return shard, stream, hit

    async def _plan(self, header: Header, client: bytes) -> None:
        key = _str(header, "plan")
        urls = header.get("urls")
        if not isinstance(urls, list):
            raise ProtocolError("request field 'urls' must be a list of strings")
        if len(urls) > self.max_plan_shards:
            raise ProtocolError(f"a plan may name at most {self.max_plan_shards} shards")
        cursor = _int(header, "cursor") if "cursor" in header else 0
        job = str(header.get("job", ""))
        # A long plan is checked and indexed in a worker thread, then published in steps:
        # a million URLs would otherwise stall every other client for seconds.
        if len(urls) > PLAN_OFFLOAD_URLS:
            plan = await asyncio.to_thread(_checked_plan, key, urls, cursor, job)
        else:
            plan = _checked_plan(key, urls, cursor, job)
        self.plan_quota.admit(client, key)
        async with self._plans_lock:  # one install or expiry at a time
            for _ in self.planner.install(plan):
                await asyncio.sleep(0)

    def _advance(self, header: Header) -> None:
        """Reads name the stream's plan and position: the cursor rides along for free. A
        move the planner does not tell its listeners at once is told a moment later."""
        key = header.get("plan")
        if isinstance(key, str) and key:
            wait = self.planner.advance(key, _int(header, "pos"))
            if wait is not None and self._flush is None:
                self._flush = asyncio.get_running_loop().call_later(wait, self._flushed)

    def _flushed(self) -> None:
        self._flush = None
        self.planner.flush()

    async def _open(self, header: Header, client: bytes) -> Header:
        shard, _, hit = await self._shard(header, client, count=True)
        assert shard.index is not None
        return {
            "url": shard.url,
            "hit": hit,  # resident when the open came
            # Once per shard: lets a client that never waited long enough to ping notice
            # a restart (and tell the new daemon its plan again).
            "instance": self.instance,
            "samples": len(shard.index.samples),
            "size": shard.index.size_bytes,
            "payload": shard.index.payload_bytes,
        }

    def _resident_now(self, header: Header) -> bool:
        """Whether the shard a read names can be served at once, as an open would find it:
        an answer from the store young enough (``[s3] revalidate_s``) and a READY copy,
        and room to pin it ahead: a shard no reader holds yet is pinned this way only
        while pins hold at most half the tier, so that readers' pins ahead never leave
        too little room for the shards they wait for. Nothing is asked of the store,
        fetched or pinned."""
        info = self.fetcher.lookups.fresh(_url(header), revalidate=True)
        shard = self.fetcher.resident(info) if info is not None else None
        if shard is None:
            return False
        hot = self.hot
        return (
            bool(shard.pins) or hot.pinned_total + shard.reserved_bytes <= hot.capacity_bytes // 2
        )

    async def _read(self, header: Header, client: bytes) -> tuple[Header, list[Any]]:
        start = _int(header, "start")
        # A whole read (D33) stands for an open and the read of every sample: it is
        # counted and revalidated as an open, and the daemon's index says how many.
        whole = header.get("whole") is True
        if whole and start != 0:
            raise ProtocolError("a whole read starts at sample 0")
        count = self.max_read_samples if whole else _int(header, "count", low=1)
        if count > self.max_read_samples:
            raise ProtocolError(f"count {count} exceeds the limit of {self.max_read_samples}")
        if whole and header.get("if_resident") is True and not self._resident_now(header):
            return {"resident": False}, []  # the reader asks again when it gets there
        self._advance(header)
        exts = header.get("exts")
        if exts is not None and not (
            isinstance(exts, list) and all(isinstance(e, str) for e in exts)
        ):
            raise ProtocolError("request field 'exts' must be a list of strings")
        wanted = None if exts is None else frozenset(exts)
        # A local reader reads the members from the file itself (and checks them: the
        # reply gives their checksums); the socket carries only this header.
        local = bool(header.get("local")) and self.local_reads
        # FastLoader's compiled reader takes the layout as one frame, not JSON (D34).
        packed = header.get("packed") is True
        for attempt in (1, 2):
            shard, stream, _ = await self._shard(header, client, count=whole and attempt == 1)
            index = shard.index
            assert index is not None
            n = len(index.samples)
            if start > n:
                raise OutOfRange(f"{shard.url} has {n} samples; cannot read from sample {start}")
            if whole and local:
                count = n  # a local reply carries no payload: no bound on its samples
            elif whole and n > count:
                raise ProtocolError(
                    f"{shard.url} has {n} samples, more than one read through the socket may "
                    f"carry ([server] max_read_samples = {count}): read it in parts"
                )
            stop = min(n, start + count)
            if local and packed:
                layout, nbytes = _packed_layout(index, wanted, start, stop)
                frames: list[Any] = [layout.frame]
                break
            if local:
                samples, nbytes = _local_layout(index, wanted, start, stop)
                frames = []
                break
            listed: list[Any] = []
            picked: list[Member] = []
            for sample in index.samples[start:stop]:
                members = _chosen(sample, wanted)
                listed.append([sample.key, [[m.ext, m.size] for m in members]])
                picked.extend(members)
            samples, nbytes = listed, sum(m.size for m in picked)
            try:
                # Checked against their checksums first: rotten bytes are never sent.
                frames = await self.hot.read(shard, picked)
                break
            except ShardCorrupt:
                if attempt == 2:
                    raise
                # The hot tier dropped the rotten copy; _shard fetches a good one.
        reply: Header = {"start": start, "next": stop, "end": stop == n}
        if local and packed:
            reply["packed"] = {"samples": stop - start, "exts": layout.exts}
        else:
            reply["samples"] = samples
        if local:
            # The reader holds the file open past this reply: its lease (the pin that keeps
            # the file from being unlinked under it) goes with its close, not here.
            reply["local"] = self.hot.locate(shard)
            self.metrics.local_read_bytes.inc(nbytes)
        elif stop == n:
            self.leases.release(stream, shard.shard_id)
        if header.get("refetch") is True and not local:
            # A local reply the reader could not use (no file there, a failed checksum),
            # asked again here: counted as served once, with the local reply.
            self.metrics.local_fallback_bytes.inc(nbytes)
        else:
            self.metrics.served_samples.inc(stop - start)
            self.metrics.served_bytes.inc(nbytes)
        return reply, frames


def _waiting(sock: zmq.Socket[bytes]) -> bool:
    """Whether a message waits on ``sock`` (reading its events also re-arms its descriptor)."""
    return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


def _chosen(sample: Sample, wanted: frozenset[str] | None) -> list[Member]:
    """The sample's members a read asked for (``exts``; None: all)."""
    return [m for m in sample.members if wanted is None or m.ext in wanted]


class _Encoded(bytes):
    """A reply field already encoded as JSON (see :func:`_local_layout`)."""


def _encode(reply: Header) -> bytes:
    """The reply's header frame; a ``samples`` already encoded is spliced in as it is."""
    samples = reply.get("samples")
    if not isinstance(samples, _Encoded):
        return encode(reply)
    rest = encode({k: v for k, v in reply.items() if k != "samples"})
    return b"".join((rest[:-1], b',"samples":' if len(rest) > 2 else b'"samples":', samples, b"}"))


def _local_layout(
    index: ShardIndex, wanted: frozenset[str] | None, start: int, stop: int
) -> tuple[Any, int]:
    """A local read's ``samples`` (``[key, [[ext, size, offset, checksum], ...]]``, the
    members in ``wanted``) and their payload bytes. A whole shard's is encoded once and
    kept with the index: a local reader asks for whole shards, every epoch, and listing
    and encoding each member was most of what the daemon still spent on serving it."""

    def make(whole: bool) -> tuple[Any, int]:
        samples: list[Any] = []
        nbytes = 0
        for sample in index.samples[start:stop]:
            members = _chosen(sample, wanted)
            samples.append([sample.key, [[m.ext, m.size, m.offset, m.checksum] for m in members]])
            nbytes += sum(m.size for m in members)
        return (_Encoded(encode_value(samples)) if whole else samples), nbytes

    return _kept_if_whole(index, ("local", wanted), start, stop, make)


def _kept_if_whole(
    index: ShardIndex, key: Any, start: int, stop: int, make: Callable[[bool], T]
) -> T:
    """``make(whole)``, the layout of samples ``start..stop``; a whole shard's is made once
    and kept with the index under ``key`` (``ShardIndex.memo``)."""
    whole = start == 0 and stop == len(index.samples)
    if whole and key in index.memo:
        kept: T = index.memo[key]
        return kept
    made = make(whole)
    if whole:
        index.memo[key] = made
    return made


@dataclass(frozen=True)
class _Packed:
    """A local read's layout as one frame (docs/protocol.md, "Packed layouts"), and the
    names of the extensions its members refer to by index."""

    frame: bytes
    exts: list[str]


def _packed_layout(
    index: ShardIndex, wanted: frozenset[str] | None, start: int, stop: int
) -> tuple[_Packed, int]:
    """The packed layout of samples ``start..stop`` (their members in ``wanted``) and
    their payload bytes; a whole shard's is made once and kept with the index, as
    :func:`_local_layout` keeps its JSON."""

    def make(_whole: bool) -> tuple[_Packed, int]:
        exts: dict[str, int] = {}
        first, key_start = [0], [0]
        records: list[bytes] = []
        keys = bytearray()
        nbytes = 0
        for sample in index.samples[start:stop]:
            members = _chosen(sample, wanted)
            for m in members:
                e = exts.setdefault(m.ext, len(exts))
                has = m.checksum is not None
                records.append(PACKED_MEMBER.pack(e, int(has), m.size, m.offset, m.checksum or 0))
                nbytes += m.size
            first.append(first[-1] + len(members))
            keys += sample.key.encode()
            key_start.append(len(keys))
        count = len(first) - 1
        tables = struct.pack(f"<II{count + 1}I{count + 1}I", count, first[-1], *first, *key_start)
        return _Packed(b"".join((tables, *records, bytes(keys))), list(exts)), nbytes

    return _kept_if_whole(index, ("packed", wanted), start, stop, make)


async def _answers(endpoint: str) -> bool:
    """Whether a daemon already answers at ``endpoint`` (so we must not steal its socket)."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        await sock.send(encode({"op": Op.HELLO, "id": 0, "v": PROTOCOL_VERSION}))
        return bool(await sock.poll(300))
    finally:
        sock.close(linger=0)
        ctx.term()
