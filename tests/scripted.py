"""A scripted daemon: a real ZeroMQ ROUTER in a thread that answers hellos and reports like
the daemon and every other request with whatever the test says, including replies no correct daemon
sends (bad headers, frames of the wrong size). For the client's receive-layer tests."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import zmq
from cached_wire.protocol import PROTOCOL_VERSION, Header, decode, encode

# Given a request header, the frames to send back (header frame first); None: no answer.
Script = Callable[[Header], list[bytes] | None]


@contextmanager
def scripted_daemon(tmp: Path, script: Script, hello: Script | None = None) -> Iterator[str]:
    """Serve ``script`` on an ipc socket in ``tmp``; yields the endpoint."""
    endpoint = f"ipc://{tmp}/scripted.sock"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    stop = threading.Event()

    def answer_hello(header: Header) -> list[bytes]:
        reply = {"id": header["id"], "ok": True, "v": PROTOCOL_VERSION, "instance": "scripted"}
        return [encode(reply)]

    def serve() -> None:
        while not stop.is_set():
            if not sock.poll(50):
                continue
            ident, *frames = sock.recv_multipart()
            header = decode(frames[0])
            op = header.get("op")
            if op == "report":
                # A training loop's background report (cached_client.jobs), not part of
                # what these tests script: acknowledged like the daemon does.
                sock.send_multipart([ident, ok(header)])
                continue
            handler = (hello or answer_hello) if op == "hello" else script
            out = handler(header)
            if out is not None:
                sock.send_multipart([ident, *out])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield endpoint
    finally:
        stop.set()
        thread.join(5)
        sock.close(linger=0)
        ctx.term()


def ok(header: Header, **fields: Any) -> bytes:
    """A success reply's header frame for ``header``."""
    return encode({"id": header["id"], "ok": True, **fields})
