"""A reply as a reader takes it: its header, and its payload frames in hand (stashed),
still on the socket (for the caller to receive into its own buffers), or in the shard file
(a local reply, :class:`~cached_client.local.LocalRead`).

A reply left on the socket is valid until its connection reads the next message: the
connection (:class:`Receiver`) counts the headers it has received, and a reply whose count
is not the connection's any more refuses to read (its frames were discarded).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import zmq
from cached_wire import protocol
from cached_wire.protocol import Header

from ..errors import ProtocolError
from ..local import LocalRead, copy_frame


def decode(frame: bytes | memoryview) -> Header:
    """A header frame, or the client's :class:`~cached_client.errors.ProtocolError`."""
    try:
        return protocol.decode(frame)
    except protocol.ProtocolError as exc:
        raise ProtocolError(str(exc)) from exc


class Receiver(Protocol):
    """The connection whose socket a reply's frames are still on (the channel's own
    fields: :class:`~cached_client.transport.channel.Channel`): its socket (None once
    closed), the headers received so far, and the rest of the message being read."""

    _sock: zmq.Socket[bytes] | None
    _messages: int

    def _recv_rest(self) -> list[zmq.Frame]: ...


class Reply:
    """A reply's header, and its payload frames: in hand (stashed), or still on the socket.

    Take the frames in order, each once, with :meth:`read_into` or :meth:`frames`. Frames
    left unread are discarded by the connection before it reads the next message.
    """

    def __init__(
        self,
        header: Header,
        frames: list[zmq.Frame] | None,
        conn: Receiver | None = None,
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
