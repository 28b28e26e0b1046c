"""Hostile clients for the soak (``bench/soak.py --hostile``): what a stuck, buggy or
malicious process on a shared node does to the daemon, run beside the good streams.

- **deaf**: one connection that sends ``read`` requests as fast as the socket takes them
  and never reads a reply. Before the daemon bounded what one client may hold, this filled
  every request slot and every other client got ``DaemonUnavailable`` for good.
- **oversized**: a new connection every half second, each sending one request frame far
  larger than ``[server] max_request_bytes`` (256 MiB, the size that grew the daemon by
  1.5 GiB). ZeroMQ must drop the connection before it buffers the frame.
- **flood** (another local user: uid nobody, where the soak runs as root): holds as many
  connections as it can open (``FLOOD_CONNECTIONS``), opening a new one for each the
  daemon shuts. Before the daemon capped connections per user, a flood past its
  descriptor limit made libzmq abort it.
- **longurl** (uid nobody too): asks for URLs of a 4 KiB key (refused at the door) and
  announces plans of 1,000-byte keys under new names until the byte caps refuse them.
  Before URLs were weighed in bytes, 24 plans of one 4 MiB URL grew the daemon by 160 MiB.

Each reports what it sent; the good streams' latency and the daemon's memory, measured by
the soak, say whether the daemon kept them out of everyone else's way.
"""

from __future__ import annotations

import os
import resource
import select
import socket as sockets
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import zmq
from cached_wire.protocol import PROTOCOL_VERSION, Op, decode, encode

# The oversized client's frame, and how often it opens a connection to send one.
OVERSIZED_BYTES = 256 << 20
OVERSIZED_EVERY_S = 0.5
# The deaf client's requests: samples per read (a socket read, payload in the reply).
DEAF_READ_SAMPLES = 8
# The flood's connections held at once, and how often it looks for the ones shut.
FLOOD_CONNECTIONS = 3000
FLOOD_LOOK_S = 0.2
# The long-URL client's plans: this many URLs of a key this long, under a new name each.
LONG_PLAN_URLS = 500
LONG_KEY_BYTES = 1000
TOO_LONG_KEY_BYTES = 4096
# The clients that run as another user (uid nobody), and so only where the soak is root.
OTHER_USER = ("flood", "longurl")
NOBODY = 65534
KINDS = ("deaf", "oversized", "flood", "longurl")


@dataclass
class HostileReport:
    """What one hostile client did."""

    name: str
    kind: str
    requests: int = 0  # requests (or oversized frames) handed to ZeroMQ
    refused: int = 0  # sends ZeroMQ would not queue (its own high-water mark)
    connections: int = 0
    errors: str = ""
    shut: int = 0  # flood: its connections the daemon shut
    answers: dict[str, int] = field(default_factory=dict)  # longurl: replies by code
    skipped: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run(kind: str, name: str, socket: str, urls: list[str], end: float) -> HostileReport:
    """Run the hostile client ``kind`` against ``socket`` until ``end`` (monotonic)."""
    report = HostileReport(name, kind)
    if kind in OTHER_USER:
        if os.geteuid() != 0:
            report.skipped = "not root: it would share the good streams' user and its caps"
            return report
        # Descriptors of its own first (as root), then the other user.
        resource.setrlimit(resource.RLIMIT_NOFILE, (FLOOD_CONNECTIONS + 256,) * 2)
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    ctx = zmq.Context()
    try:
        if kind == "deaf":
            _deaf(ctx, socket, urls, end, report)
        elif kind == "oversized":
            _oversized(ctx, socket, end, report)
        elif kind == "flood":
            _flood(socket, end, report)
        elif kind == "longurl":
            _long_urls(ctx, socket, urls[0], end, report)
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


def _flood(socket: str, end: float, r: HostileReport) -> None:
    """Hold FLOOD_CONNECTIONS raw connections to the ipc socket; reopen each one shut."""
    path = socket.removeprefix("ipc://")
    held: dict[int, sockets.socket] = {}
    poller = select.poll()
    while time.monotonic() < end:
        while len(held) < FLOOD_CONNECTIONS and time.monotonic() < end:
            conn = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
            try:
                conn.connect(path)
            except OSError:
                conn.close()
                r.refused += 1
                break
            conn.setblocking(False)
            held[conn.fileno()] = conn
            poller.register(conn, select.POLLIN)
            r.connections += 1
            r.requests += 1
        # A shut connection reads end-of-file (the greeting the daemon sent first is read
        # and dropped).
        for fd, _ in poller.poll(FLOOD_LOOK_S * 1000):
            conn = held[fd]
            try:
                gone = not conn.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                gone = True
            if gone:
                poller.unregister(fd)
                conn.close()
                del held[fd]
                r.shut += 1
    for conn in held.values():
        conn.close()


def _long_urls(ctx: zmq.Context[Any], socket: str, url: str, end: float, r: HostileReport) -> None:
    """Ask for too long a URL, and announce plans of long URLs until the caps refuse."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(socket)
    r.connections += 1
    bucket = url.removeprefix("s3://").split("/", 1)[0]
    too_long = f"s3://{bucket}/{'k' * TOO_LONG_KEY_BYTES}.tar"
    i = 0
    requests: list[dict[str, Any]] = [{"op": Op.HELLO, "v": PROTOCOL_VERSION}]
    while time.monotonic() < end:
        i += 1
        if i % 2:
            header: dict[str, Any] = {"op": Op.OPEN, "url": too_long, "stream": "long"}
        else:
            keys = (f"{i:08d}-{n:04d}".ljust(LONG_KEY_BYTES, "x") for n in range(LONG_PLAN_URLS))
            header = {
                "op": Op.PLAN,
                "plan": f"long-{i}",
                "urls": [f"s3://{bucket}/{k}.tar" for k in keys],
            }
        for request in (*requests, header):
            request["id"] = i
            sock.send(encode(request))
            r.requests += 1
            if not sock.poll(10_000):
                r.errors = "no answer in 10 s"
                return
            reply = decode(sock.recv())
            code = "ok" if reply.get("ok") else str(reply.get("code"))
            r.answers[code] = r.answers.get(code, 0) + 1
        requests = []
        time.sleep(0.01)
    sock.close(linger=0)
