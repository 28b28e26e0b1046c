"""Leases: which stream holds which resident shard. A held shard is pinned, so it is not
evicted under its reader; a lease ends with the stream's last sample (socket reads), its
``release`` or ``close`` (local reads: after the reader closed the file), its
connection's going, or a timeout without requests or heartbeats. Each lease counts
against the connection's, the user's and the daemon's quotas (:mod:`.bounds`).
"""

from __future__ import annotations

import time
from typing import cast

from .bounds import Bounds
from .hot.tier import HotTier, Shard

# A stream counts as live this long after its last read or open, lease or not: a reader
# whose reads take whole shards at once holds each lease only for a moment.
ACTIVE_S = 10.0


class Leases:
    """Which stream holds which shard. A held shard is pinned; a lease lapses after a timeout
    without requests or heartbeats (at the sweep: 1 to 1.25 times the timeout), so a killed
    client cannot pin shards forever, and goes at once with the connection that took it
    (:meth:`release_client`)."""

    def __init__(self, hot: HotTier, timeout_s: float, bounds: Bounds | None = None) -> None:
        self.hot = hot
        self.timeout_s = timeout_s
        # (stream, shard id) -> the shard, when the lease lapses, the connection holding it
        self._held: dict[tuple[str, str], tuple[Shard, float, bytes]] = {}
        self._active: dict[str, float] = {}  # stream -> when it last held a shard
        bounds = bounds or Bounds()
        self.quota, self.pinned = bounds.lease_quotas(hot.capacity_bytes)

    # I55: leases are capped per connection, uid and in total.
    def hold(self, stream: str, shard: Shard, client: bytes = b"", user: str = "") -> None:
        """Pin ``shard`` for ``stream`` (once per pair) and refresh the lease. Raises
        :class:`LimitExceeded` when ``client`` (or its ``user``, or everyone) already holds
        the most leases, or pinned bytes, allowed."""
        key = (stream, shard.shard_id)
        held = self._held.get(key)
        if held is None or held[2] != client:  # new, or the stream's new connection
            self.quota.check(client, key, 1, user)
            self.pinned.admit(client, key, shard.reserved_bytes, user)
            self.quota.admit(client, key, 1, user)
            if held is None:
                self.hot.pin(shard)
        now = time.monotonic()
        self._held[key] = (shard, now + self.timeout_s, client)
        self._active[stream] = now

    # I33: a live reader's heartbeat keeps its leases.
    def renew_client(self, client: bytes) -> int:
        """Refresh every lease ``client`` holds (its heartbeat); returns how many."""
        until = time.monotonic() + self.timeout_s
        keys = self.quota.keys_of(client)
        for key in keys:
            held = self._held.get(cast(tuple[str, str], key))
            if held is not None:
                self._held[cast(tuple[str, str], key)] = (held[0], until, client)
        return len(keys)

    def release(self, stream: str, shard_id: str) -> None:
        """Drop the stream's lease on a shard, if any."""
        held = self._held.pop((stream, shard_id), None)
        if held is not None:
            self.quota.forget((stream, shard_id))
            self.pinned.forget((stream, shard_id))
            self.hot.unpin(held[0])

    def release_client(self, client: bytes) -> int:
        """Drop every lease ``client`` (a connection that went away) holds; returns how many."""
        keys = self.quota.keys_of(client)
        for key in keys:
            stream, shard_id = cast(tuple[str, str], key)
            self.release(stream, shard_id)
        return len(keys)

    # I32: a lease lapses 1 to 1.25 x lease_timeout_s after its last renewal.
    def expire(self) -> int:
        """Release lapsed leases; returns how many."""
        now = time.monotonic()
        lapsed = [key for key, (_, until, _) in self._held.items() if until < now]
        for stream, sid in lapsed:
            self.release(stream, sid)
        return len(lapsed)

    def streams(self) -> int:
        """Streams holding a lease, or that held one in the last :data:`ACTIVE_S`."""
        now = time.monotonic()
        for stream in [s for s, at in self._active.items() if now - at > ACTIVE_S]:
            del self._active[stream]
        return len(self._active.keys() | {stream for stream, _ in self._held})
