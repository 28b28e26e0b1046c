"""The hot tier's state machine: which shards a directory on local NVMe holds, bounded in
bytes, in what state, who pins them, what they take of the bound, and which go when room
is short or a copy is found corrupt. Writing a shard's files is :mod:`.writer`'s job;
computing and comparing checksums, :mod:`.verify`'s.

Files, content-addressed by shard id (a hash of endpoint, URL and version):

- ``<id>.tar``  the shard, byte for byte;
- ``<id>.idx``  its sample index, origin and checksums (:mod:`.sidecar`), written before
  the ``.tar`` is published, so a ``.tar`` without an ``.idx`` is never taken for complete;
- ``<id>.*.partial`` work in progress, removed at start.

Integrity (:mod:`.verify`): the checksum of the whole file and of every member are computed
while the shard streams in (:mod:`.writer`). Every read checks the members it serves against theirs
(``verify_reads``), so bytes that rotted on disk are never sent: the shard is dropped
and fetched again. A read that fails (EIO, a file shorter than its index) drops the shard
the same way; reads are ``preadv`` (:mod:`.pread`), never a mapping, whose unreadable page
would be SIGBUS. Shards reloaded at start are also read back whole, in the
background (:mod:`.checks`, which uses this tier and is not used by it); one whose sidecar
predates checksums is checked before it is first served.

Shard states and transitions (only the event loop thread changes them)::

    absent --reserve()--> FETCHING --publish()--> READY --evict()--> absent
                              \\--abort()--> absent
    READY --drop_corrupt()--> absent (a read or a check found it rotten)

Bytes are accounted when reserved, before a download starts, so the directory never
holds more than :attr:`HotTier.capacity_bytes`, the disk as it is: the smaller of
``[cache] capacity`` and what the file system has room for (the tier's own bytes and the
free space, less ``[cache] min_free``), looked up again as other programs fill or free
the disk. Too little room evicts by the policy; reservation waits only for readers to
release pins (or the disk to free up), and fails with :class:`CacheFull` when they do not
within the timeout. An evicted file leaves the disk when its worker thread has unlinked
it: a reservation that needs those bytes waits for that as well, to a deadline of its own
(:mod:`.waits`: every wait is bounded and counted).
A write that still finds the disk full (ENOSPC) removes its partial file; the fetcher
evicts and fetches again.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CacheError, CacheFull, NeverFits
from ..policy import EvictionPolicy
from ..sources.base import ObjectInfo
from .index import Member, ShardIndex
from .openfiles import OpenFiles
from .pread import read_members
from .sidecar import Sidecar
from .waits import ROOM, UNLINK, OnWait, Waits
from .writer import ShardFiles

log = logging.getLogger(__name__)
# Runs ``fn(*args)`` in a worker thread (HotTier.read).
OffLoop = Callable[..., Awaitable[Any]]


# A read whose members add up to this many bytes is checked in a worker thread (xxhash
# releases the GIL) rather than on the event loop, which serves everyone else meanwhile.
THREAD_CHECK_BYTES = 8 << 20
# An evicted shard's data file, renamed to this while a worker thread unlinks it.
EVICTED_SUFFIX = ".evicted"
# With local reads: the daemon's group may list the directory and read the shard files.
SHARED_DIR_MODE = 0o750
SHARED_FILE_MODE = 0o640
# How stale the disk's free space may be outside eviction passes (which look afresh), and
# how often a reservation waiting for room looks again: other programs free the disk
# without telling us.
DISK_LOOK_S = 1.0


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


class HotTier:
    """The bounded shard store. All methods run on the event loop thread.

    ``verify_reads`` checks every member's checksum before its bytes are served
    (docs/decisions.md, D21).
    """

    def __init__(
        self,
        directory: Path,
        capacity_bytes: int,
        min_free_bytes: int,
        policy: EvictionPolicy,
        *,
        pin_wait_s: float = 30.0,
        shared: bool = False,
        on_evict: Callable[[Shard], None] | None = None,
        verify_reads: bool = True,
        max_open_files: int = 1024,
    ) -> None:
        self.dir = directory
        # Shard files open for socket reads: a bounded LRU (cached/tiers/openfiles.py).
        self.files = OpenFiles(max_open_files)
        self.configured_bytes = capacity_bytes  # [cache] capacity; see capacity_bytes
        self.min_free_bytes = min_free_bytes
        self.policy = policy
        self.pin_wait_s = pin_wait_s
        # Local readers (the daemon's group) open the shard files: the directory is 0750
        # and each published shard 0640, whatever the umask. Else they stay the daemon's.
        self.shared = shared
        self.verify_reads = verify_reads
        self._on_evict = on_evict
        self._on_corrupt: list[Callable[[Shard, str], None]] = []
        self._on_wait: list[OnWait] = []
        self._shards: dict[str, Shard] = {}
        self._by_url: dict[str, str] = {}  # URL -> id of its newest READY shard
        # Shards dropped as corrupt while readers held them, by id: a new download of the
        # same shard reuses the object, so that the readers' pins (and their later
        # unpins) stay on the copy they read.
        self._orphans: dict[str, Shard] = {}
        self._pinned_total = 0  # reserved bytes of the pinned shards (pin, unpin)
        # Shards readers are waiting for, by id (see :meth:`wanted`).
        self._wanted: Counter[str] = Counter()
        self._used = 0  # resident + reserved bytes
        # Set (and replaced by a fresh one) whenever a shard is published, evicted or
        # unpinned. An event, not an asyncio.Condition: a waiter cancelled twice (a
        # shutdown's bounded second cancel) can leave a Condition's lock released by a
        # task that no longer holds it (Python 3.11), failing every later waiter with
        # "Lock is not acquired" and hanging the loop's final cancellation.
        self._change = asyncio.Event()
        self.corrupt_found = 0
        # Bytes of evicted shard files being unlinked in a worker thread: already free, as
        # far as room for new downloads goes.
        self._unlinking = 0
        # Reserved bytes that downloads under way have not written yet: _used counts them,
        # the disk does not.
        self._unwritten = 0
        self._effective = capacity_bytes  # see capacity_bytes
        self._looked = -DISK_LOOK_S  # time.monotonic() of the last look at the disk

    def landing(self) -> Path:
        """A fresh file name in the tier's directory for a body that arrives before its
        shard is named (a native open's GET, D42); a ``.partial``, so a restart removes
        one left behind. Its bytes count once the shard's reservation is made, and the
        source writes none before that."""
        return self.dir / f"open-{secrets.token_hex(8)}.partial"

    # -- start -------------------------------------------------------------------------

    def load(self) -> int:
        """Prepare the directory: remove partial and orphaned files, reload complete shards.

        Returns the number of shards reloaded. Shards beyond the capacity (after a
        configuration change) are evicted.
        """
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.shared:
            self.dir.chmod(SHARED_DIR_MODE)
        for path in self.dir.iterdir():
            # Downloads cut off, and evicted files a stop left before they were unlinked.
            if path.name.endswith((".partial", EVICTED_SUFFIX)):
                path.unlink(missing_ok=True)
        for idx_path in sorted(self.dir.glob("*.idx")):
            shard_id = idx_path.stem
            tar = self._tar(shard_id)
            try:
                car = Sidecar.from_bytes(idx_path.read_bytes())
                st = tar.stat()
                if st.st_size != car.index.size_bytes:
                    raise CacheError("data file of the wrong size")
            except (CacheError, OSError) as exc:
                log.warning("dropping incomplete shard %s: %s", shard_id, exc)
                idx_path.unlink(missing_ok=True)
                tar.unlink(missing_ok=True)
                continue
            if self.shared and st.st_mode & 0o777 != SHARED_FILE_MODE:
                tar.chmod(SHARED_FILE_MODE)  # written while local reads were off
            size = car.index.size_bytes + idx_path.stat().st_size
            shard = Shard(
                shard_id,
                car.url,
                car.version,
                size,
                ShardState.READY,
                car.index,
                info=car.info,
                checksum=car.checksum,
                verified=False,
                published=car.published or st.st_mtime,
            )
            self._shards[shard_id] = shard
            self._used += size
            self.policy.on_insert(shard_id, car.url)
            self._adopt(shard)
        for tar in self.dir.glob("*.tar"):
            if tar.stem not in self._shards:
                tar.unlink(missing_ok=True)
        self._make_room(0)
        return len(self._shards)

    def _adopt(self, shard: Shard) -> None:
        """Make a READY shard its URL's current one. Each URL keeps one version: an older
        one (the object was replaced, or a cold copy was promoted) is not served to new
        opens again, so it goes now rather than when eviction gets to it; one that
        readers still hold stays until eviction reaches it, or the next start."""
        previous = self._shards.get(self._by_url.get(shard.url, ""))
        if previous is not None and previous is not shard:
            if previous.published > shard.published:
                shard, previous = previous, shard
            if previous.pins == 0:
                log.info(
                    "dropping %s version %s: version %s replaces it",
                    shard.url,
                    previous.version,
                    shard.version,
                )
                self._evict(previous)
        self._by_url[shard.url] = shard.shard_id

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

    def latest(self, url: str) -> Shard | None:
        """The newest READY shard of ``url``, whatever its version (a look, not a use)."""
        return self.get(self._by_url.get(url, ""), access=False)

    def holds(self, shard: Shard) -> bool:
        """Whether ``shard`` is still the tier's entry for its id, READY or FETCHING (not
        evicted or dropped). A copy fetched again after a drop may be the same object: its
        :attr:`Shard.generation` tells the copies apart."""
        return self._shards.get(shard.shard_id) is shard

    def path(self, shard: Shard) -> Path:
        """The file of a READY shard (pin it while you use the path)."""
        return self._tar(shard.shard_id)

    def sidecar_path(self, shard: Shard) -> Path:
        """The sidecar (``<id>.idx``) of a READY shard."""
        return self._idx(shard.shard_id)

    def locate(self, shard: Shard) -> dict[str, Any]:
        """Where a local reader finds a READY shard's bytes: the file's path, and its
        identity (inode, size, mtime), by which the reader tells the daemon's file from a
        namesake (another host's hot tier, another mount). Made once per copy (a
        published file never changes) and shared by every reply: do not modify it."""
        if shard.location is None:
            path = self._tar(shard.shard_id)
            st = path.stat()
            index = shard.index
            shard.location = {
                "path": str(path),
                "ino": st.st_ino,
                "size": st.st_size,
                "mtime_ns": st.st_mtime_ns,
                "algorithm": index.algorithm if index is not None and self.verify_reads else None,
            }
        return shard.location

    def pin(self, shard: Shard) -> None:
        """A reader holds the shard: it cannot be evicted until :meth:`unpin`."""
        if shard.pins == 0:
            shard.pinned_bytes = shard.reserved_bytes
            self._pinned_total += shard.pinned_bytes
        shard.pins += 1

    @property
    def pinned_total(self) -> int:
        """The reserved bytes of every pinned shard, kept as pins come and go (O(1), where
        :meth:`pinned_bytes` walks the tier)."""
        return self._pinned_total

    def may_pin_ahead(self, shard: Shard) -> bool:
        """Whether a reader may pin ``shard`` before it needs it (a whole read's
        ``if_resident``): always once a reader holds it; otherwise only while pins hold
        at most half the tier, so that readers' pins ahead never leave too little room
        for the shards they wait for."""
        return bool(shard.pins) or self._pinned_total + shard.reserved_bytes <= (
            self.capacity_bytes // 2
        )

    @contextlib.contextmanager
    def wanted(self, shard_id: str) -> Iterator[None]:
        """While open, a reader waits for ``shard_id``: once published, eviction spares it
        as it spares a pinned shard, so that it is still there when the reader's turn
        comes to pin it. Without this, under pressure, a reservation woken by the
        publication could evict it first, the reader fetch it again, and so on (a
        livelock seen with two readers on a tier of six shards). The reader must pin what
        it gets before it leaves the block, with no await in between."""
        self._wanted[shard_id] += 1
        try:
            yield
        finally:
            self._wanted[shard_id] -= 1
            if not self._wanted[shard_id]:
                del self._wanted[shard_id]
                self._notify()  # it may be evictable now: reservations re-check

    def unpin(self, shard: Shard) -> None:
        """Release one pin; wakes reservations waiting for room."""
        if shard.pins == 1:
            self._pinned_total -= shard.pinned_bytes
            shard.pinned_bytes = 0
        shard.pins = max(0, shard.pins - 1)
        if shard.pins == 0:
            if self._orphans.get(shard.shard_id) is shard:
                del self._orphans[shard.shard_id]
            self._notify()

    # -- integrity -------------------------------------------------------------------------

    def on_wait(self, listener: OnWait) -> None:
        """Call ``listener(wait, seconds, timed_out)`` for each kind of wait (:mod:`.waits`)
        a reservation made, once it ends."""
        self._on_wait.append(listener)

    def on_corrupt(self, listener: Callable[[Shard, str], None]) -> None:
        """Call ``listener(shard, found)`` whenever a shard is dropped as corrupt; ``found``
        is ``"read"`` (a read's members failed their checksums), ``"io"`` (a read failed:
        EIO, a short file) or ``"check"`` (its file, read back)."""
        self._on_corrupt.append(listener)

    async def read(
        self, shard: Shard, members: Sequence[Member], off_loop: OffLoop | None = None
    ) -> list[Any]:
        """The bytes of ``members`` of a READY shard, one buffer each (a ZeroMQ message,
        sent as it is), each checked against its checksum first (with ``verify_reads``).
        A large read runs in a worker thread: through ``off_loop(fn, *args)`` where given
        (the server's request pool), else asyncio's.

        Raises :class:`ShardCorrupt` if one does not match, or the file cannot be read
        (EIO, shorter than its index): the shard is dropped then, and a fetch brings a
        good copy.
        """
        generation, check = shard.generation, self.verify_reads
        try:
            file = self.files.get(shard.shard_id, self._tar(shard.shard_id))
            if sum(m.size for m in members) >= THREAD_CHECK_BYTES:
                run = off_loop or asyncio.to_thread
                frames, bad = await run(read_members, file, members, check)
            else:
                frames, bad = read_members(file, members, check)
        except OSError as exc:
            why, found = f"reading it failed: {exc.strerror or exc}", "io"
        else:
            if bad is None:
                return frames
            why = f"member .{bad.ext} at byte {bad.offset} ({bad.size} bytes) fails its checksum"
            found = "read"
        if shard.generation == generation:  # else another read dropped that copy
            self.drop_corrupt(shard, why, found)
        raise ShardCorrupt(f"{shard.url}: {why} in the hot tier; fetch it again")

    def drop_corrupt(self, shard: Shard, why: str, found: str) -> None:
        """Remove a shard whose bytes on disk are not what was downloaded."""
        if self._shards.get(shard.shard_id) is not shard:
            return  # already gone (another read found it first)
        self.corrupt_found += 1
        log.error(
            "corrupt shard in the hot tier: %s (version %s, %s): %s; dropped, it is fetched "
            "again when next needed. Repeated corruption points at the disk.",
            shard.url,
            shard.version,
            self._tar(shard.shard_id),
            why,
        )
        self._remove(shard)
        if shard.pins:
            self._orphans[shard.shard_id] = shard
        for listener in self._on_corrupt:
            listener(shard, found)

    def resize(self, shard: Shard, delta_bytes: int) -> None:
        """A shard the tier holds takes ``delta_bytes`` more on disk (fewer if negative):
        its sidecar was written again. Its reservation and the tier's bytes follow."""
        shard.reserved_bytes += delta_bytes
        self._used += delta_bytes

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

    def pinned_bytes(self, except_urls: set[str]) -> int:
        """Bytes held by pinned shards (readers hold them), but those of ``except_urls``."""
        return sum(
            s.reserved_bytes for s in self._shards.values() if s.pins and s.url not in except_urls
        )

    def resident(self) -> Iterator[Shard]:
        """Every shard that is published (READY), in no particular order."""
        return (s for s in self._shards.values() if s.state is ShardState.READY)

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

    # -- writing -----------------------------------------------------------------------------

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
                if self._fits_on_disk(need):
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
        self._make_room(2 * need)
        return before - self._used

    def _open_writer(self, shard_id: str, info: ObjectInfo, need: int) -> ShardWriter:
        shard = self._orphans.pop(shard_id, None)
        if shard is None:
            shard = Shard(shard_id, info.url, info.version, need, info=info)
        else:
            shard.renew(need, info)
        self._shards[shard_id] = shard
        self._used += need
        self._unwritten += need
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
            if not self.policy.admits(url, shard.shard_id):
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
                and shard.pins == 0
                and shard_id not in self._wanted
            ):
                yield shard

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
        ours = self._used - self._unwritten + self._unlinking
        room = ours + st.f_bavail * st.f_frsize - self.min_free_bytes
        self._effective = max(0, min(self.configured_bytes, room))
        self._looked = time.monotonic()
        return self._effective

    def _evict(self, shard: Shard) -> None:
        self._remove(shard)
        if self._on_evict is not None:
            self._on_evict(shard)

    def _remove(self, shard: Shard) -> None:
        self._shards.pop(shard.shard_id, None)
        if self._by_url.get(shard.url) == shard.shard_id:
            del self._by_url[shard.url]
        self.policy.on_remove(shard.shard_id)
        self._used -= shard.reserved_bytes
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
        self._unlinking += size

        def unlinked(_done: object) -> None:
            self._unlinking -= size
            self._notify()  # a reservation may wait for these bytes to leave the disk

        loop.run_in_executor(None, evicted.unlink, True).add_done_callback(unlinked)

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


class ShardWriter:
    """Writes one shard: bytes go to a partial file and through the tar indexer as they arrive.

    The files are written by a :class:`.writer.ShardFiles`; this handle keeps the tier's
    side: what the bytes have taken of the reservation, and the shard's publication
    (FETCHING to READY) or abort.
    """

    def __init__(self, hot: HotTier, shard: Shard) -> None:
        self.hot = hot
        self.shard = shard
        self._files = ShardFiles(hot._tar(shard.shard_id), hot._idx(shard.shard_id), shard.url)
        self.bytes_written = 0
        # Of the reservation, what has been taken off the tier's unwritten bytes (None
        # once all of it has: published or aborted).
        self._landed: int | None = 0

    async def write(self, run: Sequence[bytes]) -> None:
        """Append a run of chunks; disk, index and checksum work run off the event loop.
        Bytes that are not a tar archive are dropped, and :meth:`publish` raises
        NotATarError."""
        await asyncio.to_thread(self._files.write, run)
        self._account(sum(map(len, run)))

    @property
    def path(self) -> Path:
        """The partial file: a source that writes the bytes itself (the native fetch
        path) writes them here, then calls :meth:`publish` with ``written``."""
        return self._files.partial

    def _account(self, n: int) -> None:
        """``n`` more bytes are on the disk: off the tier's unwritten bytes."""
        self.bytes_written += n
        if self._landed is not None:
            n = min(n, self.shard.reserved_bytes - self._landed)
            self._landed += n
            self.hot._unwritten -= n

    def _settle(self) -> None:
        """The reservation is on the disk or given up: none of it is unwritten any more."""
        if self._landed is not None:
            self.hot._unwritten -= self.shard.reserved_bytes - self._landed
            self._landed = None

    async def rewind(self) -> None:
        """Start again from byte 0: the source sends the whole object again (a body that
        failed its checksum in transit). Keeps the reservation."""
        await asyncio.to_thread(self._files.rewind)
        self.bytes_written = 0
        if self._landed is not None:
            self.hot._unwritten += self._landed
            self._landed = 0

    async def publish(self, written: int | None = None) -> Shard:
        """Finish the index, write the sidecar, then rename the shard into place atomically.

        ``written``: the source wrote that many bytes into :attr:`path` itself (the native
        fetch path); they are indexed and checksummed first, in one pass over the file in
        the same worker thread. Raises NotATarError for bytes that are not a tar.
        """
        shard, hot = self.shard, self.hot
        files = self._files
        published = time.time()
        mode = SHARED_FILE_MODE if hot.shared else None

        def publish() -> tuple[ShardIndex, int, int]:
            if written is not None:
                files.scan()
            return files.publish(shard.version, shard.info, published, mode)

        if written is not None:
            self._account(written)
        index, shard.checksum, sidecar_bytes = await asyncio.to_thread(publish)
        shard.published = published
        shard.index = index
        actual = index.size_bytes + sidecar_bytes
        self._settle()
        hot._used += actual - shard.reserved_bytes
        shard.reserved_bytes = actual
        shard.state = ShardState.READY
        hot.policy.on_insert(shard.shard_id, shard.url)
        hot._adopt(shard)
        hot._notify()
        return shard

    def abort(self) -> None:
        """Drop the partial file (and a sidecar written for it) and the reservation."""
        self._files.discard()
        self._settle()
        hot = self.hot
        if hot._shards.get(self.shard.shard_id) is self.shard:
            if self.shard.state is ShardState.FETCHING:  # publish wrote it, then failed
                hot._idx(self.shard.shard_id).unlink(missing_ok=True)
            del hot._shards[self.shard.shard_id]
            hot._used -= self.shard.reserved_bytes
            if self.shard.pins:  # readers of a copy dropped as corrupt still hold it
                hot._orphans[self.shard.shard_id] = self.shard
            hot._notify()
