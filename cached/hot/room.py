"""Making room in the hot tier: a reservation (:meth:`Room.reserve`) evicts by the policy
until the shard fits, waits (bounded, :mod:`.waits`) for readers' pins or the disk, and
opens the shard's writer; eviction removes a shard's entry at once and its data file in a
worker thread; each URL keeps one version.

Too little room evicts by the policy; reservation waits only for readers to release pins
(or the disk to free up), and fails with :class:`CacheFull` when they do not within the
timeout. An evicted file leaves the disk when its worker thread has unlinked it: a
reservation that needs those bytes waits for that as well, to a deadline of its own. A
write that still finds the disk full (ENOSPC) removes its partial file; the fetcher evicts
and fetches again (:meth:`Room.disk_full`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

from ..errors import CacheFull, NeverFits
from ..stores.base import ObjectInfo
from .shard import EVICTED_SUFFIX, NotAdmitted, Shard, ShardState, reservation_bytes
from .shardwriter import ShardWriter
from .space import DISK_LOOK_S, Space
from .waits import ROOM, UNLINK, Waits

# The tier's one logger, under the name it had before the tier was split into rooms (what
# operators filter on).
log = logging.getLogger("cached.hot.tier")


class Room(Space):
    """Reservations and eviction over :class:`.space.Space`'s accounting."""

    def _adopt(self, shard: Shard) -> None:
        """Make a READY shard its URL's current one. Each URL keeps one version: an older
        one (the object was replaced, or a cold copy was promoted) is not served to new
        opens again, so it goes now rather than when eviction gets to it; one that
        readers still hold stays until eviction reaches it, or the next start."""
        previous = self._shards.get(self._by_url.get(shard.url, ""))
        if previous is not None and previous is not shard:
            if previous.published > shard.published:
                shard, previous = previous, shard
            if previous.pins == 0:  # I13: an older version goes unless a reader holds it
                log.info(
                    "dropping %s version %s: version %s replaces it",
                    shard.url,
                    previous.version,
                    shard.version,
                )
                self._evict(previous)
        self._by_url[shard.url] = shard.shard_id  # I13: the URL's one current version

    async def reserve(
        self,
        shard_id: str,
        info: ObjectInfo,
        *,
        prefetch: bool = False,
        wait_s: float | None = None,
        unlink_wait_s: float | None = None,
    ) -> ShardWriter:
        """Account room for the object ``info`` describes, evicting others, and open its
        writer.

        Waits up to ``wait_s`` (default ``pin_wait_s``; 0: not at all) for pinned or
        in-flight shards, or the disk, to make room, and up to ``unlink_wait_s`` (default
        ``pin_wait_s``: not a wait on readers) for evicted files to leave the disk;
        raises :class:`CacheFull` after that, or :class:`NeverFits` at once when the
        shard can never fit (the capacity, or the whole file system less ``min_free``, is
        smaller). Each wait is reported (:mod:`.waits`).

        A ``prefetch`` waits for no reader and evicts only what the policy admits (shards
        needed later than this one); it raises :class:`NotAdmitted` without evicting
        anything when that is not enough, or when the files it evicted are not unlinked
        within ``pin_wait_s``.
        """
        url, size = info.url, info.size
        need = reservation_bytes(size)
        if need > self.configured_bytes:
            raise NeverFits(
                f"{url} ({size} bytes) is larger than the hot tier's capacity "
                f"({self.configured_bytes} bytes); raise [cache] capacity"
            )
        st = os.statvfs(self.dir)
        if need > st.f_blocks * st.f_frsize - self.min_free_bytes:
            raise NeverFits(
                f"no room for {url} ({size} bytes) on the file system holding the hot tier "
                f"({self.dir}: {st.f_blocks * st.f_frsize} bytes in all, less [cache] "
                f"min_free {self.min_free_bytes}); lower min_free or use a larger disk"
            )
        now = time.monotonic()
        wait_s = self.pin_wait_s if wait_s is None or prefetch else wait_s
        unlink_s = self.pin_wait_s if unlink_wait_s is None else unlink_wait_s
        waits = Waits({ROOM: now + wait_s, UNLINK: now + unlink_s}, lambda: self._on_wait)
        while True:
            if prefetch:
                victims = self._admitted_victims(url, need)
                if victims is None:
                    raise NotAdmitted(url)
                for victim in victims:
                    self._evict(victim)
            if prefetch or self._make_room(need):
                if self._fits_on_disk(need):  # I1, I4: under the bound, unlinks done
                    waits.done()
                    return self._open_writer(shard_id, info, need)
                if waits.left(UNLINK) <= 0:
                    waits.done(timed_out=UNLINK)
                    if prefetch:
                        raise NotAdmitted(url)
                    raise CacheFull(
                        f"no room for {url} ({size} bytes) yet: {self._unlinking} bytes of "
                        "evicted shards are still being unlinked (a slow disk, or the "
                        "daemon's worker threads busy); raise [cache] pin_wait_s"
                    )
                # Room once the evicted files are unlinked (their worker thread wakes it).
                await waits.wait(UNLINK, self.changed, DISK_LOOK_S)
                continue
            left = waits.left(ROOM)
            # I9: only pinned or in-flight shards left, past the wait: cache_full.
            if left <= 0:
                waits.done(timed_out=ROOM)
                stats = self.stats()
                disk = (
                    f" (the disk has room for {stats.effective_bytes} of [cache] capacity "
                    f"{stats.capacity_bytes} above [cache] min_free; other programs fill it)"
                    if stats.effective_bytes < stats.capacity_bytes
                    else ""
                )
                raise CacheFull(
                    f"no room for {url} ({size} bytes): {stats.used_bytes} of "
                    f"{stats.effective_bytes} bytes are held{disk}, {stats.pinned} shards "
                    f"pinned by readers, {stats.fetching} being fetched; raise [cache] "
                    "capacity or read with fewer streams"
                )
            # A publication, eviction or unpin wakes it; room freed on the disk by another
            # program does not, so it looks again now and then.
            await waits.wait(ROOM, self.changed, DISK_LOOK_S)

    def disk_full(self, need: int) -> int:
        """A write found the disk full (ENOSPC) although the tier had room for it as it
        looked: another program took the space since, or the file system's own blocks did.
        Its partial file is gone (:meth:`ShardWriter.abort`); evict by the policy so that
        ``need`` bytes fit twice over (the second for what the accounting did not see), for
        the download to start again. Returns the bytes evicted."""
        before = self._used
        self._make_room(2 * need)  # I7: ENOSPC evicts, the fetcher fetches again
        return before - self._used

    def _open_writer(self, shard_id: str, info: ObjectInfo, need: int) -> ShardWriter:
        # I12: a copy readers still pin is renewed, so their pins stay on it.
        shard = self._orphans.pop(shard_id, None)
        if shard is None:
            shard = Shard(shard_id, info.url, info.version, need, info=info)
        else:
            shard.renew(need, info)
        self._shards[shard_id] = shard
        self._used += need  # I2: counted at reservation, before a byte is written
        self._unwritten += need  # I3
        return ShardWriter(self, shard)

    def _admitted_victims(self, url: str, need: int) -> list[Shard] | None:
        """The shards to evict, in policy order, so ``need`` bytes fit without evicting
        one the policy does not admit; None when that is not possible."""
        chosen: list[Shard] = []
        freed = 0
        self.look_at_disk()
        if not self._short(need):
            return chosen  # room as it is: no ranking (a sort of every resident shard)
        for shard in self._evictable():
            if not self._short(need - freed):
                return chosen
            if not self.policy.admits(url, shard.shard_id):  # I28
                # Victims come in eviction order: the policy wants the rest kept even more.
                return None
            chosen.append(shard)
            freed += shard.reserved_bytes
        return None if self._short(need - freed) else chosen

    def room_now(self, size: int) -> bool:
        """Whether a download of ``size`` bytes would find room at once: the room free and
        what eviction could free now (shards no reader holds or waits for), as the disk
        has it. Evicts nothing."""
        self.look_at_disk()
        need = reservation_bytes(size)
        if not self._short(need):
            return True
        return not self._short(need - sum(s.reserved_bytes for s in self._evictable()))

    def _make_room(self, need: int) -> bool:
        """Evict in policy order until ``need`` more bytes fit under the capacity as the
        disk has it now. False when only pinned or in-flight shards are left."""
        self.look_at_disk()  # once per pass, not per candidate
        if not self._short(need):
            return True
        for shard in self._evictable():
            self._evict(shard)
            if not self._short(need):
                return True
        return False

    def _evictable(self) -> Iterator[Shard]:
        """READY shards no reader holds or waits for, in the policy's eviction order. One
        ranking for the whole pass: the order of the others does not change as some are
        evicted."""
        for shard_id in self.policy.victims():
            shard = self._shards.get(shard_id)
            if (
                shard is not None
                and shard.state is ShardState.READY
                and shard.pins == 0  # I8: a pinned shard is never evicted
                and shard_id not in self._wanted  # I11
            ):
                yield shard

    def _evict(self, shard: Shard) -> None:
        self._remove(shard)
        if self._on_evict is not None:
            self._on_evict(shard)

    def _remove(self, shard: Shard) -> None:
        self._shards.pop(shard.shard_id, None)
        if self._by_url.get(shard.url) == shard.shard_id:
            del self._by_url[shard.url]
        self.policy.on_remove(shard.shard_id)  # I16
        self._used -= shard.reserved_bytes  # I2
        # Reads under way keep the file open (their descriptor outlives the unlink).
        self._idx(shard.shard_id).unlink(missing_ok=True)
        self._discard(self._tar(shard.shard_id), shard.reserved_bytes)
        self.files.forget(shard.shard_id)
        self._notify()

    def _discard(self, path: Path, size: int) -> None:
        """Remove a shard's data file without blocking the event loop: unlinking a file of
        gigabytes takes the file system long enough to stall every client. A rename (O(1))
        takes it out of the way, a worker thread unlinks it; :meth:`load` removes any that
        a stop left. Without a running loop (:meth:`load` in a thread), it unlinks here."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            path.unlink(missing_ok=True)
            return
        evicted = path.with_name(path.name + EVICTED_SUFFIX)
        try:
            path.rename(evicted)
        except FileNotFoundError:
            return
        self._unlinking += size  # I4: on the disk until the worker's unlink is done

        def unlinked(_done: object) -> None:
            self._unlinking -= size
            self._notify()  # a reservation may wait for these bytes to leave the disk

        loop.run_in_executor(None, evicted.unlink, True).add_done_callback(unlinked)
