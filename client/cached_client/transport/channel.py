"""The channel: request/reply over one ZeroMQ DEALER socket to the daemon, several requests
in flight, that outlives the daemon's restarts.

It owns everything that can go wrong between a request and its reply, apart from what a
request means (that is :mod:`.connection`'s):

- the handshake: the daemon's hello gives its instance, features, limits and heartbeat;
- liveness: a daemon that stops answering pings for ``dead_after_s`` is redialled;
- restarts: a reply from a new daemon instance re-sends every unanswered request and the
  standing state (plans) the old instance held;
- early replies: a reply to another request is stashed until that request is awaited;
  one that nobody awaits any more is dropped;
- draining: whatever a caller left unread of a reply received in place is discarded before
  the next message is read, so a payload frame is never taken for a header.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from typing import Any

import zmq
from cached_wire.protocol import PROTOCOL_VERSION, ErrorCode, Header, Op, encode

from ..endpoint import explain_unreachable
from ..errors import DaemonTimeout, DaemonUnavailable, ProtocolError, RemoteError, check_reply
from ..heartbeat import Heartbeat
from ..memory import tune_malloc
from .reply import Reply, decode

log = logging.getLogger(__name__)

# With no message for this long, ask the daemon whether it is alive (a hello).
PING_AFTER_S = 2.0


class Channel:
    """Request/reply over one DEALER socket with several requests in flight.

    Liveness is checked apart from request time: a request may wait minutes for a shard
    to download, but a daemon that stops answering pings for ``dead_after_s`` is gone.
    Requests are sent by the subclass (:class:`~cached_client.transport.Connection`),
    through :meth:`_next_id` and :meth:`_transmit`.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        connect_timeout_s: float,
        dead_after_s: float,
        request_timeout_s: float,
    ) -> None:
        tune_malloc()  # before the ZeroMQ context starts its I/O thread
        self.endpoint = endpoint
        self.connect_timeout_s = connect_timeout_s
        self.dead_after_s = dead_after_s
        self.request_timeout_s = request_timeout_s
        self._ctx = zmq.Context()
        self._sock: zmq.Socket[bytes] | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, Header] = {}  # sent, not yet answered: re-sent on restart
        self._early: dict[int, tuple[Header, list[zmq.Frame]]] = {}
        self._instance: Any = None  # the daemon's start id, from its hello
        # State the daemon holds for us (plans): told again to a daemon that restarted.
        self._standing: dict[str, Header] = {}
        self._messages = 0  # headers received: a Reply left on the socket is valid until the next
        self._features: frozenset[str] = frozenset()  # from the daemon's hello
        # The largest request the daemon takes (its hello's "limits"; None: not said).
        self._max_request_bytes: int | None = None
        # This connection's name for the daemon, for its heartbeat (see heartbeat.py).
        self._session = secrets.token_hex(12)
        self._heartbeat: Heartbeat | None = None

    def _unreachable(self) -> DaemonUnavailable:
        why = explain_unreachable(self.endpoint)
        return DaemonUnavailable(f"cannot reach the cached daemon at {self.endpoint}; {why}")

    def open(self) -> None:
        """Connect and shake hands; raises :class:`DaemonUnavailable` or a version error."""
        if self._sock is not None:
            return
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        self._sock = sock
        hello_id = next(self._ids)
        sock.send(encode(self._hello(hello_id)))
        if not sock.poll(int(self.connect_timeout_s * 1000), zmq.POLLIN):
            self.close()
            raise self._unreachable()
        try:
            header = self._recv_header()
            self._recv_rest()
            check_reply(header)
        except (RemoteError, ProtocolError):
            self.close()
            raise
        self._instance = header.get("instance")
        features = header.get("features")
        self._features = frozenset(features) if isinstance(features, list) else frozenset()
        limits = header.get("limits")
        most = limits.get("max_request_bytes") if isinstance(limits, dict) else None
        self._max_request_bytes = most if isinstance(most, int) else None
        beat = header.get("heartbeat_s")
        if "heartbeat" in self._features and isinstance(beat, int | float) and beat > 0:
            self._heartbeat = Heartbeat(
                self._ctx,
                self.endpoint,
                session=self._session,
                interval_s=float(beat),
                instance=self._instance,
                standing=lambda: list(self._standing.values()),
            )

    def _hello(self, request_id: int) -> Header:
        """A hello that names this connection's session (its heartbeat's)."""
        return {"op": Op.HELLO, "id": request_id, "v": PROTOCOL_VERSION, "session": self._session}

    def _stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None

    def close(self) -> None:
        """Close the socket (pending requests are kept for a reconnect)."""
        self._stop_heartbeat()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._early.clear()

    def reconnect(self) -> None:
        """A fresh socket and handshake, then re-send every unanswered request.

        Requests are idempotent (reads address samples by URL and index), so a resent
        one is answered exactly as the original would have been.
        """
        # Replies that came early are whole answers (their requests are no longer
        # pending, so nothing would ask for them again): they outlive the old socket.
        early = self._early
        self.close()
        self._early = early
        self.open()
        # The standing state too, whether or not the daemon restarted: the daemon drops
        # what a connection held (its plans) when the connection closes.
        self._resend(standing=True)

    def _next_id(self) -> int:
        """The id of a request about to be sent, on an open socket: connects first if
        need be, and acts on a restart that the heartbeat heard of."""
        self.open()
        self._heard()
        assert self._sock is not None
        return next(self._ids)

    def _transmit(self, request_id: int, header: Header, message: bytes, *, reply: bool) -> None:
        """Send ``message`` (``header``, encoded); unless ``reply`` is false its answer is
        awaited (``header`` is then pending: re-sent to a daemon that restarted)."""
        assert self._sock is not None
        if reply:
            self._pending[request_id] = header
        self._sock.send(message)

    def forget(self, request_ids: list[int]) -> None:
        """Stop waiting for these requests: their replies are dropped when they come."""
        for rid in request_ids:
            self._pending.pop(rid, None)
            self._early.pop(rid, None)

    def has_reply(self, request_id: int) -> bool:
        """Whether the reply to ``request_id`` has arrived: the replies already on the
        socket are taken off it without waiting, and kept for :meth:`receive`. Call it
        only with no reply's frames left to read in place (they would be discarded)."""
        sock = self._sock
        while request_id not in self._early and sock is not None and sock.poll(0, zmq.POLLIN):
            header = self._recv_header()
            if self._screen(header):
                self._stash(header)
            sock = self._sock  # a reconnect (see _screen) replaces it
        return request_id in self._early

    def arrived(self, request_id: int) -> Header | None:
        """The header of the reply to ``request_id`` if it has been taken off the socket
        already (by :meth:`has_reply` or while waiting for another), still to be taken by
        :meth:`receive`; else None. Looks at nothing on the socket: no system call."""
        early = self._early.get(request_id)
        return early[0] if early is not None else None

    def keep(self, key: str, header: Header) -> None:
        """Remember a request whose effect lives in the daemon (a plan), to send it again
        to a daemon that restarted; a newer one under the same ``key`` replaces it."""
        self._standing[key] = {k: v for k, v in header.items() if k != "id"}

    def supports(self, feature: str) -> bool:
        """Whether the daemon's hello listed ``feature`` (False before the first hello)."""
        return feature in self._features

    def receive(self, request_id: int, *, in_place: bool = False) -> Reply:
        """Wait for the reply to ``request_id`` (not checked for an error: the caller does).

        With ``in_place`` its payload frames are left on the socket for the caller to
        receive into its own buffers (unless the reply came early and was stashed). Raises
        :class:`DaemonTimeout` after ``request_timeout_s`` and :class:`DaemonUnavailable`
        when the daemon is gone for good.
        """
        early = self._early.pop(request_id, None)
        if early is not None:
            return self._reply(request_id, early[0], early[1])
        self.open()
        self._heard()
        deadline = time.monotonic() + self.request_timeout_s
        last_heard = time.monotonic()
        ping_id: int | None = None
        while True:
            assert self._sock is not None
            if self._sock.poll(1000, zmq.POLLIN):
                header = self._recv_header()
                last_heard = time.monotonic()
                if not self._screen(header):
                    last_heard, ping_id = time.monotonic(), None
                    continue
                rid = header.get("id")
                if rid == request_id:
                    self._pending.pop(request_id, None)
                    if in_place and "local" not in header:
                        return self._reply(request_id, header, None)
                    return self._reply(request_id, header, self._recv_rest())
                if rid == ping_id:
                    self._recv_rest()
                    ping_id = None
                else:
                    self._stash(header)
                continue
            now = time.monotonic()
            if now > deadline:
                raise DaemonTimeout(
                    f"no reply from the cached daemon at {self.endpoint} within "
                    f"{self.request_timeout_s:.0f}s"
                )
            if now - last_heard > self.dead_after_s:
                log.warning("cached daemon at %s went quiet; reconnecting", self.endpoint)
                self._reconnect_within(self.dead_after_s)
                last_heard = time.monotonic()
                ping_id = None
            elif ping_id is None and now - last_heard > PING_AFTER_S:
                # Not pending: a ping's reply only proves the daemon is alive.
                ping_id = next(self._ids)
                self._sock.send(encode({"op": Op.HELLO, "id": ping_id, "v": PROTOCOL_VERSION}))

    # -- internals -----------------------------------------------------------------------------

    def _reply(self, request_id: int, header: Header, frames: list[zmq.Frame] | None) -> Reply:
        """The reply to ``request_id``: its frames in hand, or (``frames`` None) still on
        the socket, read through this channel."""
        return Reply(header, frames, self if frames is None else None)

    def _screen(self, header: Header) -> bool:
        """Look at a message just received (its header; its other frames still on the
        socket) for news of the daemon: a restart under us (re-send what it had not
        answered), or a stop that answered a pending request with ``shutting_down``
        (not an answer: keep the request for the daemon's successor, waiting up to
        ``dead_after_s``). False when the message was such a notice and is done with."""
        instance = header.get("instance")
        if instance is not None and instance != self._instance:
            # A ping's or an open's reply from a daemon that restarted under us.
            self._restarted(instance)
        if header.get("code") == ErrorCode.SHUTTING_DOWN and header.get("id") in self._pending:
            self._recv_rest()
            log.warning(
                "cached daemon at %s is shutting down; waiting for it to come back",
                self.endpoint,
            )
            self._reconnect_within(self.dead_after_s)
            return False
        return True

    def _stash(self, header: Header) -> None:
        """Keep a reply that came before its caller asked for it (or drop it: nobody waits
        for it any more, forgotten or sent with ``reply=False``)."""
        frames = self._recv_rest()
        rid = header.get("id")
        if isinstance(rid, int) and self._pending.pop(rid, None) is not None:
            self._early[rid] = (header, frames)

    # I49: a half-read reply is never taken for a whole one.
    def _recv_header(self) -> Header:
        """The next message's header frame, after discarding what a caller left unread of
        the previous message."""
        assert self._sock is not None
        self._recv_rest()
        self._messages += 1
        return decode(self._sock.recv(copy=False).buffer)

    def _recv_rest(self) -> list[zmq.Frame]:
        """The remaining frames of the message being read."""
        assert self._sock is not None
        frames = []
        while self._sock.getsockopt(zmq.RCVMORE):
            frames.append(self._sock.recv(copy=False))
        return frames

    def _heard(self) -> None:
        """Act on a restart of the daemon that the heartbeat heard of (and this socket
        not yet): a reader that read from files, or paused, since its last request."""
        beat = self._heartbeat
        if beat is not None and beat.instance != self._instance:
            self._restarted(beat.instance)

    # I47, I48: after a daemon restart the plan is told again and reads go on.
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
        # First: the new daemon learns this socket's session (its heartbeats' target). A
        # reconnect needs no such hello: its open() said it.
        self._sock.send(encode(self._hello(next(self._ids))))
        self._resend(standing=True)

    def _resend(self, *, standing: bool) -> None:
        assert self._sock is not None
        for header in self._pending.values():
            self._sock.send(encode(header))
        if standing:
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

    def __del__(self) -> None:
        try:
            self.close()
            self._ctx.term()
        except Exception:  # best effort at interpreter exit
            pass
