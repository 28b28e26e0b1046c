"""The local data plane: a reader on the daemon's node reads sample bytes straight from
the hot tier's shard files, and the ZeroMQ socket carries only the control messages
(plans, opens, leases, the index of each read). This room reads one local reply's members.

A ``read`` sent with ``local: true`` is answered, by a daemon that offers it, with the
shard file's path and identity and its layout, one packed frame (:class:`PackedRows`:
each member's extension, size, offset and checksum), and no payload frames; the
compiled reader (:data:`GATHER`, where it is built) lays it out as it is, the Python one
decodes it (:func:`unpacked`). Each member is read with ``pread`` into a new ``bytes`` or
``preadv`` into the caller's buffer (FastLoader's pinned ring): one copy, from the page
cache, and none through the daemon. :class:`LocalRead` falls back to the same read asked
through the socket where the file fails it. :func:`choose` is the loaders' setting.

The files themselves (opened once per shard, checked to be the daemon's, a few kept
open) are :mod:`.local_files`', re-exported here. A reader that cannot open them (tcp://
to another host, a container without the cache mount, a user outside the daemon's group)
is told so by :class:`LocalUnavailable`; the connection then reads through the socket as
before (docs/protocol.md, "Local reads").
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import struct
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import xxhash
from cached_wire.layouts import BYTES_MAX, MALFORMED, PackedRows, spans, unpacked
from cached_wire.protocol import Header

from .errors import ProtocolError, UsageError
from .local_files import MAX_GAP, MAX_OPEN_FILES, LocalFiles, LocalUnavailable

# The daemon's member checksums (cached/hot/verify.py), by the name its replies give;
# a reply naming another is read unchecked.
_DIGESTS = {"xxh3_64": xxhash.xxh3_64_intdigest}

__all__ = [
    "ENV",
    "GATHER",
    "MAX_GAP",
    "MAX_OPEN_FILES",
    "LocalFiles",
    "LocalFrame",
    "LocalPayload",
    "LocalRead",
    "LocalUnavailable",
    "choose",
    "copy_frame",
    "laid_out",
    "plan_places",
]

log = logging.getLogger(__name__)


def _compiled() -> ModuleType | None:
    """``cached_client._gather``, FastLoader's local reads in C (D32); None where the
    install could not build it (no C compiler): the same reads then run in Python."""
    try:
        return importlib.import_module(f"{__package__}._gather")
    except ImportError as exc:
        # DEBUG here: every importer of the client (the daemon's CLI too) would hear it.
        # FastLoader, which it is about, says it at INFO (fast.py).
        log.debug("the compiled local reader is not installed: %s", exc)
        return None


# The compiled reader, or None. A module attribute, so that a test or a benchmark can
# run the Python reads in its place.
GATHER = _compiled()
# One member of a compiled plan (_gather.c, struct place): ext index, flags, place in its
# buffer, size, offset in the file, checksum.
_PLACE = struct.Struct("=IIQQQQ")

# Environment variable that forces the choice for every loader of a process: "auto"
# (the default), "on" (local or fail), "off" (always through the socket).
ENV = "CACHED_LOCAL_READS"
_MODES: dict[str, bool | None] = {
    **dict.fromkeys(("auto", ""), None),
    **dict.fromkeys(("on", "1", "true", "yes"), True),
    **dict.fromkeys(("off", "0", "false", "no"), False),
}
# iovecs per preadv (the kernel's IOV_MAX; 1024 on Linux).
_IOV_MAX = int(os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024


def choose(local_reads: bool | None) -> bool | None:
    """The loader's setting: its argument, else ``$CACHED_LOCAL_READS``; None is "auto"
    (local where the files can be read, else the socket)."""
    if local_reads is not None:
        return bool(local_reads)
    value = os.environ.get(ENV, "auto").strip().lower()
    if value not in _MODES:
        raise UsageError(f"${ENV} must be auto, on or off, not {value!r}")
    return _MODES[value]


class LocalPayload:
    """The members of one local reply, by index, in the shard file. Each read looks the
    file up by path and identity: a member read after the shard's file was closed opens
    it again (or fails over to the socket), never a descriptor number reused since."""

    @classmethod
    def of_reply(
        cls, files: LocalFiles, header: Header, samples: Any, url: str = ""
    ) -> LocalPayload:
        """The members of a local read reply to a read of ``url``, in the shard file;
        ``samples()`` gives its layout in the Python reader's form (:func:`unpacked`),
        asked only by the Python reads. Raises
        :class:`~cached_client.errors.ProtocolError` for a reply without its file."""
        where = header.get("local")
        if not isinstance(where, dict) or not isinstance(where.get("path"), str):
            raise ProtocolError("a local reply without its file's path")
        algorithm = where.get("algorithm")
        digest = _DIGESTS.get(algorithm) if isinstance(algorithm, str) else None
        return cls(files, samples, url, where, digest)

    def __init__(
        self, files: LocalFiles, samples: Any, url: str, where: dict[str, Any], digest: Any
    ) -> None:
        self._files = files
        self._samples = samples
        self._where = where
        # The URL read (a read's reply does not name it): LocalFiles.release closes its files.
        self._url = url
        self._digest = digest

    @functools.cached_property
    def spans(self) -> list[tuple[int, int, int | None]]:
        """Each member's (offset, size, checksum or None), in order. Made when first
        needed: the compiled reader takes them from its plan instead."""
        return list(spans(self._samples(), self._digest is not None))

    @property
    def checked(self) -> bool:
        """Whether the members are checked: the daemon gives a checksum this reader knows."""
        return self._digest is not None

    def read_planned(self, plan: bytes, buffers: list[Any]) -> None:
        """Read the members of a compiled ``plan`` (:func:`laid_out`) into ``buffers``,
        one per extension index, with :data:`GATHER`: the same runs and checks as
        :meth:`read_many`, in one call. Raises :class:`LocalUnavailable`."""
        assert GATHER is not None
        fd = self._files.fd(self._where, self._url)
        try:
            failed = GATHER.read(fd, plan, buffers, 0, len(plan) // _PLACE.size)
        except OSError as exc:
            raise self._failed_read(exc) from None
        except ValueError as exc:  # a place outside its buffer: a plan not laid out here
            raise ProtocolError(f"{MALFORMED}: {exc}") from None
        if failed is not None:
            why, offset = failed
            if why == "short":
                raise self._short(offset)
            raise self._failed_check(offset)

    def _span(self, i: int) -> tuple[int, int, int | None]:
        if i >= len(self.spans):
            raise ProtocolError("the reply has fewer members than it announced")
        return self.spans[i]

    def _failed_check(self, offset: int) -> LocalUnavailable:
        return LocalUnavailable(
            f"{self._where['path']}: the member at byte {offset} fails its checksum",
            lasting=False,
        )

    def _check(self, data: Any, offset: int, checksum: int | None) -> None:
        if checksum is not None and self._digest(data) != checksum:
            raise self._failed_check(offset)

    def read_many(self, first: int, buffers: Sequence[Any]) -> list[int]:
        """Read members ``first, first + 1, ...`` into ``buffers`` (byte buffers, one each,
        at least its member's size), then check them; returns their sizes, fewer than
        ``buffers`` where the reply has no more members (a member larger than its buffer is
        not read: the caller sees the size).

        Members close together in the file (a sample's members, consecutive samples)
        are read by one ``preadv``: the members into their buffers, the tar headers and
        members not asked for between them into a scratch buffer. One system call and
        one Python round per run, not per member (docs/decisions.md, D26).

        Failures as the compiled reader's (``_gather.c`` ``read``; the specification is
        tests/test_reader_spec.py): the members in order, the first that fails is said by
        its offset: short where its bytes are not all in the file (a member of no bytes
        never is, one ending past :data:`BYTES_MAX` always is), else a failed checksum."""
        spans = self.spans[first : first + len(buffers)]
        fd = self._files.fd(self._where, self._url)
        gap_of = self._files.gap
        sizes: list[int] = []
        run: list[Any] = []  # the iovecs of one preadv
        members: list[tuple[Any, int, int, int | None]] = []  # what it reads, to check
        start = end = 0
        for (offset, size, checksum), buffer in zip(spans, buffers, strict=False):
            sizes.append(size)
            room = len(buffer)
            if size > room:
                continue
            target = buffer if room == size else buffer[:size]
            if size:
                if offset > BYTES_MAX - size:  # in no file: after the members before it
                    self._run(fd, run, start, members)
                    raise self._short(offset)
                gap = offset - end
                if run and not (0 <= gap <= MAX_GAP and len(run) < _IOV_MAX - 1):
                    self._run(fd, run, start, members)
                    run, members = [], []
                if not run:
                    start = offset
                elif gap:
                    run.append(gap_of(gap))
                run.append(target)
                end = offset + size
            members.append((target, offset, size, checksum))
        self._run(fd, run, start, members)
        return sizes

    def _run(
        self, fd: int, run: list[Any], start: int, members: list[tuple[Any, int, int, int | None]]
    ) -> None:
        """Read one run (its iovecs from ``start``), then its ``members`` in order: the
        first not all read (the file ended) or failing its checksum raises."""
        done = self._preadv(fd, run, start) if run else 0
        limit = start + done
        check = self._check
        for target, offset, size, checksum in members:
            if size and offset + size > limit:
                raise self._short(offset)
            check(target, offset, checksum)

    def _short(self, offset: int) -> LocalUnavailable:
        return LocalUnavailable(f"{self._where['path']}: short read at {offset}", lasting=False)

    def _failed_read(self, exc: OSError) -> LocalUnavailable:
        # EIO (a sector the disk cannot read) or any other failed read: as a failed
        # checksum, this read goes through the socket, where the daemon drops the shard
        # it cannot read and fetches it again.
        return LocalUnavailable(
            f"{self._where['path']}: reading it failed: {exc.strerror or exc}", lasting=False
        )

    def _preadv(self, fd: int, run: list[Any], start: int) -> int:
        try:
            return os.preadv(fd, run, start)
        except OSError as exc:
            raise self._failed_read(exc) from None

    def read(self, i: int) -> bytes:
        """Member ``i`` as new ``bytes``."""
        offset, size, checksum = self._span(i)
        fd = self._files.fd(self._where, self._url)
        if not size:
            data = b""  # never short, wherever it is
        elif offset > BYTES_MAX - size:
            raise self._short(offset)  # in no file (and past what pread takes)
        else:
            try:
                data = os.pread(fd, size, offset)
            except OSError as exc:
                raise self._failed_read(exc) from None
        if len(data) != size:
            raise self._short(offset)
        self._check(data, offset, checksum)
        return data


def laid_out(
    samples: PackedRows,
    used: dict[str, int],
    offsets: dict[str, list[int]],
    keys: list[str],
    exts: list[str],
    *,
    checked: bool,
) -> bytes:
    """The compiled layout of ``samples`` in a batch (FastLoader's ``Filling.receive``):
    ``used``, ``offsets`` and ``keys`` extended as the Python loop would; ``exts`` gets
    the names of the plan's extension indices, as many as there are. Only where
    :data:`GATHER` is built. A layout that breaks the specification (:func:`unpacked`,
    :func:`check_rows`) raises ProtocolError, ``used``, ``offsets`` and ``keys`` then
    being the batch's no more."""
    assert GATHER is not None
    try:
        plan: bytes = GATHER.layout_packed(
            samples.frame,
            samples.exts,
            samples.first,
            samples.count,
            used,
            offsets,
            keys,
            exts,
            checked,
        )
    except (TypeError, ValueError, OverflowError, IndexError) as exc:
        raise ProtocolError(f"{MALFORMED}: {exc}") from None
    return plan


def plan_places(plan: bytes) -> list[tuple[int, int, int]]:
    """Each member of a compiled plan as (extension index, place in its buffer, size)."""
    return [(ext, at, size) for ext, _f, at, size, _o, _c in _PLACE.iter_unpack(plan)]


def copy_frame(frame: Any, buffer: Any) -> int:
    """Copy a received frame into ``buffer``; returns the frame's size (a frame larger than
    the buffer is not copied: the caller sees the size)."""
    src, dst = memoryview(frame.buffer).cast("B"), memoryview(buffer).cast("B")
    n = len(src)
    if n <= len(dst):
        dst[:n] = src
    return n


class LocalFrame:
    """Member ``i`` of a local reply, shaped like the ``zmq.Frame`` that the socket path
    gives (``.bytes``, ``.buffer``); read from the file when asked for, so a reply of a
    whole shard is never in memory at once."""

    __slots__ = ("_i", "_read")

    def __init__(self, read: LocalRead, i: int) -> None:
        self._read = read
        self._i = i

    @property
    def bytes(self) -> bytes:
        return self._read.member(self._i)

    @property
    def buffer(self) -> memoryview:
        return memoryview(self.bytes)


class LocalRead:
    """One local reply's members: from the shard file, or, once that fails (a file gone,
    a checksum that fails), from the same read asked again through the socket
    (``refetch``, once).

    ``lost(exc)`` is told of a failure that will last (see :class:`LocalUnavailable`);
    it may raise, to refuse the socket (local reads required)."""

    def __init__(
        self,
        files: LocalFiles,
        header: Header,
        layout: Any,
        refetch: Any,
        lost: Any,
        *,
        url: str = "",
    ) -> None:
        self._files = files
        self._header = header
        self._url = url
        self._refetch = refetch
        self._lost = lost
        # The reply's layout, one packed frame (D34): the compiled reader takes it as it
        # is, the Python one decodes it once (samples()).
        where = header.get("packed")
        if layout is None or not isinstance(where, dict):
            raise ProtocolError("a local reply without its packed layout")
        exts, count = where.get("exts"), where.get("samples")
        if not (isinstance(exts, list) and all(isinstance(e, str) for e in exts)):
            raise ProtocolError("a packed reply without its extensions")
        if not isinstance(count, int) or count < 0:
            raise ProtocolError("a packed reply without its count of samples")
        frame = getattr(layout, "buffer", layout)  # a zmq.Frame's bytes, not a copy
        self.rows = PackedRows(frame, exts, 0, count)
        self._samples: list[list[Any]] | None = None
        self._payload: LocalPayload | None = None
        self._taken = 0  # members taken in order (read_into, frames)
        self._socket: list[Any] | None = None  # the reply's frames, once it fell back

    def samples(self) -> list[list[Any]]:
        """The reply's samples as ``[key, [[ext, size, offset, checksum], ...]]``
        (:func:`unpacked`), decoded once."""
        if self._samples is None:
            self._samples = unpacked(self.rows)
        return self._samples

    # I45: a failed local read heals through the socket.
    def _fall_back(self, exc: LocalUnavailable) -> list[Any]:
        if self._socket is None:
            log.info("%s; this read goes through the socket", exc)
            if exc.lasting:
                self._lost(exc)
            self._socket = list(self._refetch())
        return self._socket

    def _source(self) -> LocalPayload:
        if self._payload is None:
            self._payload = LocalPayload.of_reply(
                self._files, self._header, self.samples, self._url
            )
        return self._payload

    def member(self, i: int) -> bytes:
        """Member ``i``'s bytes."""
        if self._socket is None:
            try:
                return self._source().read(i)
            except LocalUnavailable as exc:
                self._fall_back(exc)
        assert self._socket is not None
        return bytes(self._socket[i].bytes)

    def read_many(self, buffers: Sequence[Any]) -> list[int]:
        """The next members, one into each of ``buffers``; their sizes (see
        :meth:`LocalPayload.read_many`). From the socket's frames once it fell back."""
        first = self._taken
        self._taken += len(buffers)
        if self._socket is None:
            try:
                return self._source().read_many(first, buffers)
            except LocalUnavailable as exc:
                self._fall_back(exc)
        assert self._socket is not None
        frames = self._socket[first : first + len(buffers)]
        return [copy_frame(frame, buffer) for frame, buffer in zip(frames, buffers, strict=False)]

    def plannable(self) -> bool:
        """Whether :meth:`read_planned` reads from the file with the compiled reader (not
        after the read fell back to the socket, nor where the reader is not built)."""
        return GATHER is not None and self._socket is None

    def checked(self) -> bool:
        """Whether a plan for this reply should carry the members' checksums."""
        try:
            return self._source().checked
        except ProtocolError:
            return False  # read_planned raises it

    def read_planned(self, plan: bytes, buffers: list[Any]) -> list[int] | None:
        """The next members, laid out by ``plan`` (:func:`laid_out`) in ``buffers`` (one
        per extension index): None once each is read as planned; from the socket's frames
        once the read fell back, their sizes."""
        count = len(plan) // _PLACE.size
        first = self._taken
        self._taken += count
        if self._socket is None:
            try:
                self._source().read_planned(plan, buffers)
                return None
            except LocalUnavailable as exc:
                self._fall_back(exc)
        assert self._socket is not None
        frames = self._socket[first : first + count]
        views = [buffers[ext][at : at + size] for ext, at, size in plan_places(plan)]
        return [copy_frame(frame, view) for frame, view in zip(frames, views, strict=False)]

    def frames(self) -> list[Any]:
        """Every member not yet taken, read when each is asked for its bytes."""
        if self._socket is not None:
            rest = self._socket[self._taken :]
            self._taken += len(rest)
            return rest
        first, self._taken = self._taken, len(self._source().spans)
        return [LocalFrame(self, i) for i in range(first, self._taken)]
