"""Another local user against a real daemon: a forked child of the test that takes another
uid (``nobody`` unless told) and speaks the protocol on a raw ZeroMQ socket of its own, as
a hostile or careless user's process would. Its replies come back as JSON on a pipe; it
never returns into pytest.
"""

from __future__ import annotations

import json
import os
import select
import time
from collections.abc import Sequence
from typing import Any

import zmq
from cached_client.protocol import decode, encode

from tests.test_socket_access import NOBODY


def as_other_user(
    endpoint: str,
    requests: Sequence[dict[str, Any]],
    *,
    uid: int = NOBODY,
    deaf_s: float = 0.0,
    timeout_s: float = 20.0,
) -> list[dict[str, Any]]:
    """Send ``requests`` (numbered by their ``id``, given one each) as user ``uid`` on one
    connection, and return the replies in order; the connection closes once they are in.
    Each is answered before the next is sent, unless ``deaf_s``: then all are sent at once,
    the child does not read for ``deaf_s`` (a client that does not take its replies), and
    then takes them all."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        out: dict[str, Any] = {}
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out["replies"] = _speak(endpoint, requests, deaf_s, timeout_s)
            out["uid"] = os.getuid()
        except BaseException as exc:
            out["error"] = repr(exc)
        finally:
            with os.fdopen(write, "wb") as pipe:
                pipe.write(json.dumps(out).encode())
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        ready, _, _ = select.select([pipe], [], [], timeout_s + deaf_s + 10)
        assert ready, "no word from the other user's process"
        data = pipe.read()
    os.waitpid(pid, 0)
    result: dict[str, Any] = json.loads(data)
    assert "error" not in result, result
    assert result["uid"] == uid
    replies: list[dict[str, Any]] = result["replies"]
    return replies


def _speak(
    endpoint: str, requests: Sequence[dict[str, Any]], deaf_s: float, timeout_s: float
) -> list[dict[str, Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if deaf_s:
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, 1 << 16)
    sock.connect(endpoint)
    numbered = [{**r, "id": i} for i, r in enumerate(requests, 1)]
    replies: dict[int, dict[str, Any]] = {}
    try:
        if deaf_s:
            for request in numbered:
                sock.send(encode(request))
            time.sleep(deaf_s)
        deadline = time.monotonic() + timeout_s
        for request in numbered:
            if not deaf_s:
                sock.send(encode(request))
            while request["id"] not in replies:
                assert time.monotonic() < deadline, f"no reply to {request['op']}"
                if sock.poll(100):
                    frames = sock.recv_multipart()
                    reply = decode(frames[0])
                    reply["payload_bytes"] = sum(len(f) for f in frames[1:])
                    replies[reply["id"]] = reply
    finally:
        sock.close(linger=0)
        ctx.term()
    return [replies[r["id"]] for r in numbered]
