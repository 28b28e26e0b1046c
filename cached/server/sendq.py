"""The send queue: replies handed to ZeroMQ without blocking, and those a client's queue
cannot take yet kept in its connection's backlog, in bytes within the caps of replies
waiting, until sent or dropped after ``[server] reply_timeout_s``.

ZeroMQ queues SNDHWM replies per connection; what its queue cannot take waits here (one
task per connection with a backlog tries again, backing off), and a large reply ZeroMQ
has taken counts in :class:`cached.sent.Sent` until it is written (D51)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, cast

import zmq
from cached_wire.protocol import ErrorCode, encode, error

from ..bounds import Bounds
from ..errors import LimitExceeded
from ..hot.pread import TRACK_BYTES
from ..metrics import Metrics
from ..peers import Peer, Peers
from ..quota import Quota
from ..sent import Sent
from ..weights import frames_bytes
from .checks import id_of

log = logging.getLogger(__name__)

# Replies ZeroMQ queues for one client (SNDHWM, per connection): a reader has some 20
# requests in flight; what its queue cannot take waits in the backlog (bounded by
# [server] max_requests_per_client and reply_timeout_s): each reply its own messages,
# copies of the payload, so about 256 x a read's payload for reply_timeout_s at most.
SNDHWM = 16
# Reply bytes ZeroMQ may hold for one connection, not yet written (cached/sent.py): a
# reader's 8 socket reads in flight of about 4 MiB each, twice.
SENT_BYTES_PER_CLIENT = 64 << 20
# A reply the client's queue cannot take yet (its high-water mark) is tried again after
# this long, doubling up to the second figure.
SEND_RETRY_S = (0.001, 0.05)


def waiting(sock: zmq.Socket[bytes]) -> bool:
    """Whether a message waits on ``sock`` (reading its events also re-arms its descriptor)."""
    return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


def _tracker(frames: list[Any]) -> Any:
    """The tracker of a reply's tracked frame (cached/hot/pread.py), or None."""
    for frame in reversed(frames):
        tracker = getattr(frame, "tracker", None)
        if tracker is not None:
            return tracker
    return None


class SendQueue:
    """Replies to the ROUTER's connections. :meth:`attach` gives it the bound socket and
    its connections; ``readable`` is set whenever a send finds a request waiting (a send
    may take the descriptor's signal the request loop waits for)."""

    def __init__(
        self, bounds: Bounds, replies: Quota, metrics: Metrics, readable: asyncio.Event
    ) -> None:
        self.bounds = bounds
        self.replies = replies  # the caps of replies waiting, per user and in total
        self.metrics = metrics
        self.readable = readable
        # Reply bytes ZeroMQ holds, not yet written, under the caps of replies waiting
        # per user and in total, and SENT_BYTES_PER_CLIENT per connection.
        self.sent = Sent(
            SENT_BYTES_PER_CLIENT, bounds.max_reply_bytes_per_user, bounds.max_reply_bytes
        )
        # Replies waiting in the peers' backlogs, and the tasks that send them.
        self.queued = 0
        self.flushers: set[asyncio.Task[None]] = set()
        self._sock: zmq.Socket[bytes] | None = None
        self._peers: Peers | None = None

    def attach(self, sock: zmq.Socket[bytes], peers: Peers) -> None:
        """The socket replies go out on, and its connections (a vanished one is dropped)."""
        self._sock, self._peers = sock, peers

    # I52: a request past its client's bound is refused, not held.
    def refuse(self, peer: Peer, header: bytes, message: str) -> None:
        """A request from a client over one of its bounds (``message`` says which):
        answered ``limit_exceeded`` where its queue takes the reply at once, else dropped."""
        self.metrics.requests.labels("unknown", "limit_exceeded").inc()
        if peer.backlog:
            return  # its queue is full: the answer could only wait, and it is over its bound
        reply = error(id_of(header), ErrorCode.LIMIT, message)
        self.try_send(peer, [peer.ident, encode(reply)])

    # I50: a client that never reads its replies holds only its own bound.
    def deliver(self, peer: Peer, frames: list[Any], request_id: Any = None) -> None:
        """Send a reply without blocking; one the client's queue cannot take yet waits in
        the peer's backlog (see :meth:`_flush`), in bytes within the user's and the
        daemon's caps of replies waiting (past them it becomes a ``limit_exceeded`` answer to
        request ``request_id``). Takes the reply off ``peer.requests`` once it is sent or
        dropped."""
        if peer.gone:
            peer.requests -= 1
            return
        if not peer.backlog and self.try_send(peer, frames):
            peer.requests -= 1
            return
        if peer.gone:  # the send found it gone
            peer.requests -= 1
            return
        try:
            self.replies.admit(peer.ident, id(frames), frames_bytes(frames), peer.user)
        except LimitExceeded as exc:  # a few hundred bytes, uncounted, in its place
            frames = [peer.ident, encode(error(request_id, ErrorCode.LIMIT, str(exc)))]
        peer.backlog.append((frames, time.monotonic() + self.bounds.reply_timeout_s))
        self.queued += 1
        if peer.flusher is None:
            peer.flusher = asyncio.create_task(self._flush(peer))
            self.flushers.add(peer.flusher)
            peer.flusher.add_done_callback(self.flushers.discard)

    def try_send(self, peer: Peer, frames: list[Any]) -> bool:
        """One send without blocking: True if ZeroMQ took it. A peer that the socket no
        longer knows (EHOSTUNREACH) is gone."""
        sock = self._sock
        assert sock is not None, "attach the socket first"
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
            if self._peers is not None:
                self._peers.drop(peer)
            return False
        finally:
            # A send may take the descriptor's signal of a request waiting.
            if waiting(sock):
                self.readable.set()

    async def _flush(self, peer: Peer) -> None:
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
                    elif self.try_send(peer, frames):
                        delay = SEND_RETRY_S[0]
                    else:
                        break
                    peer.backlog.popleft()
                    self.replies.forget(id(frames))
                    peer.requests -= 1
                    self.queued -= 1
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

    def forget(self, peer: Peer) -> None:
        """``peer`` went away: its replies waiting, and the bytes ZeroMQ held for it, go."""
        self.queued -= len(peer.backlog)
        peer.requests -= len(peer.backlog)
        for frames, _ in peer.backlog:
            self.replies.forget(id(frames))
        peer.backlog.clear()
        self.sent.forget(peer.ident)
        if peer.flusher is not None:
            peer.flusher.cancel()
