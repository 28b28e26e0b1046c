"""A synchronous ZeroMQ DEALER to the daemon: the client's one receive layer.

One :class:`Connection` per stream (per DataLoader worker, or the fast-path reader). It is
opened lazily in the process that uses it and never crosses a fork. Both readers receive
through :meth:`Connection.receive`, which owns everything that can go wrong between a
request and its reply:

- liveness: a daemon that stops answering pings for ``dead_after_s`` is redialled;
- restarts: a reply from a new daemon instance re-sends every unanswered request and the
  standing state (plans) the old instance held;
- early replies: a reply to another request is stashed until that request is awaited;
  one that nobody awaits any more is dropped;
- receiving in place: a reply can be handed over with its payload frames still on the
  socket, for the caller to receive into its own buffers (:meth:`Reply.read_into`);
- draining: whatever a caller left unread of such a reply (an error, an early exit) is
  discarded before the next message is read, so a payload frame is never taken for a
  header;
- local reads: on the daemon's node, reads ask for the shard file's layout instead of its
  bytes, and the reply's members come from the file (``local.py``); where the files cannot
  be read, the same request goes through the socket.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import zmq

from . import protocol
from .diagnose import explain_unreachable
from .errors import (
    DaemonTimeout,
    DaemonUnavailable,
    LocalReadsUnavailable,
    ProtocolError,
    RemoteError,
    RequestTooLarge,
    check_reply,
)
from .heartbeat import Heartbeat
from .layouts import check_refetch, described
from .local import LocalFiles, LocalRead, LocalUnavailable, copy_frame
from .memory import tune_malloc
from .protocol import (
    DEFAULT_SOCKET,
    PROTOCOL_VERSION,
    SOCKET_ENV,
    ErrorCode,
    Header,
    Op,
    encode,
)

log = logging.getLogger(__name__)

# With no message for this long, ask the daemon whether it is alive (a hello).
PING_AFTER_S = 2.0
# Shards whose open a connection remembers (a few dozen bytes each; see whole_read).
MAX_OPENED = 1 << 16
# Error codes a request is sent again after (docs/protocol.md, "Errors"): the daemon could
# not serve it now (no room yet; an unexpected failure inside it), not "no". Only opens and
# reads: they address samples by URL and index, so a repeat is answered as the first
# would have been, and a failed one took no pin.
TRANSIENT_CODES = frozenset({ErrorCode.CACHE_FULL, ErrorCode.INTERNAL})
RETRIED_OPS = frozenset({Op.OPEN, Op.READ})
# Repeats of such a request at most, after 0.5, 1 and 2 s.
TRANSIENT_RETRIES = 3
TRANSIENT_DELAY_S = 0.5
# Fields of a sent request that its repeat sets afresh (send adds them again as it may).
_RESENT_AFRESH = ("id", "local", "packed", "release")


def resolve_endpoint(socket: str | None) -> str:
    """``socket`` if given, else ``$CACHED_SOCKET``, else the daemon's default endpoint."""
    return socket or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET


def decode(frame: bytes | memoryview) -> Header:
    """A header frame, or the client's :class:`~cached_client.errors.ProtocolError`."""
    try:
        return protocol.decode(frame)
    except protocol.ProtocolError as exc:
        raise ProtocolError(str(exc)) from exc


class Reply:
    """A reply's header, and its payload frames: in hand (stashed), or still on the socket.

    Take the frames in order, each once, with :meth:`read_into` or :meth:`frames`. Frames
    left unread are discarded by the connection before it reads the next message.
    """

    def __init__(
        self,
        header: Header,
        frames: list[zmq.Frame] | None,
        conn: Connection | None = None,
        *,
        local: LocalRead | None = None,
    ) -> None:
        self.header = header
        self._held: Iterator[Any] | None = None if frames is None else iter(frames)
        self._conn = conn
        self._message = conn._messages if conn is not None else 0
        self._local = local

    def _live_socket(self) -> zmq.Socket[bytes]:
        conn = self._conn
        if conn is None or conn._sock is None or conn._messages != self._message:
            raise ProtocolError("the reply's frames were discarded: take them before the next")
        return conn._sock

    @property
    def local(self) -> LocalRead | None:
        """A local reply's members in the shard file; None for a reply through the socket."""
        return self._local

    def samples(self) -> list[Any]:
        """The reply's samples, ``[key, [[ext, size, ...], ...]]`` each; a local reply's
        decoded from its packed layout (once)."""
        if self._local is not None:
            return self._local.samples()
        samples: list[Any] = self.header["samples"]
        return samples

    def read_into(self, buffer: Any) -> int:
        """Receive the next payload frame into ``buffer`` (writable, at least the frame's
        size); returns the frame's size. Raises :class:`ProtocolError` if there is none."""
        got = self.read_many([buffer])
        if not got:
            raise ProtocolError("the reply has fewer payload frames than it announced")
        return got[0]

    def read_many(self, buffers: Sequence[Any]) -> list[int]:
        """Receive the next payload frames, one into each of ``buffers`` (writable, each at
        least its frame's size); returns their sizes, fewer than ``buffers`` where the
        reply has no more. A local reply reads them from the shard file in as few system
        calls as their places in it allow."""
        if self._local is not None:
            return self._local.read_many(buffers)
        sizes: list[int] = []
        for buffer in buffers:
            if self._held is not None:
                frame = next(self._held, None)
                if frame is None:
                    break
                sizes.append(copy_frame(frame, buffer))
                continue
            sock = self._live_socket()
            if not sock.getsockopt(zmq.RCVMORE):
                break
            # All parts of a message arrive together: this never waits for the network.
            sizes.append(int(sock.recv_into(buffer)))
        return sizes

    def frames(self) -> list[zmq.Frame]:
        """Every payload frame not yet taken."""
        if self._local is not None:
            return self._local.frames()
        if self._held is not None:
            return list(self._held)
        self._live_socket()
        assert self._conn is not None
        return self._conn._recv_rest()


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
        local_reads: bool | None = None,
    ) -> None:
        """``local_reads``: read sample bytes from the hot tier's files where this process
        can (None, "auto"), always (True: :class:`LocalReadsUnavailable` where it cannot),
        or never (False)."""
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
        self.local_reads = local_reads
        self._local_on = local_reads is not False  # reads still ask for local replies
        self._files = LocalFiles()
        self._local_sent: dict[int, Header] = {}  # local reads, until their reply is taken
        self._local_answered = False
        self._features: frozenset[str] = frozenset()  # from the daemon's hello
        # The largest request the daemon takes (its hello's "limits"; None: not said).
        self._max_request_bytes: int | None = None
        # Pins given back with the stream's next open or read ("release"), by stream.
        self._releases: dict[str, list[str]] = {}
        # What opens said of each shard (samples, payload bytes), the most recent last: a
        # shard read before is read again without an open (see whole_read).
        self._opened: OrderedDict[str, tuple[int, int]] = OrderedDict()
        # Reads asked only of a resident shard, until their reply is taken.
        self._if_resident: dict[int, Header] = {}
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

    def close(self) -> None:
        """Close the socket (pending requests are kept for a reconnect)."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        # The files first: closing the socket lets the daemon drop this connection's
        # leases, and a descriptor must never outlive its lease.
        self._files.close()
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

    def send(self, header: Header, *, reply: bool = True, local: bool = True) -> int:
        """Send a request without waiting; returns its id.

        With ``reply=False`` the answer is not awaited and is dropped when it comes (used
        for ``close``, which a client sends on its way out). A read asks for a local reply
        while local reads are on, unless ``local`` is false.
        """
        self.open()
        self._heard()
        assert self._sock is not None
        request_id = next(self._ids)
        header = {**header, "id": request_id}
        op = header.get("op")
        if local and self._local_on and op == Op.READ:
            if "packed" not in self._features:
                # A local reply's layout is one packed frame (D34); a daemon that cannot
                # send one (older than this client) is read through the socket.
                self._lost(
                    LocalUnavailable("the daemon does not send packed layouts", lasting=True)
                )
            else:
                header["local"] = True
                header["packed"] = True  # the only form now; a daemon of 0.1 packs if asked
                self._local_sent[request_id] = header
        if self._releases and op in (Op.OPEN, Op.READ):
            released = self._releases.pop(str(header.get("stream")), None)
            if released:
                header["release"] = released
        message = encode(header)
        most = self._max_request_bytes
        if most is not None and len(message) > most:
            self._local_sent.pop(request_id, None)
            raise RequestTooLarge(
                f"a {op} request of {len(message)} bytes is larger than the cached daemon at "
                f"{self.endpoint} takes ([server] max_request_bytes = {most}); send less at "
                "once (a plan of fewer shards), or raise the limit"
            )
        if reply:
            self._pending[request_id] = header
            if header.get("if_resident"):
                self._if_resident[request_id] = header
        self._sock.send(message)
        return request_id

    def remember_open(self, url: str, header: Header) -> None:
        """Keep what an open's reply said of ``url``'s shard (see :meth:`whole_read`)."""
        self._opened[url] = (int(header["samples"]), int(header["payload"]))
        self._opened.move_to_end(url)
        while len(self._opened) > MAX_OPENED:
            self._opened.popitem(last=False)

    def whole_read(self, url: str, *, max_bytes: int, max_samples: int) -> bool:
        """Whether ``url``'s shard can be read with one whole read and no open (D33): a
        daemon that offers it, local reads on, and a shard an open of this connection has
        described, small enough for one read. Its read then asks to be answered only if
        the shard is resident; if it is not, :meth:`receive` asks again as a demand."""
        if "whole" not in self._features or not self._local_on:
            return False
        known = self._opened.get(url)
        return known is not None and known[0] <= max_samples and known[1] <= max_bytes

    @property
    def asks_local(self) -> bool:
        """Whether reads still ask for local replies (each then asks for about 64 MiB and at
        most 4096 samples; a whole read only of a shard within both)."""
        return self._local_on

    @property
    def holds_local_leases(self) -> bool:
        """Whether the daemon has answered a read locally on this connection: then it
        keeps the stream's leases until ``close`` (see :meth:`release`), also after the
        connection went back to the socket."""
        return self._local_answered

    def release(self, url: str, stream: str) -> None:
        """Give back the stream's pin on ``url``'s shard, without waiting: with the
        stream's next open or read where the daemon understands that (one request less
        per shard), else by a ``close`` now. Best effort: a daemon that is gone lets the
        lease lapse on its own.

        The shard's files are closed first, here: the lease is what keeps the daemon from
        unlinking a file, so no descriptor of this connection outlives it."""
        self._files.release(url)
        if "release" in self._features:
            self._releases.setdefault(stream, []).append(url)
        else:
            self._close_now(url, stream)

    def flush_releases(self, stream: str) -> None:
        """Give back at once the pins of ``stream`` that wait for its next request (it is
        done reading: no request may follow)."""
        for url in self._releases.pop(stream, []):
            self._close_now(url, stream)

    def _close_now(self, url: str, stream: str) -> None:
        """Send ``close`` without waiting for its answer (best effort, see :meth:`release`)."""
        with contextlib.suppress(Exception):
            self.send({"op": Op.CLOSE, "url": url, "stream": stream}, reply=False)

    def forget(self, request_ids: list[int]) -> None:
        """Stop waiting for these requests: their replies are dropped when they come."""
        for rid in request_ids:
            self._pending.pop(rid, None)
            self._early.pop(rid, None)
            self._local_sent.pop(rid, None)
            self._if_resident.pop(rid, None)

    def wait(self, request_id: int) -> tuple[Header, list[zmq.Frame]]:
        """Wait for the reply to ``request_id`` and take all its frames; raises the mapped
        error of an error reply (after asking again, see :meth:`answer`)."""
        reply = self.answer(request_id)
        if reply.local is not None:
            # A local reply's samples are in its packed layout: said as a socket reply's.
            return {**reply.header, "samples": reply.samples()}, reply.frames()
        return reply.header, reply.frames()

    def answer(self, request_id: int, *, in_place: bool = False) -> Reply:
        """:meth:`receive`'s reply to ``request_id``, checked: raises the mapped error of
        an error reply. An open or read answered with a transient error
        (:data:`TRANSIENT_CODES`, not ``lasting``) is sent again first,
        :data:`TRANSIENT_RETRIES` times at most."""
        sent = self._pending.get(request_id)
        reply = self.receive(request_id, in_place=in_place)
        for retry in range(TRANSIENT_RETRIES):
            code = reply.header.get("code")
            if reply.header.get("ok") or code not in TRANSIENT_CODES or sent is None:
                break
            if reply.header.get("lasting") is True or sent.get("op") not in RETRIED_OPS:
                break  # no room will ever come (a shard larger than the tier), say
            delay = TRANSIENT_DELAY_S * 2**retry
            log.warning(
                "cached daemon at %s answered %s %s (%s); asking again in %.1fs",
                self.endpoint,
                sent.get("op"),
                code,
                reply.header.get("message"),
                delay,
            )
            time.sleep(delay)
            again = {k: v for k, v in sent.items() if k not in _RESENT_AFRESH}
            reply = self.receive(self.send(again, local="local" in sent), in_place=in_place)
        check_reply(reply.header)
        return reply

    def request(self, header: Header) -> tuple[Header, list[zmq.Frame]]:
        """Send a request and wait for its reply."""
        return self.wait(self.send(header))

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
        """The reply to ``request_id``; a local one reads its members from the file. A
        read asked only of a resident shard that was not is asked again, as a demand."""
        asked = self._if_resident.pop(request_id, None)
        if asked is not None and header.get("ok") and header.get("resident") is False:
            self._local_sent.pop(request_id, None)
            skip = ("id", "if_resident", "local", "release")
            demand = {k: v for k, v in asked.items() if k not in skip}
            return self.receive(self.send(demand), in_place=frames is None)
        sent = self._local_sent.pop(request_id, None)
        if sent is None or not header.get("ok") or "local" not in header:
            if sent is not None and header.get("ok"):
                # The daemon does not offer local reads ([server] local_reads, or older).
                self._lost(LocalUnavailable("the daemon does not offer local reads", lasting=True))
            # Frames left on the socket (in place) are read through the connection.
            return Reply(header, frames, self if frames is None else None)

        self._local_answered = True

        url = str(sent.get("url", ""))

        def refetch() -> list[zmq.Frame]:
            skip = ("id", "local", "if_resident", "packed")
            request = {k: v for k, v in sent.items() if k not in skip}
            # Says that the local reply went unused, so the daemon counts its bytes once.
            request["refetch"] = True
            again, frames = self.wait(self.send(request, local=False))
            check_refetch(url, described(local.samples()), again)
            return frames

        local = LocalRead(
            self._files, header, frames[0] if frames else None, refetch, self._lost, url=url
        )
        return Reply(header, [], local=local)

    def _lost(self, exc: LocalUnavailable) -> None:
        """Local reads will not work from this process: stop asking for them, or, where
        they were required, say so."""
        if self.local_reads:
            raise LocalReadsUnavailable(
                f"local reads were required (local_reads=True or $CACHED_LOCAL_READS=on) "
                f"and {exc}; run the reader on the daemon's node as a member of its group "
                "(docs/operations.md, 'Local reads'), or let it read through the socket"
            )
        if self._local_on:
            log.info("reading through the socket from now on: %s", exc)
        self._local_on = False

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
