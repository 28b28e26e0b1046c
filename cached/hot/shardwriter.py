"""The tier's side of writing one shard (:class:`ShardWriter`): what its bytes take of the
reservation as they land, and its publication (FETCHING to READY) or abort. The files
themselves are :mod:`.writer`'s (:class:`.writer.ShardFiles`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .index import ShardIndex
from .shard import SHARED_FILE_MODE, Shard, ShardState
from .writer import ShardFiles

if TYPE_CHECKING:
    from .room import Room


class ShardWriter:
    """Writes one shard: bytes go to a partial file and through the tar indexer as they arrive.

    The files are written by a :class:`.writer.ShardFiles`; this handle keeps the tier's
    side: what the bytes have taken of the reservation, and the shard's publication
    (FETCHING to READY) or abort.
    """

    def __init__(self, hot: Room, shard: Shard) -> None:
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
            self.hot._unwritten -= n  # I3

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
        shard.state = ShardState.READY  # I14: served only once indexed and in place
        hot.policy.on_insert(shard.shard_id, shard.url)  # I16
        hot._adopt(shard)
        hot._notify()
        return shard

    def abort(self) -> None:
        """Drop the partial file (and a sidecar written for it) and the reservation."""
        self._files.discard()  # I15: no partial file left behind
        self._settle()
        hot = self.hot
        if hot._shards.get(self.shard.shard_id) is self.shard:
            if self.shard.state is ShardState.FETCHING:  # publish wrote it, then failed
                hot._idx(self.shard.shard_id).unlink(missing_ok=True)
            del hot._shards[self.shard.shard_id]
            hot._used -= self.shard.reserved_bytes
            if self.shard.pins:  # readers of a copy dropped as corrupt still hold it
                hot._orphans[self.shard.shard_id] = self.shard  # I12
            hot._notify()
