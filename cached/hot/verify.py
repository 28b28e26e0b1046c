"""Checksums of hot-tier shards: computed while a shard streams in, checked member by
member before its bytes are served, and over the whole file after a restart.

XXH3 (64 bits) because the threat is the disk, not an adversary (a flipped bit, a torn
write, a sector read back wrong: any change goes unnoticed with probability 2^-64), and
because every served byte is hashed on the daemon's hot path. On the development VM it
hashed 100 KB buffers at 25 GB/s against 4.4-6.2 for zlib's CRC-32, 1.9 for sha256 and
0.8 for md5, and 1 KB ones with 0.06 us per call against 0.22 (docs/decisions.md, D21).
It releases the GIL, so the background check runs beside the event loop.

The algorithm's name is stored with the checksums; a sidecar written with another one
loads as unchecksummed and is re-hashed, like a sidecar that predates checksums.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

from .index import Member, ShardIndex

ALGORITHM = "xxh3_64"
digest = xxhash.xxh3_64_intdigest
# Reads of the background check: large enough to cost nothing per call, small enough
# that a shutdown waits for one read at most.
_READ_BYTES = 4 << 20
# A version that is a plain MD5 (a single-part upload's ETag): an old sidecar's shard can
# be checked against it, not merely re-hashed.
_PLAIN_MD5 = re.compile(r"^[0-9a-f]{32}$")


class StreamSums:
    """The checksum of a whole shard and of each member's data, from its bytes in order.

    ``update`` takes each chunk right after the tar indexer has seen it, with the members
    the indexer has found so far: a member's header precedes its data, so every member
    whose data the chunk holds is among them.
    """

    def __init__(self) -> None:
        self.size = 0
        self.member_sums: list[int] = []
        self._whole = xxhash.xxh3_64()
        self._running: xxhash.xxh3_64 | None = None  # a member that spans chunks

    @property
    def whole(self) -> int:
        """The checksum of every byte so far."""
        return self._whole.intdigest()

    def update(self, chunk: bytes | memoryview, members: Sequence[Member]) -> None:
        """Account ``chunk``, the next bytes of the shard."""
        view = memoryview(chunk).cast("B")
        base, end = self.size, self.size + len(view)
        self._whole.update(view)
        self.size = end
        i = len(self.member_sums)
        while i < len(members):
            member = members[i]
            stop = member.offset + member.size
            lo, hi = max(member.offset, base), min(stop, end)
            if self._running is None and stop <= end:  # all of it in this chunk: one call
                self.member_sums.append(digest(view[lo - base : hi - base]))
            else:
                if self._running is None:
                    self._running = xxhash.xxh3_64()
                if hi > lo:
                    self._running.update(view[lo - base : hi - base])
                if stop > end:  # it goes on in the next chunk (or starts there)
                    break
                self.member_sums.append(self._running.intdigest())
                self._running = None
            i += 1


def first_bad(view: memoryview, members: Iterable[Member]) -> Member | None:
    """The first of ``members`` whose bytes in ``view`` do not match its checksum, or
    None. Members without a checksum are not checked."""
    hash_of = digest  # a local: this loop runs for every member served
    for m in members:
        want = m.checksum
        if want is not None and hash_of(view[m.offset : m.offset + m.size]) != want:
            return m
    return None


@dataclass(frozen=True)
class FileCheck:
    """What reading a shard's file back found.

    ``ok`` is None when the check was stopped (shutdown) or the file is gone. For a shard
    without a stored checksum (an old sidecar) ``whole`` and ``member_sums`` are what the
    file holds now, to be stored; ``ok`` then says whether its MD5 matched a plain-MD5
    version, or is True when there was nothing to compare against (trust on first use).
    """

    ok: bool | None
    whole: int = 0
    member_sums: tuple[int, ...] = ()
    detail: str = ""


def check_file(
    path: Path,
    index: ShardIndex,
    whole: int | None,
    version: str,
    stop: threading.Event,
) -> FileCheck:
    """Read ``path`` back and compare it with its stored checksum ``whole`` (blocking: run
    it in a thread). Without one, compute the checksums to store and, where ``version``
    is a plain MD5, check the file's MD5 against it."""
    sums = StreamSums()
    members = [m for s in index.samples for m in s.members]
    md5 = None
    if whole is None and _PLAIN_MD5.match(version):
        md5 = hashlib.md5(usedforsecurity=False)
    buf = bytearray(_READ_BYTES)
    view = memoryview(buf)
    try:
        with open(path, "rb", buffering=0) as fh:
            while n := fh.readinto(view):
                if stop.is_set():
                    return FileCheck(None)
                sums.update(view[:n], members)
                if md5 is not None:
                    md5.update(view[:n])
    except FileNotFoundError:
        return FileCheck(None, detail="the file is gone")
    except OSError as exc:  # EIO: a sector that cannot be read is as bad as one that rotted
        return FileCheck(False, detail=f"reading it failed: {exc.strerror or exc}")
    if sums.size != index.size_bytes:
        return FileCheck(False, detail=f"{sums.size} bytes, the index says {index.size_bytes}")
    if whole is not None:
        if sums.whole == whole:
            return FileCheck(True)
        return FileCheck(False, detail=f"{ALGORITHM} {sums.whole:016x}, stored {whole:016x}")
    found = tuple(sums.member_sums)
    if md5 is not None and md5.hexdigest() != version:
        return FileCheck(False, sums.whole, found, f"MD5 {md5.hexdigest()}, the ETag {version}")
    how = "its MD5 matches the ETag" if md5 is not None else "nothing to compare it with"
    return FileCheck(True, sums.whole, found, how)
