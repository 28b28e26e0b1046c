"""The hot-tier shard files one connection reads locally (:mod:`.local`), by path.

Each file is opened once per shard: the descriptor keeps the bytes valid even if the
daemon unlinks the file. It is checked to be the daemon's file and not a namesake
(another host's hot tier, a container's own directory) by its inode, size and mtime, a few
are kept open (LRU), and a shard's are closed before its lease is given back, so that no
descriptor outlives its lease. A file that cannot be opened or is not the daemon's raises
:class:`LocalUnavailable`: the read then goes through the socket.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

# Shard files kept open at once per connection: the shards being read, with room to spare.
# I68: a connection holds at most 32 shard files.
MAX_OPEN_FILES = 32
# Bytes between two members that one read still spans (tar headers and padding, members not
# asked for) rather than being split in two system calls: reading a gap is cheaper than a
# call, up to about this size.
MAX_GAP = 64 << 10


class LocalUnavailable(Exception):
    """A local reply could not be read here. ``lasting``: the files are not reachable from
    this process at all (no such directory, permission, another file of that name), so
    the connection stops asking; otherwise only this read goes through the socket (a file
    gone, a checksum that failed: the daemon re-checks and fetches a good copy)."""

    def __init__(self, why: str, *, lasting: bool) -> None:
        super().__init__(why)
        self.lasting = lasting


@dataclass(frozen=True)
class _Open:
    fd: int
    url: str
    identity: tuple[Any, Any, Any]


class LocalFiles:
    """The hot-tier files one connection reads, by path; a few kept open (LRU)."""

    def __init__(self) -> None:
        self._open: OrderedDict[str, _Open] = OrderedDict()
        # Whether a file of the daemon's opened here: then a file missing or replaced is
        # about that shard (evicted after a lease lapsed, fetched again), not about this
        # process, and only that read goes through the socket.
        self._worked = False
        # Where the bytes between members go (see LocalPayload.read_many): never looked at.
        self._scratch = memoryview(bytearray(MAX_GAP))
        self._gaps: dict[int, memoryview] = {}  # its slices by size (tar headers: a few)

    def gap(self, n: int) -> memoryview:
        """``n`` bytes of scratch space, ``n`` at most :data:`MAX_GAP`."""
        view = self._gaps.get(n)
        if view is None:
            view = self._gaps[n] = self._scratch[:n]
        return view

    def fd(self, where: dict[str, Any], url: str) -> int:
        """The open file the reply ``where`` names (opened, and checked, once). Raises
        :class:`LocalUnavailable`."""
        path = where["path"]
        identity = (where.get("ino"), where.get("size"), where.get("mtime_ns"))
        held = self._open.pop(path, None)
        if held is not None:
            if held.identity == identity:
                self._open[path] = held  # the most recently used, last
                return held.fd
            os.close(held.fd)  # a new copy of the shard (refetched) under the same name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            # Before any file opened here, not finding it (or not being let in) means this
            # process does not see the daemon's directory, and will not. After: the shard
            # went (its lease lapsed while the reader stalled, a forced eviction).
            raise LocalUnavailable(
                f"cannot open {path}: {exc.strerror}", lasting=not self._worked
            ) from None
        st = os.fstat(fd)
        if (st.st_ino, st.st_size, st.st_mtime_ns) != identity:
            os.close(fd)
            # Before any file opened here: not the daemon's file, the same path on another
            # host or in another mount. After: another copy of the shard replaced it.
            raise LocalUnavailable(
                f"{path} here is not the daemon's file", lasting=not self._worked
            )
        self._worked = True
        self._open[path] = _Open(fd, url, identity)
        while len(self._open) > MAX_OPEN_FILES:
            _, old = self._open.popitem(last=False)
            os.close(old.fd)
        return fd

    # I39: no descriptor of an evicted file is kept.
    def release(self, url: str) -> None:
        """Close the files of ``url``'s shard (before its lease goes: see the module)."""
        for path in [p for p, held in self._open.items() if held.url == url]:
            os.close(self._open.pop(path).fd)

    def close(self) -> None:
        """Close every file."""
        while self._open:
            os.close(self._open.popitem()[1].fd)
