"""Writing one shard's files in the hot tier: its bytes go into ``<id>.tar.partial`` as they
arrive, through the tar indexer and the checksums in the same pass (or the source writes
that file itself, and one pass over it afterwards indexes and sums it: :meth:`ShardFiles.scan`);
publication writes the sidecar ``<id>.idx`` atomically, then renames the data file to
``<id>.tar``.

Files only. What the bytes take of the tier's bound, and the shard's state, belong to the
hot tier (:mod:`.hot`), which names the files and drives a writer from worker threads.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from ..errors import CacheError, NotATarError
from ..stores.base import ObjectInfo
from .index import ShardIndex, TarIndexer
from .scan import index_file
from .sidecar import Sidecar
from .verify import ALGORITHM, StreamSums


class ShardFiles:
    """The files of one shard being written: the data streams into ``<tar>.partial``, and
    :meth:`publish` puts ``idx`` and ``tar`` in place.

    Every method but :meth:`finish` blocks on the disk: run it in a worker thread. One
    call at a time.
    """

    def __init__(self, tar: Path, idx: Path, url: str) -> None:
        self.url = url
        self.tar = tar
        self.idx = idx
        self.partial = tar.with_name(tar.name + ".partial")
        # Opened by the first write (in a worker thread, not on the event loop). A source
        # that writes the partial file itself (the native path) never opens it here.
        self._file: BinaryIO | None = None
        self._indexer = TarIndexer(url)
        self._sums = StreamSums()
        self._not_a_tar: NotATarError | None = None
        # The index with the members' checksums, and the whole file's: set by finish()
        # (or by scan(), for a file the source wrote).
        self._done: tuple[ShardIndex, int] | None = None
        self._scanned = False

    def write(self, run: Sequence[bytes]) -> None:
        """Append a run of chunks, indexing and hashing them in the same pass. Bytes that
        are not a tar archive are dropped, and :meth:`finish` raises NotATarError."""
        if self._not_a_tar is not None:
            return
        for chunk in run:
            try:
                self._indexer.feed(chunk)
            except NotATarError as exc:
                # Held until the download ends: a header damaged in transit looks exactly
                # like a corrupt archive, and only the body's checksum (checked at the end,
                # when the source may fetch it again) tells the two apart. finish()
                # raises it.
                self._not_a_tar = exc
                return
            if self._file is None:
                self._file = open(self.partial, "wb")  # noqa: SIM115 - closed by publish/discard
            self._file.write(chunk)
            # The checksums come from the very bytes written, in the same pass.
            self._sums.update(chunk, self._indexer.found)

    def rewind(self) -> None:
        """Start again from byte 0: the source sends the whole object again."""
        if self._file is not None:
            self._file.seek(0)
            self._file.truncate()
        self._indexer = TarIndexer(self.url)
        self._sums = StreamSums()
        self._not_a_tar = None

    def scan(self) -> None:
        """The source wrote the whole partial file itself (the native fetch path): index
        it and checksum it, in one pass over the file while its pages are still cached.
        Raises as :meth:`finish` does."""
        self._done = index_file(self.partial, self.url)
        self._scanned = True

    def finish(self) -> int:
        """The bytes have all come: finish the tar index. Returns the checksum of the whole
        file. Raises NotATarError for bytes that were not a tar archive, and CacheError
        for an archive cut short."""
        if self._done is not None:  # scanned
            return self._done[1]
        if self._not_a_tar is not None:
            raise self._not_a_tar
        index = self._indexer.finish()
        sums = self._sums
        if len(sums.member_sums) != len(self._indexer.found) or sums.size != index.size_bytes:
            raise CacheError(f"{self.url}: checksums do not cover the shard (a bug)")
        self._done = index.with_checksums(sums.member_sums, ALGORITHM), sums.whole
        return sums.whole

    def publish(
        self, version: str, info: ObjectInfo | None, published: float, mode: int | None
    ) -> tuple[ShardIndex, int, int]:
        """:meth:`finish`, then write the sidecar ``idx`` atomically, then give the data
        file ``mode`` (None: leave it) and rename it to ``tar``, atomically. Returns the
        index with the members' checksums, the whole file's checksum and the sidecar's
        size in bytes. Raises as :meth:`finish` does.

        Nothing is synced: a crash can leave a published shard torn, and the restart
        finds it so (a sidecar that does not parse, a data file of the wrong size, or,
        before the shard is first served, its checksum: :mod:`.checks`), drops it and
        fetches it again. An fsync per shard cost 40 % of the fill rate (D43)."""
        whole = self.finish()
        assert self._done is not None
        index = self._done[0]
        car = Sidecar(self.url, version, index, info, whole, published)
        meta = car.to_bytes()
        if self._file is not None:
            self._file.close()  # a write the disk refused (ENOSPC) raises here at the latest
        elif not self._scanned:
            self.partial.touch()  # an empty object: no write came
        write_atomically(self.idx, meta)
        if mode is not None:
            os.chmod(self.partial, mode)
        os.replace(self.partial, self.tar)
        return index, whole, len(meta)

    def discard(self) -> None:
        """Close and remove the partial file (a sidecar already written is the caller's)."""
        if self._file is not None:
            with contextlib.suppress(OSError):  # a full disk can fail the flush of a close
                self._file.close()
        self.partial.unlink(missing_ok=True)


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``path`` through a partial file and a rename: readers see old or new."""
    partial = path.with_name(path.name + ".partial")
    try:
        partial.write_bytes(data)
        os.replace(partial, path)
    except OSError:
        partial.unlink(missing_ok=True)  # a full disk: leave nothing half written
        raise
