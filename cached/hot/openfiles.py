"""Shard files kept open for socket reads: a bounded LRU, closed when idle.

Opening a file per read would cost an ``open`` and a ``close`` per request; keeping each
resident shard's file open until it is evicted made the daemon's descriptors grow with the
tier (65,000 small shards reached ``LimitNOFILE=65536``, and then an accept aborted the
daemon: cached/descriptors.py). So at most ``most`` stay open, the least recently read
closed first, and any not read for ``idle_s`` closed at the next sweep. A read under way
holds its own reference (:class:`~.pread.ShardFile` closes with its last one), so closing
here never pulls a descriptor from under a read in a worker thread; those add at most the
worker pool's size.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path

from .pread import ShardFile

# A file not read for this long is closed at the next sweep.
IDLE_S = 60.0


class OpenFiles:
    """The shard files open for reads, by shard id. On the event loop only."""

    def __init__(self, most: int, idle_s: float = IDLE_S) -> None:
        if most < 1:
            raise ValueError("at least one shard file must be kept open")
        self.most = most
        self.idle_s = idle_s
        self._open: OrderedDict[str, tuple[ShardFile, float]] = OrderedDict()
        self.opened = 0  # files opened so far (a miss of this cache)

    def __len__(self) -> int:
        return len(self._open)

    def get(self, shard_id: str, path: Path) -> ShardFile:
        """The file of shard ``shard_id`` at ``path``, opened if it is not open; the least
        recently read one closes past the bound. Raises OSError."""
        entry = self._open.pop(shard_id, None)
        file = entry[0] if entry is not None else None
        if file is None:
            file = ShardFile(path)
            self.opened += 1
        self._open[shard_id] = (file, time.monotonic())
        while len(self._open) > self.most:
            self._open.popitem(last=False)
        return file

    def forget(self, shard_id: str) -> None:
        """Shard ``shard_id`` left the tier (or its copy was dropped): its file closes once
        no read uses it."""
        self._open.pop(shard_id, None)

    def sweep(self, now: float | None = None) -> int:
        """Close the files not read for ``idle_s``; returns how many."""
        cutoff = (time.monotonic() if now is None else now) - self.idle_s
        closed = 0
        while self._open:
            shard_id, (_, used) = next(iter(self._open.items()))
            if used > cutoff:
                break
            del self._open[shard_id]
            closed += 1
        return closed
