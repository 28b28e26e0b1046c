"""The hot tier's shard record: a shard's states (FETCHING, READY) and what the tier keeps of
each, the errors a shard's life raises, what a download reserves, and the names and modes
of the files in the tier's directory.

States and transitions (only the event loop thread changes them; :mod:`.invariants`
numbers what holds between them)::

    absent --reserve()--> FETCHING --publish()--> READY --evict()--> absent
                              \\--abort()--> absent
    READY --drop_corrupt()--> absent (a read or a check found it rotten)

A shard dropped while readers pin it is an orphan (:attr:`HotTier._orphans`) until its
last unpin; a new download of the same id renews that object, so the pins stay on it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from ..errors import CacheError
from ..stores.base import ObjectInfo
from .index import ShardIndex

# An evicted shard's data file, renamed to this while a worker thread unlinks it.
EVICTED_SUFFIX = ".evicted"
# With local reads: the daemon's group may list the directory and read the shard files.
SHARED_DIR_MODE = 0o750
SHARED_FILE_MODE = 0o640


def reservation_bytes(size: int) -> int:
    """What a download of ``size`` bytes reserves in the hot tier: the shard and a margin
    for its index sidecar (settled to the real size at publication)."""
    return size + size // 16 + 65536


class NotAdmitted(Exception):
    """A prefetch would have to evict a shard needed sooner than the one it brings."""


class ShardCorrupt(CacheError):
    """A shard's bytes in the hot tier no longer match their checksums. The hot tier has
    dropped it; fetching it again (:meth:`Fetcher.ensure`) brings a good copy."""


class ShardState(enum.Enum):
    """Where a shard is in its life in the hot tier."""

    FETCHING = "fetching"
    READY = "ready"


@dataclass
class Shard:
    """A shard resident (READY) or being written (FETCHING) in the hot tier."""

    shard_id: str
    url: str
    version: str
    reserved_bytes: int
    state: ShardState = ShardState.FETCHING
    index: ShardIndex | None = None
    pins: int = 0
    pinned_bytes: int = 0  # what HotTier.pinned_total counts for it while pinned
    # The object as the store described it (persisted: a restart can serve the shard
    # while the store is unreachable). None for shards from sidecars that predate it.
    info: ObjectInfo | None = None
    checksum: int | None = None  # of the whole file (None: an old sidecar's shard)
    # False for a shard reloaded at start until its file has been read back and checked.
    verified: bool = True
    published: float = 0.0  # Unix time
    # Where local readers find the published file (HotTier.locate), made once per copy.
    location: dict[str, Any] | None = None
    # Counts renewals: a check that ran on an earlier copy does not judge the current one.
    generation: int = 0

    def renew(self, reserved_bytes: int, info: ObjectInfo) -> None:
        """Start over as a fresh download of the same shard (after a copy was found
        corrupt): the same object keeps the readers' pins."""
        self.generation += 1
        self.reserved_bytes = reserved_bytes
        self.info = info
        self.state = ShardState.FETCHING
        self.index = None
        self.checksum = None
        self.verified = True
        self.location = None


@dataclass(frozen=True)
class HotStats:
    """A snapshot of the hot tier for status and metrics."""

    shards: int
    used_bytes: int
    capacity_bytes: int  # [cache] capacity
    effective_bytes: int  # the bound kept now: the capacity, or less where the disk has less
    pinned: int
    fetching: int
    unverified: int = 0  # reloaded shards whose file has not been read back yet
