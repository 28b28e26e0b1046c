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

The rooms, each importing only those before it: :mod:`.reply` (a reply's frames: in
hand, on the socket, or in the shard file), :mod:`.channel` (the socket: handshake,
liveness, restarts, early replies, draining), :mod:`.connection` (what requests mean:
local reads, pins given back, whole reads, transient retries). Where the daemon listens
and why it gave no handshake is :mod:`cached_client.endpoint`, a floor below. Import
from here (``from cached_client.transport import Connection``).
"""

from ..endpoint import resolve_endpoint
from .channel import PING_AFTER_S, Channel
from .connection import (
    MAX_OPENED,
    RETRIED_OPS,
    TRANSIENT_CODES,
    TRANSIENT_DELAY_S,
    TRANSIENT_RETRIES,
    Connection,
)
from .reply import Reply, decode

__all__ = [
    "MAX_OPENED",
    "PING_AFTER_S",
    "RETRIED_OPS",
    "TRANSIENT_CODES",
    "TRANSIENT_DELAY_S",
    "TRANSIENT_RETRIES",
    "Channel",
    "Connection",
    "Reply",
    "decode",
    "resolve_endpoint",
]
