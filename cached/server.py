"""The ZeroMQ ROUTER: client requests -> hot tier -> reply frames (protocol v1).

Each request is handled in its own task, so one client's demand miss never blocks another
client's hits. Each payload frame is one member read by ``preadv`` into its own ZeroMQ
message (``pread.read_members``), sent as it is: one copy, from the page cache; a local
reader gets the file and a packed layout instead (``layouts.py``).

The socket is a plain (blocking-API) ZeroMQ socket driven from the event loop by its file
descriptor, received from and sent to without blocking: zmq.asyncio's futures, handlers
and flag enums cost more per request than a local reader's open or read itself did
(docs/decisions.md, D30).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import zmq
import zmq.asyncio
from cached_client.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    Header,
    Op,
    decode,
    encode,
    error,
)
from cached_client.protocol import ProtocolError as WireProtocolError
from cached_client.urls import check_all, parse

from . import __version__, socketmode
from .access import DEFAULT_ALLOW, Access
from .admission import Admission, ConnectionCaps
from .bounds import Bounds
from .datasets import Dataset, Datasets, checked, resolve
from .datasets import key as dataset_key
from .errors import CachedError, LimitExceeded, OutOfRange, ProtocolError, VersionMismatch
from .fetcher import AHEAD, DEMAND, PREFETCH, Fetcher, GaveWay, shard_id
from .jobs import JobBoard, Report
from .layouts import chosen, packed_layout
from .leases import Leases
from .metrics import Metrics
from .offload import Offload
from .owners import bounded, for_viewer, scoped
from .peers import Peer, Peers
from .planner import Plan, Planner, prepare
from .sent import Sent
from .tiers.hot import HotTier, Shard, ShardCorrupt
from .tiers.index import Member
from .tiers.pread import TRACK_BYTES
from .weights import dataset_bytes, frames_bytes, plan_bytes, strings_bytes

log = logging.getLogger(__name__)
T = TypeVar("T")

# Plans longer than this are checked and indexed off the event loop (see _plan), and
# headers larger than this are decoded off it.
PLAN_OFFLOAD_URLS = 10_000
DECODE_OFFLOAD_BYTES = 1 << 20

# Requests handled at once; past it the server stops reading and ZeroMQ queues push back.
# A request's slot is held while it is handled, not while its reply waits for the client.
MAX_ACTIVE_REQUESTS = 1024
# Replies ZeroMQ queues for one client (SNDHWM, per connection): a reader has some 20
# requests in flight; what its queue cannot take waits in the server (Peer.backlog, bounded
# by [server] max_requests_per_client and reply_timeout_s): each reply its own messages,
# copies of the payload, so about 256 x a read's payload for reply_timeout_s at most.
SNDHWM = 16
# The request loop counts as stuck when requests wait to be taken and none was taken or
# finished for this long: /readyz says not ready and the systemd watchdog is not fed.
STUCK_AFTER_S = 30.0
# Frames given as bytes (routing id, header, packed layout) below this are copied into
# ZeroMQ, larger ones sent zero-copy; payload frames are ZeroMQ messages already.
# Zero-copy costs a reference hand-off through pyzmq's garbage-collector thread per frame
# (29% of the daemon's CPU at 100 KB frames); a copy of 1 MiB costs less (docs/decisions.md).
COPY_THRESHOLD_BYTES = 1 << 20
# Requests nest two levels (a plan's list of URLs); deeper JSON is refused when decoded, so
# no handler ever walks (or prints) a structure deep enough to exhaust the stack.
MAX_REQUEST_DEPTH = 8
# An open's flags -> how the fetcher treats a miss.
_PRIORITY = {"demand": DEMAND, "prefetch": PREFETCH, "ahead": AHEAD}
# What this daemon understands beyond protocol v1's first form, told in the hello reply:
# "release": an open or read may carry the URLs whose pins the stream gives back, which
# saves a local reader one ``close`` request per shard (D26). "whole": a read of all of a
# shard's samples, which may ask to be answered only if the shard is resident (D33).
# "packed": a local read's layout is one binary frame (D34), the only form it has.
# "heartbeat": a client's heartbeat (its own socket, naming its connection's session)
# renews the connection's leases and plans and carries the instance (issue 21).
# "datasets": a dataset's URL list is told once, and plans name positions in it (issue 24).
FEATURES = ("release", "whole", "packed", "heartbeat", "datasets")
# A session name: what a client calls its connection in its hello.
_SESSION = re.compile(r"[0-9A-Za-z_-]{8,64}")
# The request frames being handled at once, in bytes, as a multiple of [server]
# max_request_bytes: past it the request loop waits (each request's frame, and the JSON
# decoded from it, stay in memory while it is handled).
REQUEST_BYTES_IN_FLIGHT = 2
# Messages the request loop takes in a row before it lets the rest of the event loop run.
YIELD_EVERY = 64
# A report is a few hundred bytes; a larger request is not one.
MAX_REPORT_BYTES = 4096
# URLs one request may release (a reader holds a few pins at a time).
MAX_RELEASED = 64
# Reply bytes ZeroMQ may hold for one connection, not yet written (cached/sent.py): a
# reader's 8 socket reads in flight of about 4 MiB each, twice.
SENT_BYTES_PER_CLIENT = 64 << 20
# A reply the client's queue cannot take yet (its high-water mark) is tried again after
# this long, doubling up to the second figure.
SEND_RETRY_S = (0.001, 0.05)


def _tracker(frames: list[Any]) -> Any:
    """The tracker of a reply's tracked frame (cached/tiers/pread.py), or None."""
    for frame in reversed(frames):
        tracker = getattr(frame, "tracker", None)
        if tracker is not None:
            return tracker
    return None


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


def _indexed_plan(
    key: str, dataset: Dataset, index: str, cursor: int, job: str, *, most: int, owner: str
) -> Plan:
    """The plan a request names by positions in ``owner``'s ``dataset`` (its URLs were
    checked when the dataset was told). Pure: runs in a worker thread for long plans."""
    urls = resolve(dataset, index, most)
    return prepare(key, urls, cursor=cursor, job=job, dataset=dataset_key(dataset.id, owner))


def _listed(header: Header, most: int, what: str) -> list[Any]:
    """The request's ``urls``: a list of at most ``most`` (checked item by item later)."""
    urls = header.get("urls")
    if not isinstance(urls, list):
        raise ProtocolError("request field 'urls' must be a list of strings")
    if len(urls) > most:
        raise ProtocolError(f"{what} may name at most {most} shards")
    return urls


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
    """The ``release`` field: the URLs whose pins the stream gives back with this request,
    each a shard URL (no store is asked about a name no store allows)."""
    urls = header["release"]
    if not (isinstance(urls, list) and len(urls) <= MAX_RELEASED):
        raise ProtocolError(f"request field 'release' must list at most {MAX_RELEASED} URLs")
    if not all(isinstance(u, str) and u for u in urls):
        raise ProtocolError("request field 'release' must be a list of URLs")
    for url in urls:
        _valid(url)
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
        bounds: Bounds | None = None,
        plan_grace_s: float = 30.0,
        status: Callable[[], dict[str, Any]] | None = None,
        planner: Planner | None = None,
        socket_mode: str = "0660",
        socket_group: str | None = None,
        allow: Sequence[str] = DEFAULT_ALLOW,
        jobs: JobBoard | None = None,
        local_reads: bool = True,
        connections: ConnectionCaps | None = None,
    ) -> None:
        self.endpoint = endpoint
        # Which accepted connections are kept (cached/admission.py); None: all.
        self.admission = (
            Admission(connections, lambda reason: metrics.connections_refused.labels(reason).inc())
            if connections is not None
            else None
        )
        # Answer reads that ask for it with the shard file's layout, not its bytes.
        self.local_reads = local_reads
        self.socket_mode = socket_mode
        self.socket_group = socket_group
        self.access = Access(allow)
        self.fetcher = fetcher
        self.hot = hot
        self.metrics = metrics
        self.bounds = bounds = bounds or Bounds()
        self.leases = Leases(hot, lease_timeout_s, bounds)
        self.planner = planner if planner is not None else Planner(lease_timeout_s)
        self.max_plan_shards = max_plan_shards
        self.jobs = jobs if jobs is not None else JobBoard(metrics)
        # Requests' work off the event loop: threads of its own, a few jobs per user.
        self.offload = Offload()
        self.plan_quota, self.plan_urls = bounds.plan_quotas()
        # What plans, datasets and replies waiting hold in memory, in bytes (weights.py).
        self.memory = bounds.memory_quotas()
        # Reply bytes ZeroMQ holds, not yet written (cached/sent.py), under the caps of
        # replies waiting per user and in total, and SENT_BYTES_PER_CLIENT per connection.
        self.sent = Sent(
            SENT_BYTES_PER_CLIENT, bounds.max_reply_bytes_per_user, bounds.max_reply_bytes
        )
        # Datasets told (compact plans name positions in them), and their URLs per user.
        self.datasets = Datasets(self.planner.timeout_s)
        self.dataset_urls = bounds.dataset_quota()
        # A gone connection's plans stay this long ([prefetch] plan_grace_s), see _release_held.
        self.plan_grace_s = plan_grace_s
        self._graces: set[asyncio.TimerHandle] = set()
        self._plans_lock = asyncio.Lock()
        # Request tasks that are opens ahead (hints, not demands): see drain.
        self._hints: set[asyncio.Task[Any]] = set()
        # Request tasks installing a plan: not cancelled when their client goes (_gone).
        self._installs: set[asyncio.Task[Any]] = set()
        # The planner's deferred notice of cursor moves (see _advance).
        self._flush: asyncio.TimerHandle | None = None
        # Replies waiting in the peers' backlogs, and the tasks that send them.
        self._queued = 0
        self._flushers: set[asyncio.Task[None]] = set()
        # Work for peers that went away (their plans dropped under the plans lock).
        self._chores: set[asyncio.Task[None]] = set()
        metrics.requests_in_flight.set_function(lambda: len(self._tasks) + self._queued)
        self.peers: Peers | None = None
        # The request frames being handled, in bytes, and their bound (see serve).
        self._request_bytes = 0
        self._max_request_bytes_total = REQUEST_BYTES_IN_FLIGHT * bounds.max_request_bytes
        self._bytes_freed = asyncio.Event()
        # Since when the request loop waits for a slot for the request it took, if it does,
        # and when a request last finished (see stuck_s).
        self._blocked_at: float | None = None
        self._finished_at = time.monotonic()
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
        # Connections by the session their hello named (see _heartbeat); one each.
        self._sessions: dict[str, Peer] = {}
        # How often a client's heartbeat comes: well within a lease, at most every 2 s.
        self.heartbeat_s = max(0.05, min(2.0, lease_timeout_s / 4))

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
        # A larger frame drops its connection as its size arrives, before it is buffered.
        sock.setsockopt(zmq.MAXMSGSIZE, self.bounds.max_request_bytes)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        # Replies to a vanished client fail loudly instead of queueing or dropping silently.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.copy_threshold = COPY_THRESHOLD_BYTES
        # Before bind: no connection may come unseen (see cached/peers.py).
        self.peers = Peers(sock, self._gone, self.admission)
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            self.peers.close()
            sock.close()
            raise CachedError(f"cannot bind {self.endpoint}: {exc}") from exc
        try:
            self._set_socket_access(gid)
        except CachedError:
            self.peers.close()
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
        started = time.monotonic()
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
        # Replies that wait for a slow client get what is left of the drain time.
        left = timeout_s - (time.monotonic() - started)
        if self._flushers and left > 0:
            await asyncio.wait(set(self._flushers), timeout=left)

    async def __aexit__(self, *exc: object) -> None:
        if self._flush is not None:
            self._flush.cancel()
        for handle in self._graces:
            handle.cancel()
        for task in [*self._tasks, *self._flushers, *self._chores]:
            task.cancel()
        if self._tasks or self._flushers or self._chores:
            await asyncio.gather(
                *self._tasks, *self._flushers, *self._chores, return_exceptions=True
            )
        if self.peers is not None:
            self.peers.close()
        if self._sock is not None:
            self._sock.close(linger=0)
        self._ctx.term()
        self.offload.close()

    def stuck_s(self) -> float:
        """How long a request has waited for a slot (every one held) while no request
        finished: 0 while the request loop takes what comes. See STUCK_AFTER_S."""
        if self._blocked_at is None:
            return 0.0
        return max(0.0, time.monotonic() - max(self._blocked_at, self._finished_at))

    @property
    def stuck(self) -> bool:
        """Whether the request loop is stuck (:meth:`stuck_s` past STUCK_AFTER_S)."""
        return self.stuck_s() > STUCK_AFTER_S

    async def serve(self) -> None:
        """Receive requests until cancelled; each runs in its own task. The descriptor
        signals changes, not messages: every message waiting is taken whenever it does,
        and ``_send`` looks again after each reply (a send may take the signal)."""
        sock = self._sock
        assert sock is not None, "use `async with Server(...)` first"
        peers = self.peers
        assert sock is not None and peers is not None, "use `async with Server(...)` first"
        fd = cast(int, sock.getsockopt(zmq.FD))
        loop = asyncio.get_running_loop()
        loop.add_reader(fd, self._readable.set)
        loop.add_reader(peers.fd, peers.events)
        peers.watch(loop)
        known = peers.by_ident
        most = self.bounds.max_requests_per_client
        taken = 0
        try:
            while True:
                # A client that floods requests (each refused at once, past its bound)
                # would keep this loop from ever awaiting: everything else on the event
                # loop (the handlers, /healthz) gets a turn every YIELD_EVERY messages.
                taken += 1
                if taken >= YIELD_EVERY:
                    taken = 0
                    await asyncio.sleep(0)
                try:
                    ident = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    taken = 0
                    self._readable.clear()
                    if not _waiting(sock):
                        await self._readable.wait()
                    continue
                # The rest of a message is there with its first frame: no wait.
                peer = known.get(ident)
                if peer is None:  # a new connection: who it is, once (cached/peers.py)
                    first = sock.recv(copy=False)
                    peer = peers.identify(ident, first)
                    header = first.bytes
                else:
                    header = sock.recv()
                # Requests are one frame (protocol v1): more are not kept.
                while sock.getsockopt(zmq.RCVMORE):
                    sock.recv(copy=False)
                if peer is None:  # a message a closed connection left queued
                    self._last_word(header)
                    continue
                if peer.requests >= most:
                    self._refuse(peer, header, self._too_many(peer))
                    continue
                size = len(header)
                if peer.request_bytes and peer.request_bytes + size > self.bounds.max_request_bytes:
                    # Large requests one at a time per client: the rest wait in ZeroMQ.
                    self._refuse(peer, header, self._too_large(peer, size))
                    continue
                if self._request_bytes + size > self._max_request_bytes_total:
                    self._blocked_at = time.monotonic()
                    while self._request_bytes and (
                        self._request_bytes + size > self._max_request_bytes_total
                    ):
                        self._bytes_freed.clear()
                        await self._bytes_freed.wait()
                    self._blocked_at = None
                if self._active.locked():
                    self._blocked_at = time.monotonic()
                    await self._active.acquire()
                    self._blocked_at = None
                else:
                    await self._active.acquire()  # at once
                if peer.gone:  # it went while the request waited for a slot
                    self._active.release()
                    self._last_word(header)
                    continue
                peer.requests += 1
                peer.request_bytes += size
                self._request_bytes += size
                task = asyncio.create_task(self._handle(peer, header))
                self._tasks.add(task)
                peer.tasks.add(task)
                task.add_done_callback(functools.partial(self._done, peer, size))
        finally:
            loop.remove_reader(fd)
            loop.remove_reader(peers.fd)

    def _last_word(self, header: bytes) -> None:
        """A request whose connection went before it was handled: dropped with what the
        connection held, except a job's report. A training process sends its last one
        without waiting as it exits, and its wait and batches still count."""
        if len(header) > MAX_REPORT_BYTES or b'"report"' not in header:
            return
        try:
            request = decode(header, max_depth=MAX_REQUEST_DEPTH)
            if request.get("op") == Op.REPORT:
                self.jobs.report(Report.parse(request))
        except (CachedError, WireProtocolError, ValueError):
            return  # a bad request from a client that is gone: no one to answer

    def _too_many(self, peer: Peer) -> str:
        return (
            f"this client has {peer.requests} requests in flight or replies not taken, the "
            f"most one client may have ([server] max_requests_per_client = "
            f"{self.bounds.max_requests_per_client}); take the replies before sending more"
        )

    def _too_large(self, peer: Peer, size: int) -> str:
        return (
            f"this client's requests being handled hold {peer.request_bytes} bytes; with this "
            f"one of {size} they would pass [server] max_request_bytes = "
            f"{self.bounds.max_request_bytes}: send large requests one at a time"
        )

    def _refuse(self, peer: Peer, header: bytes, message: str) -> None:
        """A request from a client over one of its bounds (``message`` says which):
        answered ``limit_exceeded`` where its queue takes the reply at once, else dropped."""
        self.metrics.requests.labels("unknown", "limit_exceeded").inc()
        if peer.backlog:
            return  # its queue is full: the answer could only wait, and it is over its bound
        reply = error(_id_of(header), ErrorCode.LIMIT, message)
        self._try_send(peer, [peer.ident, encode(reply)])

    def _deliver(self, peer: Peer, frames: list[Any], request_id: Any = None) -> None:
        """Send a reply without blocking; one the client's queue cannot take yet waits in
        the peer's backlog (see :meth:`_flush_replies`), in bytes within the user's and the
        daemon's caps of replies waiting (past them it becomes a ``limit_exceeded`` answer to
        request ``request_id``). Takes the reply off ``peer.requests`` once it is sent or
        dropped."""
        if peer.gone:
            peer.requests -= 1
            return
        if not peer.backlog and self._try_send(peer, frames):
            peer.requests -= 1
            return
        if peer.gone:  # the send found it gone
            peer.requests -= 1
            return
        try:
            self.memory.replies.admit(peer.ident, id(frames), frames_bytes(frames), peer.user)
        except LimitExceeded as exc:  # a few hundred bytes, uncounted, in its place
            frames = [peer.ident, encode(error(request_id, ErrorCode.LIMIT, str(exc)))]
        peer.backlog.append((frames, time.monotonic() + self.bounds.reply_timeout_s))
        self._queued += 1
        if peer.flusher is None:
            peer.flusher = asyncio.create_task(self._flush_replies(peer))
            self._flushers.add(peer.flusher)
            peer.flusher.add_done_callback(self._flushers.discard)

    def _try_send(self, peer: Peer, frames: list[Any]) -> bool:
        """One send without blocking: True if ZeroMQ took it. A peer that the socket no
        longer knows (EHOSTUNREACH) is gone."""
        sock = self._sock
        assert sock is not None
        size = frames_bytes(frames)
        if size >= TRACK_BYTES and not self.sent.fits(peer.ident, peer.user, size):
            return False  # it waits in the backlog until ZeroMQ has written more
        try:
            sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            if size >= TRACK_BYTES:
                self.sent.add(peer.ident, peer.user, _tracker(frames), size)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            # The client went away: nothing to deliver, nothing to keep.
            log.debug("reply to a vanished client dropped: %s", exc)
            if self.peers is not None:
                self.peers.drop(peer)
            return False
        finally:
            # A send may take the descriptor's signal of a request waiting.
            if _waiting(sock):
                self._readable.set()

    async def _flush_replies(self, peer: Peer) -> None:
        """Send ``peer``'s waiting replies as its queue takes them, tried again a moment
        later each time it does not; a reply still waiting after [server] reply_timeout_s
        is dropped."""
        delay, most = SEND_RETRY_S
        try:
            while peer.backlog and not peer.gone:
                await asyncio.sleep(delay)
                delay = min(most, delay * 2)
                now = time.monotonic()
                dropped = 0
                while peer.backlog and not peer.gone:
                    frames, deadline = peer.backlog[0]
                    if deadline < now:
                        dropped += 1
                    elif self._try_send(peer, frames):
                        delay = SEND_RETRY_S[0]
                    else:
                        break
                    peer.backlog.popleft()
                    self.memory.replies.forget(id(frames))
                    peer.requests -= 1
                    self._queued -= 1
                if dropped:
                    self.metrics.requests.labels("unknown", "reply_timeout").inc(dropped)
                    if not peer.warned:
                        peer.warned = True
                        log.warning(
                            "a client (%s) did not take its replies for %.0f s ([server] "
                            "reply_timeout_s): dropped them, and drop each that waits as long",
                            peer.describe(),
                            self.bounds.reply_timeout_s,
                        )
        finally:
            peer.flusher = None

    def _gone(self, peer: Peer) -> None:
        """A connection went away: its requests, replies, leases and plans go with it."""
        for task in peer.tasks:
            if task not in self._installs:  # a plan half installed is finished, then dropped
                task.cancel()
        self._queued -= len(peer.backlog)
        peer.requests -= len(peer.backlog)
        for frames, _ in peer.backlog:
            self.memory.replies.forget(id(frames))
        peer.backlog.clear()
        self.sent.forget(peer.ident)
        if peer.flusher is not None:
            peer.flusher.cancel()
        if peer.session and self._sessions.get(peer.session) is peer:
            del self._sessions[peer.session]
        self._release_held(peer)

    def _release_held(self, peer: Peer) -> None:
        """Drop what ``peer``, gone, still holds: again when its last request ends (one
        under way when it went may have taken a lease or installed a plan since)."""
        released = self.leases.release_client(peer.ident)
        if released:
            log.info(
                "released %d leases of a client that went away (%s)", released, peer.describe()
            )
        # Its plans go a little later ([prefetch] plan_grace_s): a DataLoader worker that
        # ends with its epoch leaves the next epoch's plan, which the prefetcher follows
        # until the next workers announce theirs.
        if self.plan_grace_s > 0:
            handle: asyncio.TimerHandle | None = None

            def later() -> None:
                assert handle is not None
                self._graces.discard(handle)
                self._drop_plans(peer)

            handle = asyncio.get_running_loop().call_later(self.plan_grace_s, later)
            self._graces.add(handle)
        else:
            self._drop_plans(peer)

    def _drop_plans(self, peer: Peer) -> None:
        """Drop the plans of ``peer``, gone. Only its own: one its reader has sent again on
        a new connection (a reconnect) belongs to that connection now, and stays."""
        keys = [cast(str, key) for key in self.plan_quota.keys_of(peer.ident)]
        if not keys:
            return
        dropped = self.planner.drop(keys)
        for key in keys:
            self.plan_quota.forget(key)
            self.plan_urls.forget(key)
            self.memory.plans.forget(key)
        if dropped:
            log.info(
                "dropped %d plans of a client that went away (%s)", len(dropped), peer.describe()
            )
            chore = asyncio.create_task(self._unindex(dropped))
            self._chores.add(chore)
            chore.add_done_callback(self._chores.discard)

    async def _unindex(self, dropped: list[Plan]) -> None:
        async with self._plans_lock:  # one install or expiry at a time
            for _ in self.planner.unindexing(dropped):
                await asyncio.sleep(0)

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
                live: set[Any] = {plan.key for plan in self.planner.plans()}
                self.plan_quota.retain(live)
                self.plan_urls.retain(live)
                counted = self.memory.plans.keys()  # and the plans being built
                self.memory.plans.retain(live | {k for k in counted if isinstance(k, tuple)})
            if self.datasets.drop_unnamed({plan.dataset for plan in self.planner.plans()}):
                held: set[Any] = self.datasets.ids()
                self.dataset_urls.retain(held)
                self.memory.datasets.retain(held)
            self.metrics.streams.set(self.leases.streams())

    def _done(self, peer: Peer, size: int, task: asyncio.Task[None]) -> None:
        peer.request_bytes -= size
        self._request_bytes -= size
        self._bytes_freed.set()
        self._tasks.discard(task)
        self._hints.discard(task)
        self._installs.discard(task)
        self._active.release()
        self._finished_at = time.monotonic()
        peer.tasks.discard(task)
        if peer.gone and not peer.tasks:
            self._release_held(peer)

    async def _handle(self, peer: Peer, body: bytes) -> None:
        request_id: Any = None
        op = "?"
        payload: list[Any] = []
        cancelled = False
        try:
            # A plan of a million URLs is a 40 MB header: parsed off the event loop.
            if len(body) > DECODE_OFFLOAD_BYTES:
                header = await self.offload.run(
                    peer.user, decode, body, max_depth=MAX_REQUEST_DEPTH
                )
            else:
                header = decode(body, max_depth=MAX_REQUEST_DEPTH)
            request_id = _request_id(header)
            op = _op(header)
            if header.get("ahead"):
                task = asyncio.current_task()
                if task is not None:  # a hint: not worth a wait at shutdown (see drain)
                    self._hints.add(task)
            elif op == Op.PLAN:
                task = asyncio.current_task()
                if task is not None:
                    self._installs.add(task)
            await self._check_access(op, header)
            reply, payload = await self._dispatch(op, header, peer)
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
            if exc.lasting:
                reply["lasting"] = True  # the client does not ask again
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
        self._deliver(peer, [peer.ident, encode(reply), *payload], request_id)
        if cancelled:
            raise asyncio.CancelledError

    async def _check_access(self, op: str, header: Header) -> None:
        """``[server] allow``: every URL the request names, before anything is fetched.
        Fields of the wrong type are left to the op's own checks (``bad_request``)."""
        if op in (Op.PLAN, Op.DATASET):
            named = header.get("urls")  # a plan naming a dataset's positions: none here
        elif op in (Op.OPEN, Op.READ, Op.CLOSE):
            released = header.get("release")
            named = [header.get("url"), *(released if isinstance(released, list) else [])]
            for url in named:
                if isinstance(url, str) and url:
                    _valid(url)  # a URL no store allows is refused before it is remembered
        else:
            return
        # An oversized plan is refused by _plan (bad_request) without this costly walk.
        if isinstance(named, list) and len(named) <= self.max_plan_shards:
            urls = [u for u in named if isinstance(u, str)]
            listing = op in (Op.PLAN, Op.DATASET)
            if listing or not self.access.settled(urls):
                await self.access.check(urls, remember=not listing)

    async def _dispatch(self, op: str, header: Header, client: Peer) -> tuple[Header, list[Any]]:
        """Run one request; ``client`` is the connection (for the caps)."""
        if op in (Op.OPEN, Op.READ) and "release" in header:
            # First: the pins given back make room for the shard this request may fetch.
            await self._release(_released(header), self._stream(header, client))
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
                "limits": {
                    "max_request_bytes": self.bounds.max_request_bytes,
                    "max_requests_per_client": self.bounds.max_requests_per_client,
                },
                "heartbeat_s": self.heartbeat_s,
                **self._session_of(header, client),
            }, []
        if op == Op.HEARTBEAT:
            return self._heartbeat(header, client), []
        if op == Op.OPEN:
            return await self._open(header, client), []
        if op == Op.READ:
            return await self._read(header, client)
        if op == Op.CLOSE:
            await self._release([_url(header)], self._stream(header, client))
            return {}, []
        if op == Op.STATUS:
            # Its own plans only, unless it is root or the daemon's user (owners.py).
            return {"status": for_viewer(self._status(), client.user)}, []
        if op == Op.PLAN:
            await self._plan(header, client)
            return {}, []
        if op == Op.DATASET:
            await self._dataset(header, client)
            return {}, []
        if op == Op.REPORT:
            self.jobs.report(Report.parse(header))
            return {}, []
        raise ProtocolError(f"unknown op {op!r}; expected one of {', '.join(Op)}")

    def _session_of(self, header: Header, client: Peer) -> Header:
        """A hello that names a session binds it to this connection (again after a
        restart of ours, or a reconnect of the client's)."""
        session = header.get("session")
        if session is None:
            return {}
        if not isinstance(session, str) or not _SESSION.fullmatch(session):
            raise ProtocolError("request field 'session' must be 8-64 letters, digits, - or _")
        held = self._sessions.get(session)
        if held is not None and held is not client and held.user != client.user:
            raise ProtocolError("that session belongs to another user's connection")
        if client.session and self._sessions.get(client.session) is client:
            del self._sessions[client.session]  # one session per connection
        self._sessions[session] = client
        client.session = session
        return {"session": session}

    def _heartbeat(self, header: Header, client: Peer) -> Header:
        """A client's heartbeat, from a socket of its own: the connection its session names
        keeps its leases and plans however long its reader reads without a request, or
        pauses. ``known`` false: no connection of ours has that session (we restarted,
        or the client has yet to say hello again)."""
        session = _str(header, "session")
        peer = self._sessions.get(session)
        known = peer is not None and not peer.gone and peer.user == client.user
        if known:
            assert peer is not None
            self.leases.renew_client(peer.ident)
            # The plans of its connection, and those its heartbeat told us again after a
            # restart of ours (on the heartbeat's socket, until the reader sends them).
            owners = (peer.ident, client.ident)
            self.planner.touch([cast(str, k) for o in owners for k in self.plan_quota.keys_of(o)])
        return {"instance": self.instance, "known": known}

    @staticmethod
    def _stream(header: Header, client: Peer) -> str:
        """The request's ``stream``, as the daemon holds it: under the client's user, so a
        name another user chose is never that user's stream (cached/owners.py)."""
        return scoped(client.user, _str(header, "stream"))

    async def _release(self, urls: list[str], stream: str) -> None:
        """The stream is done with these shards: their pins go (``close``, or the
        ``release`` field of its next open or read)."""
        for url in urls:
            info = await self.fetcher.info(url)
            self.leases.release(stream, shard_id(info))

    async def _shard(self, header: Header, client: Peer, *, count: bool) -> tuple[Shard, str, bool]:
        """The shard a request names, fetched on a miss, the stream's lease on it, and
        whether it was resident when the request came (a hit). Opens count as hits or
        misses; reads (which follow an open) do not."""
        url, stream = _url(header), self._stream(header, client)
        kind = (
            "ahead" if header.get("ahead") else "prefetch" if header.get("prefetch") else "demand"
        )
        started = time.monotonic()
        give_way = count and header.get("give_way") is True  # opens only
        # Opens ask the store again after [s3] revalidate_s; reads keep the version known.
        shard, hit = await self.fetcher.ensure(
            url, _PRIORITY[kind], revalidate=count, give_way=give_way
        )
        if count and hit:
            self.metrics.hits.inc()
        elif count:
            self.metrics.misses.labels(kind).inc()
            if kind == "demand":
                self.metrics.demand_wait_seconds.observe(time.monotonic() - started)
        if header.get("pin", True):
            self.leases.hold(stream, shard, client.ident, client.user)
        return shard, stream, hit

    async def _off_loop_if(
        self, user: str, long: bool, fn: Callable[..., T], *args: Any, **kwargs: Any
    ) -> T:
        """``fn(*args, **kwargs)``, in the request pool in ``user``'s turn where ``long``
        (cached/offload.py): a list of a million URLs checked or indexed on the event loop
        would stall every other client for seconds."""
        if not long:
            return fn(*args, **kwargs)
        return await self.offload.run(user, fn, *args, **kwargs)

    async def _dataset(self, header: Header, client: Peer) -> None:
        """A dataset's URL list, told once for the plans that name positions in it."""
        dataset_id = _str(header, "dataset")
        urls = _listed(header, self.max_plan_shards, "a dataset")
        user = client.user
        # One this user told: its digest was checked then, and its plans resolve against
        # its URLs, whatever these are. Another user's is not looked at (owners.py).
        dataset = self.datasets.find(dataset_id, user)
        if dataset is None:
            long = len(urls) > PLAN_OFFLOAD_URLS
            dataset = await self._off_loop_if(user, long, checked, dataset_id, urls)
        key, ident = dataset_key(dataset_id, user), client.ident
        weight = dataset_bytes(dataset.urls)
        self.dataset_urls.check(ident, key, len(dataset.urls), user)
        self.memory.datasets.admit(ident, key, weight, user)
        self.dataset_urls.admit(ident, key, len(dataset.urls), user)
        self.datasets.add(dataset, user)

    async def _plan(self, header: Header, client: Peer) -> None:
        ident, user = client.ident, client.user
        # Under its user: another user's plan of the same name is another plan (owners.py).
        key = scoped(user, _str(header, "plan"))
        cursor = _int(header, "cursor") if "cursor" in header else 0
        job = bounded(str(header.get("job", "")))
        # Weighed from the request and counted while it is built (beside the plan it
        # replaces: both are in memory then), so that a plan the caps refuse costs no
        # index (a million URLs' is some 450 MB) and plans built at once stay within the
        # caps; a plan of positions shares its dataset's strings. A long plan is weighed,
        # checked and indexed in a worker thread, then published in steps.
        build: Callable[[], Plan]
        shared = "dataset" in header
        if shared:
            dataset = self.datasets.get(_str(header, "dataset"), user)
            index = header.get("index")
            if not isinstance(index, str):  # empty for a reader with no shards this time
                raise ProtocolError("request field 'index' must be a string")
            long = len(index) > PLAN_OFFLOAD_URLS * 4 * 4 // 3  # base64 of 4-byte positions
            named = (len(index) * 3 // 4 - (len(index) - len(index.rstrip("=")))) // 4
            weight = plan_bytes(named)
            most = self.max_plan_shards
            build = functools.partial(
                _indexed_plan, key, dataset, index, cursor, job, most=most, owner=user
            )
        else:
            urls = _listed(header, self.max_plan_shards, "a plan")
            long, named = len(urls) > PLAN_OFFLOAD_URLS, len(urls)
            weight = plan_bytes(named, await self._off_loop_if(user, long, strings_bytes, urls))
            build = functools.partial(_checked_plan, key, urls, cursor, job)
        self._plan_fits(client, key, named, weight)
        building = (key, "building")  # a key of its own (expire_leases keeps it)
        self.memory.plans.admit(ident, building, weight, user)
        try:
            plan = await self._off_loop_if(user, long, build)
        finally:
            self.memory.plans.forget(building)
        if shared:
            weight = plan_bytes(len(plan.urls))
        # Again, as built: other plans may have been taken meanwhile.
        self._plan_fits(client, key, len(plan.urls), weight)
        self.memory.plans.admit(ident, key, weight, user)
        self.plan_urls.admit(ident, key, len(plan.urls), user)
        self.plan_quota.admit(ident, key, 1, user)
        async with self._plans_lock:  # one install or expiry at a time
            for _ in self.planner.install(plan):
                await asyncio.sleep(0)

    def _plan_fits(self, client: Peer, key: str, urls: int, weight: int) -> None:
        """Raise :class:`LimitExceeded` unless a plan of ``urls`` URLs weighing ``weight``
        bytes fits every plan cap of ``client`` and its user; counts nothing, so that a
        refusal leaves a plan already under ``key`` as it was."""
        ident, user = client.ident, client.user
        self.plan_quota.check(ident, key, 1, user)
        self.plan_urls.check(ident, key, urls, user)
        self.memory.plans.check(ident, key, weight, user)

    def _advance(self, header: Header, client: Peer) -> None:
        """Reads name the stream's plan and position: the cursor rides along for free (of
        the client's user's plan of that name only). A move the planner does not tell its
        listeners at once is told a moment later."""
        key = header.get("plan")
        if isinstance(key, str) and key:
            wait = self.planner.advance(scoped(client.user, key), _int(header, "pos"))
            if wait is not None and self._flush is None:
                self._flush = asyncio.get_running_loop().call_later(wait, self._flushed)

    def _flushed(self) -> None:
        self._flush = None
        self.planner.flush()

    async def _open(self, header: Header, client: Peer) -> Header:
        try:
            shard, _, hit = await self._shard(header, client, count=True)
        except GaveWay:
            # No room ahead of the reader (a small tier): it asks again when it gets there.
            return {"url": _url(header), "resident": False}
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
        a fresh READY copy (``Fetcher.resident_fresh``) and room to pin it ahead
        (``HotTier.may_pin_ahead``). Nothing is asked of the store, fetched or pinned."""
        shard = self.fetcher.resident_fresh(_url(header))
        return shard is not None and self.hot.may_pin_ahead(shard)

    async def _read(self, header: Header, client: Peer) -> tuple[Header, list[Any]]:
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
        self._advance(header, client)
        exts = header.get("exts")
        if exts is not None and not (
            isinstance(exts, list) and all(isinstance(e, str) for e in exts)
        ):
            raise ProtocolError("request field 'exts' must be a list of strings")
        wanted = None if exts is None else frozenset(exts)
        # A local reader reads the members from the file itself (and checks them: the
        # layout gives their checksums); the socket carries only the header and the
        # layout, one packed frame (D34).
        local = bool(header.get("local")) and self.local_reads
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
            if local:
                layout, nbytes = packed_layout(index, wanted, start, stop)
                frames: list[Any] = [layout.frame]
                break
            listed: list[Any] = []
            picked: list[Member] = []
            for sample in index.samples[start:stop]:
                members = chosen(sample, wanted)
                listed.append([sample.key, [[m.ext, m.size] for m in members]])
                picked.extend(members)
            samples, nbytes = listed, sum(m.size for m in picked)
            try:
                # Checked against their checksums first: rotten bytes are never sent.
                off_loop = functools.partial(self.offload.run, client.user)
                frames = await self.hot.read(shard, picked, off_loop)
                break
            except ShardCorrupt:
                if attempt == 2:
                    raise
                # The hot tier dropped the rotten copy; _shard fetches a good one.
        reply: Header = {"start": start, "next": stop, "end": stop == n}
        if local:
            reply["packed"] = {"samples": stop - start, "exts": layout.exts}
            # The reader holds the file open past this reply: its lease (the pin that keeps
            # the file from being unlinked under it) goes with its close, not here.
            reply["local"] = self.hot.locate(shard)
            self.metrics.local_read_bytes.inc(nbytes)
        else:
            reply["samples"] = samples
            if stop == n:
                self.leases.release(stream, shard.shard_id)
        if header.get("refetch") is True and not local:
            # A local reply the reader could not use (no file there, a failed checksum),
            # asked again here: counted as served once, with the local reply.
            self.metrics.local_fallback_bytes.inc(nbytes)
        else:
            self.metrics.served_samples.inc(stop - start)
            self.metrics.served_bytes.inc(nbytes)
        return reply, frames


_ID = re.compile(rb'"id":\s*(\d{1,18})\s*[,}]')


def _id_of(header: bytes) -> int | None:
    """A refused request's ``id``, without decoding a large frame: the client library puts
    it last, and short requests are decoded. None where it cannot be told."""
    if len(header) <= DECODE_OFFLOAD_BYTES:
        try:
            value = decode(header).get("id")
        except (WireProtocolError, ValueError):
            return None
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    found = _ID.search(header, len(header) - 64)
    return int(found.group(1)) if found else None


def _waiting(sock: zmq.Socket[bytes]) -> bool:
    """Whether a message waits on ``sock`` (reading its events also re-arms its descriptor)."""
    return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


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
