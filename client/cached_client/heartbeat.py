"""A connection's heartbeat: a thread with a socket of its own that tells the daemon,
every ``heartbeat_s`` (its hello says how often), that the connection's reader lives.

A local reader reads a shard's members from the file with no request per read, and a
training step may keep it from the client library for minutes; neither may cost it its
leases (the pins that keep its files from being evicted) or its plans. The heartbeat
names the connection by its session (the hello's ``session``), and the daemon renews
what that connection holds. Its reply carries the daemon's ``instance``: a restart is
seen within one heartbeat whatever the reader is doing, and the heartbeat tells the new
daemon the reader's plans at once, from the connection's standing requests
(docs/protocol.md, "Heartbeats").

ZeroMQ sockets belong to one thread, so this one never touches the connection's socket:
it leaves the restart for the connection to act on at its next request
(:attr:`Heartbeat.instance`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

import zmq
from cached_wire.protocol import Header, Op, decode, encode

log = logging.getLogger(__name__)

# How long a beat waits for its answer (a daemon answers a heartbeat at once); stop()
# waits at most this.
_REPLY_WAIT_S = 0.2


class Heartbeat:
    """Beats for one connection until :meth:`stop`.

    ``standing()`` returns the requests to tell a daemon that restarted (the plans), read
    from the connection's thread's dict: a copy made under the GIL."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        endpoint: str,
        *,
        session: str,
        interval_s: float,
        instance: Any,
        standing: Callable[[], list[Header]],
    ) -> None:
        self._ctx = ctx
        self._endpoint = endpoint
        self._session = session
        self.interval_s = interval_s
        # The daemon's instance as the last heartbeat heard it; the connection compares.
        self.instance = instance
        self._standing = standing
        self._stop = threading.Event()
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name="cached-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread (it closes its socket); waits for it a moment at most."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval_s + 1)

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # No beats queued for a daemon that is away: a restarted one gets no burst of them.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, 4)
        try:
            sock.connect(self._endpoint)
            beat = {"op": Op.HEARTBEAT, "session": self._session}
            while True:
                self._send(sock, {**beat, "id": next(self._ids)})
                self._take_replies(sock)
                if self._stop.wait(self.interval_s):
                    return
        except zmq.ZMQError as exc:  # the context terminated under us: the connection closed
            log.debug("heartbeat ended: %s", exc)
        finally:
            sock.close(linger=0)

    @staticmethod
    def _send(sock: zmq.Socket[bytes], header: Header) -> None:
        with contextlib.suppress(zmq.Again):  # no daemon there now: nothing to tell
            sock.send(encode(header), zmq.NOBLOCK)

    def _take_replies(self, sock: zmq.Socket[bytes]) -> None:
        """Take what answers a beat within a moment (a daemon that is away answers
        nothing: the connection finds that out itself when it next waits), and act on a
        new instance."""
        wait_ms = int(min(_REPLY_WAIT_S, self.interval_s) * 1000)
        while sock.poll(wait_ms, zmq.POLLIN):
            wait_ms = 0
            frames = sock.recv_multipart()
            try:
                reply = decode(frames[0])
            except Exception:  # a reply we cannot read says nothing
                continue
            instance = reply.get("instance")
            if reply.get("ok") and instance is not None and instance != self.instance:
                self.instance = instance
                self._tell_again(sock)

    # I47: after a restart the heartbeat tells the plan again.
    def _tell_again(self, sock: zmq.Socket[bytes]) -> None:
        """A daemon that restarted lost the reader's plans: tell it them now (on this
        socket; the connection tells them again on its own at its next request)."""
        standing = self._standing()
        log.warning(
            "cached daemon at %s restarted; telling it %d plans again",
            self._endpoint,
            len(standing),
        )
        for header in standing:
            self._send(sock, {**header, "id": next(self._ids)})
