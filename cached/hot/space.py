"""The hot tier's space accounting: the bytes it counts (used, not yet written, being
unlinked, pinned), the bound it keeps as the disk has it (:attr:`Space.capacity_bytes`),
the snapshot status shows, and the event that wakes whoever waits for room. State only:
making room is :mod:`.room`'s job, and :class:`.hot.HotTier` holds the rest of the tier.

Bytes are accounted when reserved, before a download starts, so the directory never
holds more than the bound (docs/architecture.md, I1): the smaller of ``[cache] capacity``
and what the file system has room for (the tier's own bytes and the free space, less
``[cache] min_free``), looked up again as other programs fill or free the disk.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from ..policy import EvictionPolicy
from .openfiles import OpenFiles
from .shard import HotStats, Shard, ShardState
from .waits import OnWait

# How stale the disk's free space may be outside eviction passes (which look afresh), and
# how often a reservation waiting for room looks again: other programs free the disk
# without telling us.
DISK_LOOK_S = 1.0


class Space:
    """The tier's state and its accounting; :class:`.hot.HotTier` sets every field in its
    ``__init__`` (what each one means is said there). All methods run on the event loop
    thread."""

    dir: Path
    files: OpenFiles
    configured_bytes: int
    min_free_bytes: int
    policy: EvictionPolicy
    pin_wait_s: float
    shared: bool
    verify_reads: bool
    corrupt_found: int
    _on_evict: Callable[[Shard], None] | None
    _on_corrupt: list[Callable[[Shard, str], None]]
    _on_wait: list[OnWait]
    _shards: dict[str, Shard]
    _by_url: dict[str, str]
    _orphans: dict[str, Shard]
    _pinned_total: int
    _wanted: Counter[str]
    _used: int
    _change: asyncio.Event
    _unlinking: int
    _unwritten: int
    _effective: int
    _looked: float

    def stats(self) -> HotStats:
        """A snapshot for status and metrics."""
        shards = self._shards.values()
        return HotStats(
            shards=sum(s.state is ShardState.READY for s in shards),
            used_bytes=self._used,
            capacity_bytes=self.configured_bytes,
            effective_bytes=self.capacity_bytes,
            pinned=sum(s.pins > 0 for s in shards),
            fetching=sum(s.state is ShardState.FETCHING for s in shards),
            unverified=sum(not s.verified for s in shards),
        )

    def _short(self, need: int) -> bool:
        """Whether ``need`` more bytes pass the capacity as last looked at."""
        return self._used + need > self._effective

    def _fits_on_disk(self, need: int) -> bool:
        """Whether ``need`` more bytes fit with the evicted files still being unlinked: an
        eviction frees its bytes in the accounting at once (so no pass evicts more than it
        needs), but they stay on the disk until the worker thread's unlink is done, and a
        download may not start writing before (the hard bound)."""
        return not self._short(need + self._unlinking)

    @property
    def capacity_bytes(self) -> int:
        """The bound the tier keeps now (the effective capacity): the smaller of ``[cache]
        capacity`` and what the file system holding it has room for (its own bytes and
        the free space, less ``[cache] min_free``). At most :data:`DISK_LOOK_S` old;
        every eviction pass looks afresh."""
        if time.monotonic() - self._looked >= DISK_LOOK_S:
            self.look_at_disk()
        return self._effective

    def look_at_disk(self) -> int:
        """Look at the disk now (one statvfs): sets and returns :attr:`capacity_bytes`."""
        st = os.statvfs(self.dir)
        # The tier's bytes on the disk: its shards, what its downloads wrote so far (their
        # reservations count the rest), and evicted files being unlinked. Eviction and
        # writes move bytes between these and the free space; only other programs (and
        # the file system's own blocks) change the sum.
        ours = self._used - self._unwritten + self._unlinking  # I3, I4
        room = ours + st.f_bavail * st.f_frsize - self.min_free_bytes
        self._effective = max(0, min(self.configured_bytes, room))  # I1, I6
        self._looked = time.monotonic()
        return self._effective

    async def changed(self, timeout_s: float) -> None:
        """Wait until a shard is published, evicted or unpinned, an evicted file is
        unlinked, or ``timeout_s`` passes."""
        waiter = asyncio.ensure_future(self._change.wait())
        try:
            # asyncio.wait, not wait_for: it neither swallows a cancel of this task nor
            # cancels the waiter at the timeout (3.11).
            await asyncio.wait({waiter}, timeout=timeout_s)
        finally:
            waiter.cancel()

    def _notify(self) -> None:
        """Wake every waiter of :meth:`changed` (they re-check what they wait for)."""
        # Without a running loop in this thread (load() in a worker thread at start) nobody
        # waits, and an asyncio.Event may only be set from its loop's thread.
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._change.set()
        self._change = asyncio.Event()

    def _tar(self, shard_id: str) -> Path:
        return self.dir / f"{shard_id}.tar"

    def _idx(self, shard_id: str) -> Path:
        return self.dir / f"{shard_id}.idx"
