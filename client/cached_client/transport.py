"""A synchronous ZeroMQ DEALER to the daemon: requests in flight, timeouts, reconnects.

One :class:`Connection` per stream (per DataLoader worker, or the fast-path reader). It is
opened lazily in the process that uses it and never crosses a fork.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import time
from typing import Any

import zmq

from .errors import DaemonUnavailable, RemoteError, check_reply
from .protocol import DEFAULT_SOCKET, PROTOCOL_VERSION, SOCKET_ENV, Header, Op, decode, encode

log = logging.getLogger(__name__)


# glibc <malloc.h> parameters, and the values a reader wants.
_MALLOPT = (
    (-1, 256 << 20),  # M_TRIM_THRESHOLD: keep up to 256 MiB of freed heap
    (-3, 8 << 20),  # M_MMAP_THRESHOLD: serve blocks below 8 MiB from the heap, not mmap
    (-8, 1),  # M_ARENA_MAX: ZeroMQ's I/O thread allocates frames in the main arena too
)
_malloc_tuned_pid = 0


def keep_freed_memory() -> None:
    """Tune glibc's allocator for a reader, once per process, before ZeroMQ starts.

    A reader allocates and frees a few MiB of frames per reply (in ZeroMQ's I/O thread and
    in Python). By default glibc returns that memory to the kernel (trimming the heap,
    unmapping blocks, shrinking thread arenas) and the next reply page-faults it back in:
    ~22 faults per 100 KB sample, a third of the reader's time in the kernel. Keeping the
    memory cut the faults 15-fold on the fast path (bench/serve.py, docs/benchmarks.md).
    Bounded: at most a few replies' worth stays allocated. A no-op off glibc.
    """
    global _malloc_tuned_pid
    if _malloc_tuned_pid == os.getpid():
        return
    _malloc_tuned_pid = os.getpid()
    try:
        libc = ctypes.CDLL("libc.so.6")
        for param, value in _MALLOPT:
            libc.mallopt(param, value)
    except (OSError, AttributeError):
        pass


def resolve_endpoint(socket: str | None) -> str:
    """``socket`` if given, else ``$CACHED_SOCKET``, else the daemon's default endpoint."""
    return socket or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET


class Connection:
    """Request/reply over one DEALER socket with several requests in flight.

    Liveness is checked apart from request time: a request may wait minutes for a shard
    to download, but a daemon that stops answering pings for ``dead_after_s`` is gone.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        connect_timeout_s: float = 5.0,
        dead_after_s: float = 15.0,
        request_timeout_s: float = 900.0,
    ) -> None:
        keep_freed_memory()
        self.endpoint = endpoint
        self.connect_timeout_s = connect_timeout_s
        self.dead_after_s = dead_after_s
        self.request_timeout_s = request_timeout_s
        self._ctx = zmq.Context()
        self._sock: zmq.Socket[bytes] | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, Header] = {}  # sent, not yet answered: re-sent on reconnect
        self._early: dict[int, tuple[Header, list[zmq.Frame]]] = {}
        self._instance: Any = None  # the daemon's start id, from its hello
        # State the daemon holds for us (plans): told again to a daemon that restarted.
        self._standing: dict[str, Header] = {}

    def _unreachable(self) -> DaemonUnavailable:
        return DaemonUnavailable(
            f"cannot reach the cached daemon at {self.endpoint}; is `cached serve` running?"
        )

    def open(self) -> None:
        """Connect and shake hands; raises :class:`DaemonUnavailable` or a version error."""
        if self._sock is not None:
            return
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        self._sock = sock
        hello_id = next(self._ids)
        sock.send(encode({"op": Op.HELLO, "id": hello_id, "v": PROTOCOL_VERSION}))
        if not sock.poll(int(self.connect_timeout_s * 1000), zmq.POLLIN):
            self.close()
            raise self._unreachable()
        header, _ = self._recv_one()
        try:
            check_reply(header)
        except RemoteError:
            self.close()
            raise
        self._instance = header.get("instance")

    def close(self) -> None:
        """Close the socket (pending requests are kept for a reconnect)."""
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._early.clear()

    def reconnect(self) -> None:
        """A fresh socket and handshake, then re-send every unanswered request.

        Requests are idempotent (reads address samples by URL and index), so a resent
        one is answered exactly as the original would have been.
        """
        previous = self._instance
        self.close()
        self.open()
        assert self._sock is not None
        for header in self._pending.values():
            self._sock.send(encode(header))
        if self._instance != previous:
            self._resend_standing()

    def send(self, header: Header, *, reply: bool = True) -> int:
        """Send a request without waiting; returns its id.

        With ``reply=False`` the answer is not awaited and is dropped when it comes (used
        for ``close``, which a client sends on its way out).
        """
        self.open()
        assert self._sock is not None
        request_id = next(self._ids)
        header = {**header, "id": request_id}
        if reply:
            self._pending[request_id] = header
        self._sock.send(encode(header))
        return request_id

    def forget(self, request_ids: list[int]) -> None:
        """Stop waiting for these requests: their replies are dropped when they come."""
        for rid in request_ids:
            self._pending.pop(rid, None)
            self._early.pop(rid, None)

    def wait(self, request_id: int) -> tuple[Header, list[zmq.Frame]]:
        """Wait for the reply to ``request_id``; raises the mapped error of an error reply."""
        header, frames = self._wait(request_id)
        check_reply(header)
        return header, frames

    def request(self, header: Header) -> tuple[Header, list[zmq.Frame]]:
        """Send a request and wait for its reply."""
        return self.wait(self.send(header))

    def _wait(self, request_id: int) -> tuple[Header, list[zmq.Frame]]:
        early = self.pop_early(request_id)
        if early is not None:
            return early
        deadline = time.monotonic() + self.request_timeout_s
        last_heard = time.monotonic()
        ping_id: int | None = None
        while True:
            assert self._sock is not None
            if self._sock.poll(1000, zmq.POLLIN):
                header, frames = self._recv_one()
                last_heard = time.monotonic()
                rid = header.get("id")
                instance = header.get("instance")
                if instance is not None and instance != self._instance:
                    # A ping's or an open's reply from a daemon that restarted under us.
                    self._restarted(instance)
                if rid == request_id:
                    self._pending.pop(request_id, None)
                    return header, frames
                if rid == ping_id:
                    ping_id = None
                else:
                    self.stash(header, frames)
                continue
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(
                    f"no reply from the cached daemon at {self.endpoint} within "
                    f"{self.request_timeout_s:.0f}s"
                )
            if now - last_heard > self.dead_after_s:
                log.warning("cached daemon at %s went quiet; reconnecting", self.endpoint)
                self._reconnect_within(self.dead_after_s)
                last_heard = time.monotonic()
                ping_id = None
            elif ping_id is None and now - last_heard > 2.0:
                # Not pending: a ping's reply only proves the daemon is alive.
                ping_id = next(self._ids)
                self._sock.send(encode({"op": Op.HELLO, "id": ping_id, "v": PROTOCOL_VERSION}))

    def _restarted(self, instance: Any) -> None:
        """The daemon restarted under us: whatever it had not answered is lost with the old
        process, so ask again (reads are idempotent; a late duplicate reply is dropped)."""
        log.warning(
            "cached daemon at %s restarted; re-sending %d requests",
            self.endpoint,
            len(self._pending),
        )
        self._instance = instance
        assert self._sock is not None
        for header in self._pending.values():
            self._sock.send(encode(header))
        self._resend_standing()

    def keep(self, key: str, header: Header) -> None:
        """Remember a request whose effect lives in the daemon (a plan), to send it again
        to a daemon that restarted; a newer one under the same ``key`` replaces it."""
        self._standing[key] = {k: v for k, v in header.items() if k != "id"}

    def _resend_standing(self) -> None:
        assert self._sock is not None
        for header in self._standing.values():
            # A fresh id nobody waits for: the reply is dropped when it arrives.
            self._sock.send(encode({**header, "id": next(self._ids)}))

    def _reconnect_within(self, budget_s: float) -> None:
        give_up = time.monotonic() + budget_s
        while True:
            try:
                self.reconnect()
                return
            except DaemonUnavailable:
                if time.monotonic() > give_up:
                    raise
                time.sleep(0.5)

    def _recv_one(self) -> tuple[Header, list[zmq.Frame]]:
        assert self._sock is not None
        parts = self._sock.recv_multipart(copy=False)
        return decode(parts[0].buffer), parts[1:]

    def recv_header_into(self) -> Header:
        """Receive only the next message's header frame (the fast path reads the payload
        frames itself with :meth:`recv_into`)."""
        assert self._sock is not None
        if not self._sock.poll(int(self.request_timeout_s * 1000), zmq.POLLIN):
            raise TimeoutError(f"no reply from the cached daemon at {self.endpoint}")
        return decode(self._sock.recv())

    def recv_rest(self) -> list[zmq.Frame]:
        """The remaining frames of the message whose header was just received."""
        assert self._sock is not None
        frames = []
        while self._sock.getsockopt(zmq.RCVMORE):
            frames.append(self._sock.recv(copy=False))
        return frames

    def stash(self, header: Header, frames: list[zmq.Frame]) -> None:
        """Keep a reply that arrived before the one being waited for; drop one that nobody
        waits for any more (forgotten, or sent with ``reply=False``)."""
        rid = header.get("id")
        if isinstance(rid, int) and self._pending.pop(rid, None) is not None:
            self._early[rid] = (header, frames)

    def settle(self, request_id: int) -> None:
        """Mark ``request_id`` answered (its reply was read by the caller itself)."""
        self._pending.pop(request_id, None)

    def has_reply(self, request_id: int) -> bool:
        """Whether the reply to ``request_id`` arrived already and waits to be taken."""
        return request_id in self._early

    def pop_early(self, request_id: int) -> tuple[Header, list[zmq.Frame]] | None:
        """A reply to ``request_id`` that arrived early, if any."""
        return self._early.pop(request_id, None)

    def recv_into(self, buffer: Any) -> int:
        """Receive the next payload frame straight into ``buffer`` (a writable buffer)."""
        assert self._sock is not None
        return self._sock.recv_into(buffer)

    def __del__(self) -> None:
        try:
            self.close()
            self._ctx.term()
        except Exception:  # best effort at interpreter exit
            pass
