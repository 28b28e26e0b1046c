"""The local data plane: a reader on the daemon's node reads sample bytes straight from
the hot tier's shard files, and the ZeroMQ socket carries only the control messages
(plans, opens, leases, the index of each read).

A ``read`` sent with ``local: true`` is answered, by a daemon that offers it, with the
shard file's path and identity and each member's offset and checksum, and no payload
frames. :class:`LocalFiles` opens the file once per shard (the descriptor keeps the bytes
valid even if the daemon unlinks the file), checks that it is the daemon's file and not a
namesake (another host's hot tier, a container's own directory), and reads each member
with ``pread`` into a new ``bytes`` or ``preadv`` into the caller's buffer (FastLoader's
pinned ring): one copy, from the page cache, and none through the daemon.

A reader that cannot open the files (tcp:// to another host, a container without the
cache mount, a user outside the daemon's group) is told so by :class:`LocalUnavailable`;
the connection then reads through the socket as before (docs/protocol.md, "Local reads").
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from .errors import ProtocolError, UsageError
from .protocol import Header

# The daemon's member checksums (cached/tiers/verify.py), by the name its replies give;
# a reply naming another is read unchecked.
_DIGESTS = {"xxh3_64": xxhash.xxh3_64_intdigest}

log = logging.getLogger(__name__)

# Environment variable that forces the choice for every loader of a process: "auto"
# (the default), "on" (local or fail), "off" (always through the socket).
ENV = "CACHED_LOCAL_READS"
# Shard files kept open at once per connection: the shards being read, with room to spare.
MAX_OPEN_FILES = 32


class LocalUnavailable(Exception):
    """A local reply could not be read here. ``lasting``: the files are not reachable from
    this process at all (no such directory, permission, another file of that name), so
    the connection stops asking; otherwise only this read goes through the socket (a file
    gone, a checksum that failed: the daemon re-checks and fetches a good copy)."""

    def __init__(self, why: str, *, lasting: bool) -> None:
        super().__init__(why)
        self.lasting = lasting


def choose(local_reads: bool | None) -> bool | None:
    """The loader's setting: its argument, else ``$CACHED_LOCAL_READS``; None is "auto"
    (local where the files can be read, else the socket)."""
    if local_reads is not None:
        return bool(local_reads)
    value = os.environ.get(ENV, "auto").strip().lower()
    modes: dict[str, bool | None] = {"auto": None, "": None, "on": True, "off": False}
    modes.update({"1": True, "true": True, "yes": True, "0": False, "false": False})
    modes.update({"no": False})
    if value not in modes:
        raise UsageError(f"${ENV} must be auto, on or off, not {value!r}")
    return modes[value]


@dataclass(frozen=True)
class _Open:
    fd: int
    url: str
    identity: tuple[Any, Any, Any]


class LocalFiles:
    """The hot-tier files one connection reads, by path; a few kept open (LRU)."""

    def __init__(self) -> None:
        self._open: OrderedDict[str, _Open] = OrderedDict()

    def payload(self, header: Header) -> LocalPayload:
        """The payload of a local read reply. Raises :class:`LocalUnavailable`."""
        where = header.get("local")
        if not isinstance(where, dict) or not isinstance(where.get("path"), str):
            raise ProtocolError("a local reply without its file's path")
        fd = self._fd(where, str(header.get("url", "")))
        algorithm = where.get("algorithm")
        digest = _DIGESTS.get(algorithm) if isinstance(algorithm, str) else None
        spans: list[tuple[int, int, int | None]] = []
        for _key, members in header.get("samples", []):
            for member in members:
                _ext, size, offset, checksum = member
                spans.append((int(offset), int(size), checksum if digest else None))
        return LocalPayload(fd, where["path"], spans, digest)

    def _fd(self, where: dict[str, Any], url: str) -> int:
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
            # The reader's lease keeps the file there: not finding it (or not being let
            # in) means this process does not see the daemon's directory, and will not.
            raise LocalUnavailable(f"cannot open {path}: {exc.strerror}", lasting=True) from None
        st = os.fstat(fd)
        if (st.st_ino, st.st_size, st.st_mtime_ns) != identity:
            os.close(fd)
            # Not the daemon's file: the same path on another host or in another mount.
            raise LocalUnavailable(f"{path} here is not the daemon's file", lasting=True)
        self._open[path] = _Open(fd, url, identity)
        while len(self._open) > MAX_OPEN_FILES:
            _, old = self._open.popitem(last=False)
            os.close(old.fd)
        return fd

    def release(self, url: str) -> None:
        """Close the files of ``url``'s shard (before its lease goes: see the module)."""
        for path in [p for p, held in self._open.items() if held.url == url]:
            os.close(self._open.pop(path).fd)

    def close(self) -> None:
        """Close every file."""
        while self._open:
            os.close(self._open.popitem()[1].fd)


class LocalFrame:
    """A member's bytes read from the shard file, shaped like the ``zmq.Frame`` that the
    socket path gives (``.bytes``, ``.buffer``)."""

    __slots__ = ("bytes",)

    def __init__(self, data: bytes) -> None:
        self.bytes = data

    @property
    def buffer(self) -> memoryview:
        return memoryview(self.bytes)

    def __len__(self) -> int:
        return len(self.bytes)


class LocalPayload:
    """The members of one local reply, taken in order, each once."""

    def __init__(
        self,
        fd: int,
        path: str,
        spans: Sequence[tuple[int, int, int | None]],
        digest: Any,
    ) -> None:
        self._fd = fd
        self._path = path
        self._spans: Iterator[tuple[int, int, int | None]] = iter(spans)
        self._digest = digest

    def _next(self) -> tuple[int, int, int | None]:
        span = next(self._spans, None)
        if span is None:
            raise ProtocolError("the reply has fewer members than it announced")
        return span

    def _check(self, data: Any, offset: int, checksum: int | None) -> None:
        if checksum is not None and self._digest(data) != checksum:
            raise LocalUnavailable(
                f"{self._path}: the member at byte {offset} fails its checksum", lasting=False
            )

    def read_into(self, buffer: Any) -> int:
        """Read the next member into ``buffer`` (at least its size); returns its size."""
        offset, size, checksum = self._next()
        view = memoryview(buffer).cast("B")
        if size > len(view):
            return size  # as a frame too large is not copied: the caller sees the size
        target = view[:size]
        got = os.preadv(self._fd, [target], offset)
        if got != size:
            raise LocalUnavailable(f"{self._path}: short read at byte {offset}", lasting=False)
        self._check(target, offset, checksum)
        return size

    def frames(self) -> list[LocalFrame]:
        """Every member not yet taken, as new ``bytes`` each."""
        out = []
        for offset, size, checksum in self._spans:
            data = os.pread(self._fd, size, offset)
            if len(data) != size:
                raise LocalUnavailable(f"{self._path}: short read at byte {offset}", lasting=False)
            self._check(data, offset, checksum)
            out.append(LocalFrame(data))
        return out


class LocalRead:
    """One local reply's members, taken in order, each once: from the shard file, or,
    when that fails part-way (a file gone, a checksum that fails), from the same read
    asked again through the socket (``refetch``), past the members already taken.

    ``lost(exc)`` is told of a failure that will last (see :class:`LocalUnavailable`);
    it may raise, to refuse the socket (local reads required)."""

    def __init__(
        self,
        files: LocalFiles,
        header: Header,
        refetch: Any,
        lost: Any,
    ) -> None:
        self._files = files
        self._header = header
        self._refetch = refetch
        self._lost = lost
        self._payload: LocalPayload | None = None
        self._taken = 0
        self.rest: list[Any] | None = None  # the socket's frames, once it fell back

    def _fall_back(self, exc: LocalUnavailable) -> None:
        log.info("%s; this read goes through the socket", exc)
        if exc.lasting:
            self._lost(exc)
        self.rest = list(self._refetch())[self._taken :]

    def _source(self) -> LocalPayload:
        if self._payload is None:
            self._payload = self._files.payload(self._header)
        return self._payload

    def read_into(self, buffer: Any) -> int | None:
        """The next member into ``buffer``; None once it fell back (take :attr:`rest`)."""
        if self.rest is not None:
            return None
        try:
            n = self._source().read_into(buffer)
        except LocalUnavailable as exc:
            self._fall_back(exc)
            return None
        self._taken += 1
        return n

    def frames(self) -> list[Any]:
        """Every member not yet taken."""
        if self.rest is None:
            try:
                frames = self._source().frames()
            except LocalUnavailable as exc:
                self._fall_back(exc)
            else:
                self._taken += len(frames)
                return frames
        assert self.rest is not None
        rest, self.rest = self.rest, []
        return rest
