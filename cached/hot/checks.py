"""Vouching for the hot tier's copies reloaded at start: each is read back whole and held
against its checksums (on demand, or all of them in the background) before it is trusted
as a fresh download is, and what an older sidecar lacked (checksums, the store's
description of the object) is written into it.

It works through :class:`.hot.HotTier`'s public surface; the tier never imports it. A
check that finds a copy rotten hands it to :meth:`HotTier.drop_corrupt`, the tier's own
transition, which a read that finds rot uses too: who wants to hear of either registers
with :meth:`HotTier.on_corrupt`. Hashing the file is :mod:`.verify`'s job.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from ..once import joined
from ..stores.base import ObjectInfo
from .sidecar import Sidecar
from .tier import HotTier, Shard, ShardState
from .verify import ALGORITHM, check_file
from .writer import write_atomically

log = logging.getLogger(__name__)


class Checks:
    """The checks of one hot tier's reloaded copies. All methods run on the event loop
    thread; the reading and hashing run in worker threads."""

    def __init__(self, hot: HotTier) -> None:
        self.hot = hot
        self._checks: dict[str, asyncio.Task[bool]] = {}
        self._writes: set[asyncio.Task[None]] = set()
        self._stop = threading.Event()

    # I18: a reloaded shard whose sidecar predates checksums is checked before it is served.
    def needs_check(self, shard: Shard) -> bool:
        """Whether ``shard`` must pass :meth:`verify` before it is served: a reloaded shard
        not yet read back, unless every read checks its members anyway."""
        if shard.verified:
            return False
        return not (self.hot.verify_reads and shard.index is not None and shard.index.checksummed)

    async def verify(self, shard: Shard) -> bool:
        """Read a reloaded shard's file back and check it; True if it may be served.

        In a worker thread. A shard whose sidecar has checksums passes if its file's checksum
        matches. One from an older sidecar is re-hashed: where its version is a plain MD5
        (a single-part upload's ETag) that is checked, else its bytes are trusted as they
        are (as before checksums); its sidecar is then written with the checksums. A
        shard that fails is dropped (and fetched again when needed); False.
        """
        if shard.verified:
            return True
        sid = shard.shard_id
        return await joined(self._checks, sid, lambda: self._verify(shard), f"check {sid}")

    async def _verify(self, shard: Shard) -> bool:
        assert shard.index is not None
        hot = self.hot
        path, generation = hot.path(shard), shard.generation
        found = await asyncio.to_thread(
            check_file, path, shard.index, shard.checksum, shard.version, self._stop
        )
        if shard.generation != generation:
            # A read found the copy rotten meanwhile and it was fetched again: that one is
            # fresh (or still downloading), whatever this check found in the old file.
            return shard.state is ShardState.READY and hot.holds(shard)
        if not hot.holds(shard) or found.ok is None:
            return False  # evicted meanwhile, or shutting down
        if not found.ok:
            hot.drop_corrupt(shard, found.detail, "check")
            return False
        if shard.checksum is None:
            # On the loop, with no await before the fields are set: one pass over members.
            shard.index = shard.index.with_checksums(found.member_sums, ALGORITHM)
            shard.checksum = found.whole
            shard.location = None  # its algorithm is known now
            await self._rewrite_sidecar(shard)
            log.info("%s predates checksums: %s; checksums stored", shard.url, found.detail)
        shard.verified = True
        return True

    # I18: every reloaded shard is read back and checked.
    async def verify_all(self) -> None:
        """Check every shard reloaded at start, one after another, off the event loop.

        Readiness does not wait for it: until a shard is checked its reads are checked
        member by member, or (without member checksums) it is checked first on demand.
        """
        hot = self.hot
        # Only a reloaded shard is unverified, and it is READY until it leaves the tier.
        pending = [s for s in hot.resident() if not s.verified]
        if not pending:
            return
        started, before = time.monotonic(), hot.corrupt_found
        total = sum(s.reserved_bytes for s in pending)
        log.info("checking %d reloaded shards (%d bytes) in the background", len(pending), total)
        for shard in pending:
            if self._stop.is_set():
                return
            if hot.holds(shard):
                await self.verify(shard)
        log.info(
            "checked %d reloaded shards in %.1fs: %d corrupt",
            len(pending),
            time.monotonic() - started,
            hot.corrupt_found - before,
        )

    def record_origin(self, shard: Shard, info: ObjectInfo) -> None:
        """Remember what the store says of a shard loaded from an old sidecar (so that a
        restart during an outage can serve it); the sidecar is rewritten in the background."""
        if shard.info is not None or info.url != shard.url or info.version != shard.version:
            return
        shard.info = info
        if shard.checksum is not None:  # else the check that computes it writes the sidecar
            task = asyncio.get_running_loop().create_task(self._rewrite_sidecar(shard))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)

    async def _rewrite_sidecar(self, shard: Shard) -> None:
        """Write a READY shard's sidecar again (atomically) and account its new size."""
        hot, generation = self.hot, shard.generation
        data = await asyncio.to_thread(_sidecar(shard).to_bytes)
        idx = hot.sidecar_path(shard)
        if not hot.holds(shard) or shard.generation != generation:
            return  # gone, or fetched again (its download writes its own sidecar)
        try:
            old = idx.stat().st_size
            await asyncio.to_thread(write_atomically, idx, data)
        except OSError as exc:
            log.warning("could not rewrite the index of %s: %s", shard.url, exc)
            return
        if hot.holds(shard):
            hot.resize(shard, len(data) - old)
        else:  # evicted while the file was written: do not leave it behind
            idx.unlink(missing_ok=True)

    def close(self) -> None:
        """Stop the background checks at their next read (shutdown)."""
        self._stop.set()
        for task in self._checks.values():
            task.cancel()


def _sidecar(shard: Shard) -> Sidecar:
    assert shard.index is not None
    return Sidecar(
        shard.url, shard.version, shard.index, shard.info, shard.checksum, shard.published
    )
