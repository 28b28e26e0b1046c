"""The connection: what the client's requests mean, over the channel (:mod:`.channel`).

- local reads: on the daemon's node, reads ask for the shard file's layout instead of its
  bytes, and the reply's members come from the file (``local.py``); where the files cannot
  be read, the same request goes through the socket;
- pins given back: a stream's pins on the shards it is done with go with its next open
  or read (``release``), or by a ``close`` where the daemon does not take them so;
- whole reads: a shard an open has described is read again without an open (D33);
- transient errors: an open or read answered "not now" is asked again, a few times.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict

import zmq
from cached_wire.layouts import check_refetch, described
from cached_wire.protocol import ErrorCode, Header, Op, encode

from ..errors import LocalReadsUnavailable, RequestTooLarge, check_reply
from ..local import LocalFiles, LocalRead, LocalUnavailable
from .channel import Channel
from .reply import Reply

log = logging.getLogger(__name__)

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


class Connection(Channel):
    """The client's connection to the daemon: one per stream (per DataLoader worker, or
    the fast-path reader), opened lazily in the process that uses it and never across a
    fork. Requests and replies as :class:`Channel` carries them; reads local where they
    can be (see the module)."""

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
        super().__init__(
            endpoint,
            connect_timeout_s=connect_timeout_s,
            dead_after_s=dead_after_s,
            request_timeout_s=request_timeout_s,
        )
        self.local_reads = local_reads
        self._local_on = local_reads is not False  # reads still ask for local replies
        self._files = LocalFiles()
        self._local_sent: dict[int, Header] = {}  # local reads, until their reply is taken
        self._local_answered = False
        # Pins given back with the stream's next open or read ("release"), by stream.
        self._releases: dict[str, list[str]] = {}
        # What opens said of each shard (samples, payload bytes), the most recent last: a
        # shard read before is read again without an open (see whole_read).
        self._opened: OrderedDict[str, tuple[int, int]] = OrderedDict()
        # Reads asked only of a resident shard, until their reply is taken.
        self._if_resident: dict[int, Header] = {}

    def close(self) -> None:
        """Close the socket (pending requests are kept for a reconnect)."""
        self._stop_heartbeat()
        # The files first: closing the socket lets the daemon drop this connection's
        # leases, and a descriptor must never outlive its lease.
        self._files.close()
        super().close()

    def send(self, header: Header, *, reply: bool = True, local: bool = True) -> int:
        """Send a request without waiting; returns its id.

        With ``reply=False`` the answer is not awaited and is dropped when it comes (used
        for ``close``, which a client sends on its way out). A read asks for a local reply
        while local reads are on, unless ``local`` is false.
        """
        request_id = self._next_id()
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
        if reply and header.get("if_resident"):
            self._if_resident[request_id] = header
        self._transmit(request_id, header, message, reply=reply)
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

    # I39, I40: no descriptor of an evicted file, no lease left behind.
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
        super().forget(request_ids)
        for rid in request_ids:
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
            return super()._reply(request_id, header, frames)

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

    # I42: files this process cannot reach are read through the socket.
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
