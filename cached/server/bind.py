"""The endpoint: the ROUTER socket with its options, bound where ``[server] socket`` says,
its ipc file given ``[server] socket_mode``/``socket_group`` whatever the umask, and never
taken from another daemon that still answers there."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import zmq
import zmq.asyncio
from cached_wire.protocol import PROTOCOL_VERSION, Op, encode

from .. import socketmode
from ..admission import Admission
from ..errors import CachedError
from ..peers import Peer, Peers
from .sendq import SNDHWM

log = logging.getLogger(__name__)

# Frames given as bytes (routing id, header, packed layout) below this are copied into
# ZeroMQ, larger ones sent zero-copy; payload frames are ZeroMQ messages already.
# Zero-copy costs a reference hand-off through pyzmq's garbage-collector thread per frame
# (29% of the daemon's CPU at 100 KB frames); a copy of 1 MiB costs less (docs/decisions.md).
COPY_THRESHOLD_BYTES = 1 << 20


async def bind(
    ctx: zmq.Context[zmq.Socket[bytes]],
    endpoint: str,
    *,
    max_request_bytes: int,
    socket_mode: str,
    socket_group: str | None,
    admission: Admission | None,
    on_gone: Callable[[Peer], None],
) -> tuple[zmq.Socket[bytes], Peers]:
    """The bound ROUTER socket at ``endpoint`` and its connections (``on_gone`` hears each
    that goes). Raises :class:`CachedError` saying what to do where it cannot bind."""
    gid = None
    if endpoint.startswith("ipc://"):
        path = Path(endpoint[len("ipc://") :])
        gid = socketmode.resolve_group(socket_group)  # before a socket exists
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CachedError(
                f"cannot create the socket's directory {path.parent} ([server] socket "
                f"{endpoint}): {exc.strerror or exc}; create it for the daemon's user "
                "(under systemd, RuntimeDirectory= does), or choose another socket"
            ) from exc
        if path.exists() and await _answers(endpoint):  # noqa: ASYNC240
            raise CachedError(
                f"another cached daemon is already serving at {endpoint}; "
                "stop it or choose another [server] socket"
            )
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    # A larger frame drops its connection as its size arrives, before it is buffered.
    # I51: an oversized frame drops its connection, not memory.
    sock.setsockopt(zmq.MAXMSGSIZE, max_request_bytes)
    sock.setsockopt(zmq.SNDHWM, SNDHWM)
    # Replies to a vanished client fail loudly instead of queueing or dropping silently.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.copy_threshold = COPY_THRESHOLD_BYTES
    # Before bind: no connection may come unseen (see cached/peers.py).
    peers = Peers(sock, on_gone, admission)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        peers.close()
        sock.close()
        raise CachedError(f"cannot bind {endpoint}: {exc}") from exc
    try:
        _set_socket_access(endpoint, socket_mode, gid, socket_group)
    except CachedError:
        peers.close()
        sock.close(linger=0)
        raise
    return sock, peers


def _set_socket_access(endpoint: str, mode: str, gid: int | None, group: str | None) -> None:
    """``[server] socket_mode``/``socket_group`` on the ipc socket, whatever the umask."""
    if not endpoint.startswith("ipc://"):
        return
    path = endpoint[len("ipc://") :]
    if path.startswith("@"):
        # Linux's abstract namespace: no file, no mode; the network namespace decides.
        log.warning("%s is an abstract socket: [server] socket_mode does not apply", path)
        return
    try:
        socketmode.apply(path, mode, gid, group)
    except CachedError:
        # Ours (bind replaced any file there): not left behind with the umask's mode.
        Path(path).unlink(missing_ok=True)
        raise
    log.info("socket %s: mode %s, group %s", path, mode, group or "the daemon's")


async def _answers(endpoint: str) -> bool:
    """Whether a daemon already answers at ``endpoint`` (so we must not steal its socket)."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        await sock.send(encode({"op": Op.HELLO, "id": 0, "v": PROTOCOL_VERSION}))
        return bool(await sock.poll(300))
    finally:
        sock.close(linger=0)
        ctx.term()
