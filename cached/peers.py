"""Who is connected to the daemon's ROUTER socket, the local user behind each connection,
and when a connection goes away.

A connection is a ZeroMQ routing id. ZeroMQ tells a ROUTER nothing of its peers coming and
going (``ZMQ_ROUTER_NOTIFY`` is a draft option, not in the libzmq the daemon runs on), so
two facts it does give are joined here:

- a message received with ``copy=False`` knows the descriptor of the connection it came on
  (``ZMQ_SRCFD``) and, on ipc, the peer's credentials (``Peer-Address`` is
  ``localhost:UID:GID:PID``, from ``SO_PEERCRED``);
- a socket monitor reports every accepted connection and every disconnection, by
  descriptor.

Descriptors are reused. The I/O thread reports a disconnection before it can accept a new
connection on the same descriptor, so the monitor's pending events are taken before a new
routing id is registered; a routing id whose descriptor is not open (any more) sent its
message before it went, and one that went a moment ago may still have messages queued:
both are stale, and :meth:`Peers.identify` says so. A routing id is looked up once, when
it first appears; its later messages cost one dict lookup (docs/decisions.md, D30).
"""

from __future__ import annotations

import asyncio
import logging
import select
import struct
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from .admission import Admission

log = logging.getLogger(__name__)

# Routing ids that went away are remembered this long (at most GONE_MAX of them): messages
# they left queued in the ROUTER are dropped, not taken for a new connection's.
GONE_S = 10.0
GONE_MAX = 1 << 16
_EVENT = struct.Struct("=Hi")


@dataclass(eq=False)
class Peer:
    """One connection, and what it holds in the server while it lasts."""

    ident: bytes
    fd: int
    # The local user (``uid 1000``) on ipc; a tcp connection is a user of its own.
    user: str
    pid: int | None
    seq: int  # registration order (see Peers.identify)
    requests: int = 0  # taken and not yet answered or dropped (replies waiting included)
    request_bytes: int = 0  # the frames of its requests being handled
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    # Replies its queue could not take yet, each with the time it is dropped at.
    backlog: deque[tuple[list[Any], float]] = field(default_factory=deque)
    flusher: asyncio.Task[None] | None = None
    gone: bool = False
    warned: bool = False
    # The client's name for its connection (its hello's ``session``): its heartbeats,
    # sent on a socket of their own, renew what this connection holds.
    session: str = ""

    def describe(self) -> str:
        """For log lines: the user and process where known."""
        pid = f", pid {self.pid}" if self.pid is not None else ""
        return f"{self.user}{pid}"


def credentials(address: str) -> tuple[int | None, int | None]:
    """(uid, pid) from an ipc connection's ``Peer-Address`` (``localhost:UID:GID:PID``);
    (None, None) for anything else (a tcp peer's address is its IP)."""
    parts = address.split(":")
    if len(parts) == 4 and parts[0] == "localhost" and parts[1].isdigit():
        return int(parts[1]), int(parts[3]) if parts[3].isdigit() else None
    return None, None


class Peers:
    """The ROUTER's connections. Call :meth:`events` when the monitor's descriptor
    (:attr:`fd`) signals; ``on_gone(peer)`` is called once for each peer that goes."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        on_gone: Callable[[Peer], None],
        admission: Admission | None = None,
    ) -> None:
        self._on_gone = on_gone
        # Keeps or shuts each accepted connection (cached/admission.py); None keeps all.
        self.admission = admission
        self._monitor: zmq.Socket[bytes] | None = sock.get_monitor_socket(
            zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        )
        self._sock = sock
        self.fd: int = self._monitor.getsockopt(zmq.FD)  # type: ignore[assignment]
        self.by_ident: dict[bytes, Peer] = {}
        self._by_fd: dict[int, list[Peer]] = {}
        self._accepted: dict[int, int] = {}  # open descriptor -> seq when it was accepted
        self._gone: OrderedDict[bytes, float] = OrderedDict()
        self._seq = 0
        # The monitor is read under this lock, by the event loop and by the guard thread
        # (see watch); what either takes waits in _taken, in order, for the event loop.
        self._lock = threading.Lock()
        self._taken: deque[tuple[int, int, bool]] = deque()  # kind, descriptor, kept
        self._guard: threading.Thread | None = None
        self._stop = threading.Event()
        self._woken = False

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Take each accept in a thread of its own, so that one past a cap is shut within
        a thread switch of being reported, not when the event loop next turns: a flood
        of connections holds descriptors only for that long (cached/descriptors.py)."""
        if self.admission is None or self._guard is not None:
            return
        self._guard = threading.Thread(
            target=self._guard_run, args=(loop,), name="cached-accepts", daemon=True
        )
        self._guard.start()

    def close(self) -> None:
        """Stop monitoring (before the ROUTER closes)."""
        if self._guard is not None:
            self._stop.set()
            self._guard.join()
            self._guard = None
        with self._lock:
            if self._monitor is not None:
                self._sock.disable_monitor()
                self._monitor.close(linger=0)
                self._monitor = None

    def identify(self, ident: bytes, frame: zmq.Frame) -> Peer | None:
        """The peer that sent ``frame`` (received with ``copy=False``) under a routing id
        not seen before; None for a stale message (see the module's docstring)."""
        self.events()
        if ident in self.by_ident:
            return self.by_ident[ident]
        if ident in self._gone:
            return None
        fd = int(frame.get(zmq.SRCFD))
        accepted = self._accepted.get(fd)
        if accepted is None:
            self._forget_gone(ident)
            return None
        # A connection accepted on this descriptor after an older routing id was seen on
        # it proves that one closed, whatever the monitor has said so far.
        for old in [p for p in self._by_fd.get(fd, ()) if p.seq < accepted]:
            self.drop(old)
        try:
            address = str(frame.get("Peer-Address"))
        except zmq.ZMQError:  # no such property (an inproc peer)
            address = ""
        uid, pid = credentials(address)
        self._seq += 1
        user = f"uid {uid}" if uid is not None else f"connection {ident.hex()}"
        peer = Peer(ident, fd, user, pid, self._seq)
        self.by_ident[ident] = peer
        self._by_fd.setdefault(fd, []).append(peer)
        return peer

    # I35: a gone connection is told at once (its pins go; I36: its plans after plan_grace_s).
    def events(self) -> None:
        """Apply the monitor's events, on the event loop: accepted descriptors open (where
        admitted), disconnected ones close and their peers go."""
        with self._lock:
            self._woken = False
            self._take()
            taken, self._taken = self._taken, deque()
        for kind, fd, kept in taken:
            if kind == zmq.EVENT_ACCEPTED:
                if kept:
                    self._seq += 1
                    self._accepted[fd] = self._seq
            else:
                self._accepted.pop(fd, None)
                for peer in list(self._by_fd.get(fd, ())):
                    self.drop(peer)

    def _take(self) -> int:
        """Read the monitor's pending events into _taken, each accept admitted or shut as
        it is read (under the lock); returns how many."""
        monitor = self._monitor
        if monitor is None:
            return 0
        batch: list[tuple[int, int]] = []
        while True:
            try:
                event = monitor.recv(zmq.NOBLOCK)
                monitor.recv(zmq.NOBLOCK)  # the endpoint
            except zmq.Again:
                break
            batch.append(_EVENT.unpack(event))
        # A descriptor that closes later in the batch may already be another connection's:
        # an accept followed by its own close is neither looked at nor kept (nothing it
        # sent is handled).
        closes = {fd: i for i, (kind, fd) in enumerate(batch) if kind == zmq.EVENT_DISCONNECTED}
        admission = self.admission
        for i, (kind, fd) in enumerate(batch):
            if kind == zmq.EVENT_ACCEPTED:
                kept = closes.get(fd, -1) < i and (admission is None or admission.accepted(fd))
                self._taken.append((kind, fd, kept))
            elif kind == zmq.EVENT_DISCONNECTED:
                if admission is not None:
                    admission.closed(fd)
                self._taken.append((kind, fd, False))
        return len(batch)

    def _guard_run(self, loop: asyncio.AbstractEventLoop) -> None:
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        while not self._stop.is_set():
            # The descriptor signals a change, not each event: look at least every 50 ms.
            poller.poll(50)
            with self._lock:
                if not self._take() or self._woken:
                    continue
                self._woken = True
            try:
                loop.call_soon_threadsafe(self.events)
            except RuntimeError:  # the loop closed
                return

    def drop(self, peer: Peer) -> None:
        """``peer`` went away (its descriptor closed, or a send said it is unreachable)."""
        if peer.gone:
            return
        peer.gone = True
        self.by_ident.pop(peer.ident, None)
        on_fd = self._by_fd.get(peer.fd)
        if on_fd is not None:
            on_fd.remove(peer)
            if not on_fd:
                del self._by_fd[peer.fd]
        self._forget_gone(peer.ident)
        self._on_gone(peer)

    def __len__(self) -> int:
        return len(self.by_ident)

    def _forget_gone(self, ident: bytes) -> None:
        now = time.monotonic()
        self._gone[ident] = now
        self._gone.move_to_end(ident)
        while self._gone and (
            len(self._gone) > GONE_MAX or next(iter(self._gone.values())) < now - GONE_S
        ):
            self._gone.popitem(last=False)
