"""The request loop and its back-pressure: the :class:`Server` takes requests off the
ROUTER socket, within each client's bounds (requests in flight, request bytes) and the
daemon's (requests handled at once, request bytes in flight), and runs each in its own
task, so that one client's demand miss never blocks another client's hits.

The socket is a plain (blocking-API) ZeroMQ socket driven from the event loop by its file
descriptor, received from and sent to without blocking: zmq.asyncio's futures, handlers
and flag enums cost more per request than a local reader's open or read itself did
(docs/decisions.md, D30).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, cast

import zmq
from cached_wire.protocol import Op, decode
from cached_wire.protocol import ProtocolError as WireProtocolError

from ..access import DEFAULT_ALLOW, Access
from ..admission import Admission, ConnectionCaps
from ..bounds import Bounds
from ..errors import CachedError
from ..fetcher import Fetcher
from ..hot.tier import HotTier
from ..jobs import JobBoard, Report
from ..metrics import Metrics
from ..offload import Offload
from ..peers import Peer, Peers
from ..planner import Planner
from .bind import bind
from .checks import MAX_REQUEST_DEPTH
from .dispatch import Dispatch
from .holdings import Holdings
from .plans import Plans
from .reads import Reads
from .sendq import SendQueue, waiting
from .sessions import Sessions

log = logging.getLogger(__name__)

# Requests handled at once; past it the server stops reading and ZeroMQ queues push back.
# A request's slot is held while it is handled, not while its reply waits for the client.
MAX_ACTIVE_REQUESTS = 1024
# The request loop counts as stuck when requests wait to be taken and none was taken or
# finished for this long: /readyz says not ready and the systemd watchdog is not fed.
STUCK_AFTER_S = 30.0
# The request frames being handled at once, in bytes, as a multiple of [server]
# max_request_bytes: past it the request loop waits (each request's frame, and the JSON
# decoded from it, stay in memory while it is handled).
REQUEST_BYTES_IN_FLIGHT = 2
# Messages the request loop takes in a row before it lets the rest of the event loop run.
YIELD_EVERY = 64
# A report is a few hundred bytes; a larger request is not one.
MAX_REPORT_BYTES = 4096


class Server:
    """Serves protocol v1 on one ZeroMQ endpoint. An async context manager (binds/closes).
    Its rooms: :class:`Dispatch` (a request to its reply), :class:`Reads` and
    :class:`Plans` (the ops), :class:`Sessions` (what connections hold and leave),
    :class:`SendQueue` (replies out), :func:`bind` (the endpoint)."""

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
        self.socket_mode = socket_mode
        self.socket_group = socket_group
        self.metrics = metrics
        self.bounds = bounds = bounds or Bounds()
        held = Holdings.of(hot, bounds, lease_timeout_s, planner)
        # What clients hold, for the daemon's status and the tests.
        self.leases, self.datasets = held.leases, held.datasets
        self.plan_quota, self.plan_urls = held.plan_quota, held.plan_urls
        self.dataset_urls = held.dataset_urls
        self.jobs = jobs if jobs is not None else JobBoard(metrics)
        # Requests' work off the event loop: threads of its own, a few jobs per user.
        self.offload = Offload()
        # Set when the socket's descriptor signals (or a send saw messages waiting).
        self._readable = asyncio.Event()
        self.sendq = SendQueue(bounds, held.memory.replies, metrics, self._readable)
        # Changes with every start: a client that sees a new one re-sends what it lost.
        self.instance = uuid.uuid4().hex
        self.sessions = Sessions(held, metrics, plan_grace_s=plan_grace_s, instance=self.instance)
        self.reads = Reads(
            fetcher,
            hot,
            held,
            metrics,
            self.offload,
            max_read_samples=max_read_samples,
            local_reads=local_reads,
            instance=self.instance,
        )
        self.plans = Plans(held, self.offload, max_plan_shards=max_plan_shards)
        self.dispatch = Dispatch(
            reads=self.reads,
            plans=self.plans,
            sessions=self.sessions,
            sendq=self.sendq,
            access=Access(allow),
            jobs=self.jobs,
            metrics=metrics,
            offload=self.offload,
            bounds=bounds,
            status=status or (lambda: {}),
            instance=self.instance,
            # How often a client's heartbeat comes: well within a lease, at most every 2 s.
            heartbeat_s=max(0.05, min(2.0, lease_timeout_s / 4)),
        )
        metrics.requests_in_flight.set_function(lambda: len(self._tasks) + self.sendq.queued)
        self.peers: Peers | None = None
        # The request frames being handled, in bytes, and their bound (see serve).
        self._request_bytes = 0
        self._max_request_bytes_total = REQUEST_BYTES_IN_FLIGHT * bounds.max_request_bytes
        self._bytes_freed = asyncio.Event()
        # Since when the request loop waits for a slot for the request it took, if it does,
        # and when a request last finished (see stuck_s).
        self._blocked_at: float | None = None
        self._finished_at = time.monotonic()
        self._ctx = zmq.Context()
        self._sock: zmq.Socket[bytes] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._active = asyncio.Semaphore(MAX_ACTIVE_REQUESTS)
        self.bound_endpoint = endpoint

    async def __aenter__(self) -> Server:
        sock, peers = await bind(
            self._ctx,
            self.endpoint,
            max_request_bytes=self.bounds.max_request_bytes,
            socket_mode=self.socket_mode,
            socket_group=self.socket_group,
            admission=self.admission,
            on_gone=self._gone,
        )
        self.peers = peers
        self.sendq.attach(sock, peers)
        self.bound_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        log.info("serving on %s", self.bound_endpoint)
        return self

    async def drain(self, timeout_s: float) -> None:
        """Let the requests under way finish, for up to ``timeout_s``; the ones still
        waiting then (a download that takes longer) are cancelled and answered
        ``shutting_down``. For shutdown, after :meth:`serve` stopped taking requests and
        before the sources close."""
        if not self._tasks:
            return
        # Opens ahead only wait for the prefetcher, which has stopped; their readers may
        # be gone too. Answered at once, so that a stop after a load is not a 5 s stop.
        for task in self.dispatch.hints:
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
        if self.sendq.flushers and left > 0:
            await asyncio.wait(set(self.sendq.flushers), timeout=left)

    async def __aexit__(self, *exc: object) -> None:
        self.reads.close()
        self.sessions.close()
        tasks = [*self._tasks, *self.sendq.flushers, *self.sessions.chores]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
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

    async def expire_leases(self) -> None:
        """Release lapsed leases and drop quiet plans periodically, until cancelled."""
        await self.sessions.expire()

    async def serve(self) -> None:
        """Receive requests until cancelled; each runs in its own task. The descriptor
        signals changes, not messages: every message waiting is taken whenever it does,
        and a send looks again after each reply (a send may take the signal)."""
        sock, peers = self._sock, self.peers
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
                # I53: a flood leaves the daemon answering others.
                if taken >= YIELD_EVERY:
                    taken = 0
                    await asyncio.sleep(0)
                try:
                    ident = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    taken = 0
                    self._readable.clear()
                    if not waiting(sock):
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
                    self.sendq.refuse(peer, header, self._too_many(peer))
                    continue
                size = len(header)
                # I52: large requests are taken one at a time per client.
                if peer.request_bytes and peer.request_bytes + size > self.bounds.max_request_bytes:
                    # Large requests one at a time per client: the rest wait in ZeroMQ.
                    self.sendq.refuse(peer, header, self._too_large(peer, size))
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
                task = asyncio.create_task(self.dispatch.handle(peer, header))
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

    def _gone(self, peer: Peer) -> None:
        """A connection went away: its requests, replies, leases and plans go with it."""
        for task in peer.tasks:
            if task not in self.dispatch.installs:  # a plan half installed is finished
                task.cancel()
        self.sendq.forget(peer)
        self.sessions.gone(peer)

    def _done(self, peer: Peer, size: int, task: asyncio.Task[None]) -> None:
        peer.request_bytes -= size
        self._request_bytes -= size
        self._bytes_freed.set()
        self._tasks.discard(task)
        self.dispatch.forget(task)
        self._active.release()
        self._finished_at = time.monotonic()
        peer.tasks.discard(task)
        if peer.gone and not peer.tasks:
            self.sessions.release_held(peer)
