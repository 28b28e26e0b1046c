"""Hostile clients for the soak (``bench/soak.py --hostile``): what a stuck, buggy or
malicious process on a shared node does to the daemon, run beside the good streams.

- **deaf**: one connection that sends ``read`` requests as fast as the socket takes them
  and never reads a reply. Before the daemon bounded what one client may hold, this filled
  every request slot and every other client got ``DaemonUnavailable`` for good.
- **oversized**: a new connection every half second, each sending one request frame far
  larger than ``[server] max_request_bytes`` (256 MiB, the size that grew the daemon by
  1.5 GiB). ZeroMQ must drop the connection before it buffers the frame.

Each reports what it sent; the good streams' latency and the daemon's memory, measured by
the soak, say whether the daemon kept them out of everyone else's way.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import zmq
from cached_client.protocol import PROTOCOL_VERSION, Op, encode

# The oversized client's frame, and how often it opens a connection to send one.
OVERSIZED_BYTES = 256 << 20
OVERSIZED_EVERY_S = 0.5
# The deaf client's requests: samples per read (a socket read, payload in the reply).
DEAF_READ_SAMPLES = 8
KINDS = ("deaf", "oversized")


@dataclass
class HostileReport:
    """What one hostile client did."""

    name: str
    kind: str
    requests: int = 0  # requests (or oversized frames) handed to ZeroMQ
    refused: int = 0  # sends ZeroMQ would not queue (its own high-water mark)
    connections: int = 0
    errors: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run(kind: str, name: str, socket: str, urls: list[str], end: float) -> HostileReport:
    """Run the hostile client ``kind`` against ``socket`` until ``end`` (monotonic)."""
    report = HostileReport(name, kind)
    ctx = zmq.Context()
    try:
        if kind == "deaf":
            _deaf(ctx, socket, urls, end, report)
        elif kind == "oversized":
            _oversized(ctx, socket, end, report)
        else:
            raise ValueError(f"unknown hostile client {kind!r}; expected one of {KINDS}")
    except Exception as exc:  # reported, not raised: the soak's checks are about the daemon
        report.errors = f"{type(exc).__name__}: {exc}"
    finally:
        ctx.destroy(linger=0)
    return report


def _deaf(
    ctx: zmq.Context[Any], socket: str, urls: list[str], end: float, r: HostileReport
) -> None:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(socket)
    r.connections += 1
    sock.send(encode({"op": Op.HELLO, "id": 0, "v": PROTOCOL_VERSION}))
    i = 0
    while time.monotonic() < end:
        header = {
            "op": Op.READ,
            "id": i + 1,
            "url": urls[i % len(urls)],
            "stream": "deaf",
            "start": 0,
            "count": DEAF_READ_SAMPLES,
        }
        try:
            sock.send(encode(header), zmq.NOBLOCK)
            r.requests += 1
            i += 1
        except zmq.Again:
            r.refused += 1
            time.sleep(0.001)
    sock.close(linger=0)


def _oversized(ctx: zmq.Context[Any], socket: str, end: float, r: HostileReport) -> None:
    frame = zmq.Frame(b"\0" * OVERSIZED_BYTES)  # one buffer, sent zero-copy every time
    while time.monotonic() < end:
        sock = ctx.socket(zmq.DEALER)
        # Long enough for ZeroMQ to start writing the frame before close drops it.
        sock.setsockopt(zmq.LINGER, 200)
        sock.connect(socket)
        r.connections += 1
        try:
            sock.send(frame, zmq.NOBLOCK, copy=False)
            r.requests += 1
        except zmq.Again:
            r.refused += 1
        time.sleep(OVERSIZED_EVERY_S)
        sock.close()
