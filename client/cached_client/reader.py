"""Reading one shard from the daemon: open, then pipelined reads of sample ranges."""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator

import zmq

from .protocol import Op
from .transport import Connection

# One read request asks for about this many payload bytes: large enough to amortize the
# round trip, small enough that a few in flight stay a bounded amount of memory.
TARGET_REQUEST_BYTES = 4 << 20
MAX_REQUEST_SAMPLES = 4096

RawSample = tuple[str, list[tuple[str, zmq.Frame]]]


def shard_length(conn: Connection, url: str, stream: str) -> int:
    """The number of samples in a shard (fetches it into the hot tier, pins nothing)."""
    header, _ = conn.request({"op": Op.OPEN, "url": url, "stream": stream, "pin": False})
    return int(header["samples"])


def send_open(conn: Connection, url: str, stream: str) -> int:
    """Send an open (the daemon fetches the shard on a miss and pins it); returns its id."""
    return conn.send({"op": Op.OPEN, "url": url, "stream": stream})


def release(conn: Connection, url: str, stream: str) -> None:
    """Release the stream's pin on a shard without waiting (best effort: a daemon that is
    gone lets the lease lapse on its own)."""
    with contextlib.suppress(Exception):
        conn.send({"op": Op.CLOSE, "url": url, "stream": stream}, reply=False)


def read_shard(
    conn: Connection,
    url: str,
    stream: str,
    *,
    start: int = 0,
    stop: int | None = None,
    inflight: int = 4,
    opened: int | None = None,
) -> Iterator[RawSample]:
    """Yield ``(key, [(ext, frame), ...])`` for samples ``start..stop`` of one shard, in order.

    At most ``inflight`` read requests are outstanding (back-pressure: the daemon never
    queues more for this reader). ``opened`` is the id of an open already sent with
    :func:`send_open` (reading ahead across shards); None opens now. Leaving early
    releases the shard's pin.
    """
    header, _ = conn.wait(send_open(conn, url, stream) if opened is None else opened)
    n = int(header["samples"])
    stop = n if stop is None else min(stop, n)
    avg = max(1, int(header["payload"]) // max(1, n))
    per_request = max(1, min(MAX_REQUEST_SAMPLES, TARGET_REQUEST_BYTES // avg))
    queue: deque[int] = deque()
    cursor = start
    finished = False
    try:
        while queue or cursor < stop:
            while len(queue) < inflight and cursor < stop:
                count = min(per_request, stop - cursor)
                queue.append(
                    conn.send(
                        {
                            "op": Op.READ,
                            "url": url,
                            "stream": stream,
                            "start": cursor,
                            "count": count,
                        }
                    )
                )
                cursor += count
            reply, frames = conn.wait(queue.popleft())
            i = 0
            for key, members in reply["samples"]:
                yield key, [(ext, frames[i + j]) for j, (ext, _size) in enumerate(members)]
                i += len(members)
        finished = stop == n
    finally:
        conn.forget(list(queue))
        if not finished:
            release(conn, url, stream)
