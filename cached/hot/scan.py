"""Index and checksum a shard file that is already on the disk, in one pass.

The native fetch path has a source write a whole shard into its partial file with no
Python per byte, so nothing indexed or hashed the bytes on their way. :func:`index_file`
does it afterwards, while the file's pages are still in the page cache: the same index
(samples, offsets, sizes, the members' XXH3-64) and whole-file checksum that
:class:`~cached.hot.writer.ShardFiles` builds from a stream, and the same
NotATarError for bytes that are not a whole tar archive.

The walk and the hashing are C (``cached_wire._tarscan``, one call without the GIL);
naming and grouping the members into samples is :class:`~.index.Grouper`, the
streaming indexer's own code. Where the C code meets a header it does not model exactly
(odd number fields or pax records), or where it is not built, the streaming indexer
itself runs over the file: the result is always that of :class:`~.index.TarIndexer`
and :class:`~.verify.StreamSums`.
"""

from __future__ import annotations

import importlib
import itertools
import mmap
import os
from array import array
from collections import Counter
from pathlib import Path
from typing import Any

from .index import Grouper, ShardIndex, TarIndexer, corrupt_error, cut_short_error
from .verify import ALGORITHM, StreamSums


def _load() -> Any:
    try:
        return importlib.import_module("cached_wire._tarscan")
    except ImportError:  # built without a C compiler: the same work in Python
        return None


_tarscan = _load()

COMPILED = _tarscan is not None
# How each call of index_file went: "compiled", "fallback" (the C code handed over to
# TarIndexer) or "python" (no compiled module). For tests and diagnostics.
paths: Counter[str] = Counter()


def index_file(path: Path, url: str) -> tuple[ShardIndex, int]:
    """The tar index of the file at ``path``, with its members' checksums, and the
    checksum of the whole file (XXH3-64, :data:`~.verify.ALGORITHM`).

    Blocking (it reads the file): run it in a worker thread. NotATarError, with
    ``url`` in its message, where the bytes are not a tar archive or it is cut short;
    OSError where the file cannot be read.
    """
    with open(path, "rb", buffering=0) as fh:
        size = os.fstat(fh.fileno()).st_size
        if _tarscan is not None:
            found = _tarscan.scan(fh.fileno(), size)
            if found[0] != _tarscan.FALLBACK:
                paths["compiled"] += 1
                return _compiled(found, url)
            paths["fallback"] += 1
        else:
            paths["python"] += 1
        return _python(fh.fileno(), size, url)


def _compiled(found: tuple[Any, ...], url: str) -> tuple[ShardIndex, int]:
    """The index and whole checksum from what the C scan found, or its error."""
    kind, reason, headers, at, names, table, whole = found
    if kind == _tarscan.CORRUPT:
        raise corrupt_error(url, headers, reason, at)
    if kind == _tarscan.INCOMPLETE:
        raise cut_short_error(url, headers, reason, at)
    # One record of four native u64 per regular member: where its name ends in
    # ``names``, its data's offset, size and checksum.
    cols = array("Q", table)
    ends = cols[0::4]
    starts = itertools.chain((0,), ends)
    # Names are mostly ASCII: one decode, then slices at the same offsets.
    text: str | bytes = names.decode("ascii") if names.isascii() else names
    decoded = [
        t if isinstance(t, str) else t.decode("utf-8", "surrogateescape")
        for t in (text[a:b] for a, b in zip(starts, ends, strict=False))  # starts: one more
    ]
    grouper = Grouper()
    grouper.add_all(zip(decoded, cols[1::4], cols[2::4], cols[3::4], strict=True))
    return ShardIndex(grouper.finish(), at, ALGORITHM), whole


def _python(fd: int, size: int, url: str) -> tuple[ShardIndex, int]:
    """The specification: the streaming indexer and checksums, fed the whole file."""
    indexer, sums = TarIndexer(url), StreamSums()
    if size:
        # Not closed explicitly: an error's traceback may still hold a view of it; the
        # mapping goes with the last reference.
        view = memoryview(mmap.mmap(fd, size, access=mmap.ACCESS_READ))
        indexer.feed(view)
        sums.update(view, indexer.found)
    index = indexer.finish()
    return index.with_checksums(sums.member_sums, ALGORITHM), sums.whole
