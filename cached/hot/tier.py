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

The tier is in rooms: the shard record and its states (:mod:`.shard`), the space
accounting (:mod:`.space`), reservations and eviction (:mod:`.room`), the tier's side of a
write (:mod:`.shardwriter`), and the invariants :meth:`HotTier.check` asserts
(:mod:`.invariants`). This room holds the tier itself: start, lookup, pins, reads and the
drop of corrupt copies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import CacheError
from ..policy import EvictionPolicy
from . import invariants
from .index import Member
from .openfiles import OpenFiles
from .pread import read_members
from .room import Room
from .shard import (
    EVICTED_SUFFIX,
    SHARED_DIR_MODE,
    SHARED_FILE_MODE,
    HotStats,
    NotAdmitted,
    Shard,
    ShardCorrupt,
    ShardState,
    reservation_bytes,
)
from .shardwriter import ShardWriter
from .sidecar import Sidecar
from .space import DISK_LOOK_S
from .waits import OnWait

__all__ = [
    "DISK_LOOK_S",
    "EVICTED_SUFFIX",
    "SHARED_DIR_MODE",
    "SHARED_FILE_MODE",
    "THREAD_CHECK_BYTES",
    "HotStats",
    "HotTier",
    "NotAdmitted",
    "Shard",
    "ShardCorrupt",
    "ShardState",
    "ShardWriter",
    "reservation_bytes",
]

log = logging.getLogger(__name__)
# Runs ``fn(*args)`` in a worker thread (HotTier.read).
OffLoop = Callable[..., Awaitable[Any]]


# A read whose members add up to this many bytes is checked in a worker thread (xxhash
# releases the GIL) rather than on the event loop, which serves everyone else meanwhile.
THREAD_CHECK_BYTES = 8 << 20


class HotTier(Room):
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
        # Shard files open for socket reads: a bounded LRU (cached/hot/openfiles.py).
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
            if path.name.endswith((".partial", EVICTED_SUFFIX)):  # I15
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
            self.policy.on_insert(shard_id, car.url)  # I16
            self._adopt(shard)
        for tar in self.dir.glob("*.tar"):
            if tar.stem not in self._shards:
                tar.unlink(missing_ok=True)
        self._make_room(0)  # I1: shards past a lowered capacity go
        return len(self._shards)

    # -- lookup ----------------------------------------------------------------------------

    def get(self, shard_id: str, *, access: bool = True) -> Shard | None:
        """The READY shard with this id, or None. Counts as an access for the policy
        unless ``access`` is false (a look, not a use)."""
        shard = self._shards.get(shard_id)
        if shard is None or shard.state is not ShardState.READY:  # I14: never a partial
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
            self._pinned_total += shard.pinned_bytes  # I10: once per shard
        shard.pins += 1

    @property
    def pinned_total(self) -> int:
        """The reserved bytes of every pinned shard, kept as pins come and go (O(1), where
        :meth:`pinned_bytes` walks the tier)."""
        return self._pinned_total

    # I67: pins ahead hold at most half the tier.
    def may_pin_ahead(self, shard: Shard) -> bool:
        """Whether a reader may pin ``shard`` before it needs it (a whole read's
        ``if_resident``): always once a reader holds it; otherwise only while pins hold
        at most half the tier, so that readers' pins ahead never leave too little room
        for the shards they wait for."""
        # I67: pins ahead hold at most half the tier.
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
        self._wanted[shard_id] += 1  # I11: spared until the reader pins it
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
            self._pinned_total -= shard.pinned_bytes  # I10
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
            self.drop_corrupt(shard, why, found)  # I17: rotten bytes are never served
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
            self._orphans[shard.shard_id] = shard  # I12: the readers' pins carry over
        for listener in self._on_corrupt:
            listener(shard, found)

    def resize(self, shard: Shard, delta_bytes: int) -> None:
        """A shard the tier holds takes ``delta_bytes`` more on disk (fewer if negative):
        its sidecar was written again. Its reservation and the tier's bytes follow."""
        shard.reserved_bytes += delta_bytes
        self._used += delta_bytes

    def pinned_bytes(self, except_urls: set[str]) -> int:
        """Bytes held by pinned shards (readers hold them), but those of ``except_urls``."""
        return sum(
            s.reserved_bytes for s in self._shards.values() if s.pins and s.url not in except_urls
        )

    def resident(self) -> Iterator[Shard]:
        """Every shard that is published (READY), in no particular order."""
        return (s for s in self._shards.values() if s.state is ShardState.READY)

    def check(self) -> None:
        """Assert the tier's invariants (docs/architecture.md, section 5), as SQLite's
        ``assert_pager_state()`` does: raises AssertionError naming the first one that
        fails. For tests, after each state change they drive; it walks every shard and
        looks at their files, so the daemon never calls it."""
        invariants.check(self)
