"""The hot tier: a directory on local NVMe holding whole shards, bounded in bytes.

Files, content-addressed by shard id (a hash of endpoint, URL and version):

- ``<id>.tar``  the shard, byte for byte;
- ``<id>.idx``  its sample index and origin (URL, version), written before the ``.tar``
  is published, so a ``.tar`` without an ``.idx`` is never taken for complete;
- ``<id>.*.partial`` work in progress, removed at start.

Shard states and transitions (only the event loop thread changes them)::

    absent --reserve()--> FETCHING --publish()--> READY --evict()--> absent
                              \\--abort()--> absent

Bytes are accounted when reserved, before a download starts, so the directory never
holds more than ``capacity_bytes``: reservation waits for readers to release pins, and
fails with :class:`CacheFull` when they do not within the timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import mmap
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CacheError, CacheFull
from ..policy import EvictionPolicy
from .index import ShardIndex, TarIndexer

log = logging.getLogger(__name__)


class NotAdmitted(Exception):
    """A prefetch would have to evict a shard needed sooner than the one it brings."""


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
    _map: mmap.mmap | None = field(default=None, repr=False)

    def view(self, path: Path) -> memoryview:
        """The shard's bytes, mapped once and shared by every read (zero-copy frames)."""
        if self._map is None:
            with open(path, "rb") as fh:
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            # Readers go front to back; tell the kernel so it reads ahead.
            self._map.madvise(mmap.MADV_SEQUENTIAL)
        return memoryview(self._map)


@dataclass(frozen=True)
class HotStats:
    """A snapshot of the hot tier for status and metrics."""

    shards: int
    used_bytes: int
    capacity_bytes: int
    pinned: int
    fetching: int


class HotTier:
    """The bounded shard store. All methods run on the event loop thread."""

    def __init__(
        self,
        directory: Path,
        capacity_bytes: int,
        min_free_bytes: int,
        policy: EvictionPolicy,
        *,
        pin_wait_s: float = 30.0,
        on_evict: Callable[[Shard], None] | None = None,
    ) -> None:
        self.dir = directory
        self.capacity_bytes = capacity_bytes
        self.min_free_bytes = min_free_bytes
        self.policy = policy
        self.pin_wait_s = pin_wait_s
        self._on_evict = on_evict
        self._shards: dict[str, Shard] = {}
        self._used = 0  # resident + reserved bytes
        self._changed = asyncio.Condition()

    # -- start -------------------------------------------------------------------------

    def load(self) -> int:
        """Prepare the directory: remove partial and orphaned files, reload complete shards.

        Returns the number of shards reloaded. Shards beyond the capacity (after a
        configuration change) are evicted.
        """
        self.dir.mkdir(parents=True, exist_ok=True)
        for path in self.dir.iterdir():
            if path.name.endswith(".partial"):
                path.unlink(missing_ok=True)
        for idx_path in sorted(self.dir.glob("*.idx")):
            shard_id = idx_path.stem
            tar = self._tar(shard_id)
            try:
                meta, index = _read_sidecar(idx_path.read_bytes())
                if not tar.exists() or tar.stat().st_size != index.size_bytes:
                    raise CacheError("data file missing or of the wrong size")
            except (CacheError, ValueError, KeyError, OSError) as exc:
                log.warning("dropping incomplete shard %s: %s", shard_id, exc)
                idx_path.unlink(missing_ok=True)
                tar.unlink(missing_ok=True)
                continue
            size = index.size_bytes + idx_path.stat().st_size
            shard = Shard(shard_id, meta["url"], meta["version"], size, ShardState.READY, index)
            self._shards[shard_id] = shard
            self._used += size
            self.policy.on_insert(shard_id, meta["url"])
        for tar in self.dir.glob("*.tar"):
            if tar.stem not in self._shards:
                tar.unlink(missing_ok=True)
        self._make_room(0)
        return len(self._shards)

    # -- lookup ----------------------------------------------------------------------------

    def get(self, shard_id: str, *, access: bool = True) -> Shard | None:
        """The READY shard with this id, or None. Counts as an access for the policy
        unless ``access`` is false (a look, not a use)."""
        shard = self._shards.get(shard_id)
        if shard is None or shard.state is not ShardState.READY:
            return None
        if access:
            self.policy.on_access(shard_id)
        return shard

    def path(self, shard: Shard) -> Path:
        """The file of a READY shard (pin it while you use the path)."""
        return self._tar(shard.shard_id)

    def view(self, shard: Shard) -> memoryview:
        """The bytes of a READY shard."""
        return shard.view(self._tar(shard.shard_id))

    def pin(self, shard: Shard) -> None:
        """A reader holds the shard: it cannot be evicted until :meth:`unpin`."""
        shard.pins += 1

    def unpin(self, shard: Shard) -> None:
        """Release one pin; wakes reservations waiting for room."""
        shard.pins = max(0, shard.pins - 1)
        if shard.pins == 0:
            self._notify()

    async def changed(self, timeout_s: float) -> None:
        """Wait until a shard is published, evicted or unpinned, or ``timeout_s`` passes."""
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout_s)

    def stats(self) -> HotStats:
        """A snapshot for status and metrics."""
        shards = self._shards.values()
        return HotStats(
            shards=sum(s.state is ShardState.READY for s in shards),
            used_bytes=self._used,
            capacity_bytes=self.capacity_bytes,
            pinned=sum(s.pins > 0 for s in shards),
            fetching=sum(s.state is ShardState.FETCHING for s in shards),
        )

    # -- writing -----------------------------------------------------------------------------

    async def reserve(
        self, shard_id: str, url: str, version: str, size: int, *, prefetch: bool = False
    ) -> ShardWriter:
        """Account room for a shard of ``size`` bytes, evicting others, and open its writer.

        Waits up to ``pin_wait_s`` for pinned or in-flight shards to make room; raises
        :class:`CacheFull` after that, or at once when the shard can never fit.

        A ``prefetch`` never waits and evicts only what the policy admits (shards needed
        later than this one); it raises :class:`NotAdmitted` without evicting anything
        when that is not enough.
        """
        # The index sidecar is small; reserve a margin for it and settle the real size later.
        need = size + size // 16 + 65536
        if need > self.capacity_bytes:
            raise CacheFull(
                f"{url} ({size} bytes) is larger than the hot tier's capacity "
                f"({self.capacity_bytes} bytes); raise [cache] capacity"
            )
        if prefetch:
            victims = self._admitted_victims(url, need)
            if victims is None:
                raise NotAdmitted(url)
            for victim in victims:
                self._evict(victim)
            return self._open_writer(shard_id, url, version, need)
        deadline = time.monotonic() + self.pin_wait_s
        async with self._changed:
            while not self._make_room(need):
                left = deadline - time.monotonic()
                if left <= 0:
                    stats = self.stats()
                    raise CacheFull(
                        f"no room for {url} ({size} bytes): {stats.used_bytes} of "
                        f"{stats.capacity_bytes} bytes are held, {stats.pinned} shards pinned "
                        f"by readers, {stats.fetching} being fetched; raise [cache] capacity "
                        "or read with fewer streams"
                    )
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except TimeoutError:
                    continue
            return self._open_writer(shard_id, url, version, need)

    def _open_writer(self, shard_id: str, url: str, version: str, need: int) -> ShardWriter:
        shard = Shard(shard_id, url, version, need)
        self._shards[shard_id] = shard
        self._used += need
        return ShardWriter(self, shard)

    def _admitted_victims(self, url: str, need: int) -> list[Shard] | None:
        """The shards to evict, in policy order, so ``need`` bytes fit without evicting
        one the policy does not admit; None when that is not possible."""
        chosen: list[Shard] = []
        freed = 0
        for shard in self._evictable():
            if not self._short(need - freed):
                return chosen
            if not self.policy.admits(url, shard.shard_id):
                # Victims come in eviction order: the policy wants the rest kept even more.
                return None
            chosen.append(shard)
            freed += shard.reserved_bytes
        return None if self._short(need - freed) else chosen

    def _make_room(self, need: int) -> bool:
        """Evict in policy order until ``need`` more bytes fit under the capacity and above
        the disk's free-space floor. False when only pinned or in-flight shards are left."""
        if not self._short(need):
            return True
        for shard in self._evictable():
            self._evict(shard)
            if not self._short(need):
                return True
        return False

    def _evictable(self) -> Iterator[Shard]:
        """READY shards no reader holds, in the policy's eviction order. One ranking for
        the whole pass: the order of the others does not change as some are evicted."""
        for shard_id in self.policy.victims():
            shard = self._shards.get(shard_id)
            if shard is not None and shard.state is ShardState.READY and shard.pins == 0:
                yield shard

    def _short(self, need: int) -> bool:
        return self._used + need > self.capacity_bytes or self._disk_short(need)

    def _disk_short(self, need: int) -> bool:
        st = os.statvfs(self.dir)
        # Reserved bytes of fetches under way are not on disk yet but soon will be.
        pending = sum(
            s.reserved_bytes for s in self._shards.values() if s.state is ShardState.FETCHING
        )
        return st.f_bavail * st.f_frsize - pending - need < self.min_free_bytes

    def _evict(self, shard: Shard) -> None:
        self._remove(shard)
        if self._on_evict is not None:
            self._on_evict(shard)

    def _remove(self, shard: Shard) -> None:
        self._shards.pop(shard.shard_id, None)
        self.policy.on_remove(shard.shard_id)
        self._used -= shard.reserved_bytes
        # Unlink first: live memoryviews of the mapping stay valid until the frames are sent.
        self._idx(shard.shard_id).unlink(missing_ok=True)
        self._tar(shard.shard_id).unlink(missing_ok=True)
        shard._map = None
        self._notify()

    def _notify(self) -> None:
        async def wake() -> None:
            async with self._changed:
                self._changed.notify_all()

        # Called from synchronous code paths; the waiters re-check under the condition.
        asyncio.get_running_loop().create_task(wake())

    def _tar(self, shard_id: str) -> Path:
        return self.dir / f"{shard_id}.tar"

    def _idx(self, shard_id: str) -> Path:
        return self.dir / f"{shard_id}.idx"


class ShardWriter:
    """Writes one shard: bytes go to a partial file and through the tar indexer as they arrive."""

    def __init__(self, hot: HotTier, shard: Shard) -> None:
        self.hot = hot
        self.shard = shard
        self._partial = hot.dir / f"{shard.shard_id}.tar.partial"
        self._file = open(self._partial, "wb")  # noqa: SIM115 - closed by publish/abort
        self._indexer = TarIndexer(shard.url)
        self.bytes_written = 0

    def _write(self, chunk: bytes) -> None:
        self._file.write(chunk)
        self._indexer.feed(chunk)

    async def write(self, chunk: bytes) -> None:
        """Append a chunk; disk and index work run off the event loop. Raises NotATarError."""
        await asyncio.to_thread(self._write, chunk)
        self.bytes_written += len(chunk)

    async def publish(self) -> Shard:
        """Finish the index, write the sidecar, then rename the shard into place atomically."""
        shard, hot = self.shard, self.hot
        index = self._indexer.finish()
        meta = json.dumps({"url": shard.url, "version": shard.version}).encode()
        await asyncio.to_thread(self._finish_files, meta + b"\n" + index.to_bytes())
        shard.index = index
        actual = index.size_bytes + hot._idx(shard.shard_id).stat().st_size
        hot._used += actual - shard.reserved_bytes
        shard.reserved_bytes = actual
        shard.state = ShardState.READY
        hot.policy.on_insert(shard.shard_id, shard.url)
        hot._notify()
        return shard

    def _finish_files(self, meta: bytes) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        idx_partial = self.hot.dir / f"{self.shard.shard_id}.idx.partial"
        idx_partial.write_bytes(meta)
        os.replace(idx_partial, self.hot._idx(self.shard.shard_id))
        os.replace(self._partial, self.hot._tar(self.shard.shard_id))

    def abort(self) -> None:
        """Drop the partial file and the reservation."""
        self._file.close()
        self._partial.unlink(missing_ok=True)
        hot = self.hot
        if hot._shards.get(self.shard.shard_id) is self.shard:
            del hot._shards[self.shard.shard_id]
            hot._used -= self.shard.reserved_bytes
            hot._notify()


def _read_sidecar(data: bytes) -> tuple[dict[str, str], ShardIndex]:
    """Split an ``.idx`` file: one JSON line of origin, then the serialized index."""
    head, sep, body = data.partition(b"\n")
    if not sep:
        raise CacheError("index sidecar has no header line")
    meta = json.loads(head)
    if not isinstance(meta, dict) or not {"url", "version"} <= meta.keys():
        raise CacheError("index sidecar header lacks url or version")
    return meta, ShardIndex.from_bytes(body)
