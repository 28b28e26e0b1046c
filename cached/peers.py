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
import struct
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

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

    def __init__(self, sock: zmq.Socket[bytes], on_gone: Callable[[Peer], None]) -> None:
        self._on_gone = on_gone
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

    def close(self) -> None:
        """Stop monitoring (before the ROUTER closes)."""
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

    def events(self) -> None:
        """Take the monitor's pending events: accepted descriptors open, disconnected ones
        close and their peers go."""
        monitor = self._monitor
        if monitor is None:
            return
        while True:
            try:
                event = monitor.recv(zmq.NOBLOCK)
                monitor.recv(zmq.NOBLOCK)  # the endpoint
            except zmq.Again:
                return
            kind, fd = _EVENT.unpack(event)
            if kind == zmq.EVENT_ACCEPTED:
                self._seq += 1
                self._accepted[fd] = self._seq
            elif kind == zmq.EVENT_DISCONNECTED:
                self._accepted.pop(fd, None)
                for peer in list(self._by_fd.get(fd, ())):
                    self.drop(peer)

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
