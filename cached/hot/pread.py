"""Reading a hot-tier shard's members for the socket: ``preadv`` into the very messages
that are sent, never through a mapping.

A mapped page that cannot be read (a bad sector, a file truncated under the map) is
SIGBUS, and the daemon dies of it; a read returns EIO or a short count instead, which the
hot tier answers by dropping the shard and fetching it again.

Each member is read into a libzmq message (``zmq.Frame``, writable through the buffer
protocol) that the socket then sends as it is: one copy, from the page cache into the
message, and no zero-copy hand-off through pyzmq's garbage-collector thread, whatever
the member's size. Members close together in the file are one ``preadv`` (the bytes
between them into a scratch buffer), as the client's local reader does.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq

from .index import Member
from .verify import digest

# Bytes between two members that one preadv still spans rather than being split in two
# calls (tar headers and padding, members not asked for); as the client's MAX_GAP.
MAX_GAP = 64 << 10
# A run stops growing past this many bytes: a read of gigabytes is not one call.
RUN_BYTES = 64 << 20
_IOV_MAX = int(os.sysconf("SC_IOV_MAX"))
# Where the bytes between members go; never looked at, so reads in worker threads may
# share it.
_SCRATCH = memoryview(bytearray(MAX_GAP))
# What a new message is filled from before the read overwrites it: pyzmq makes no message
# of a size without copying something into it.
_ZEROS = memoryview(bytes(1 << 20))
# Replies of at least this many payload bytes are tracked until ZeroMQ has written them.
TRACK_BYTES = 256 << 10


class ShortRead(OSError):
    """The file ended before a member did: it is shorter than its index says."""

    def __init__(self, offset: int) -> None:
        super().__init__(errno.EIO, f"the file ends before byte {offset}")


class ShardFile:
    """A published shard's file, open for reads. Reads hold a reference while they use
    the descriptor; it closes when the last reference goes (the shard left the tier and
    no read is under way), in whichever thread that is: a read in a worker thread never
    sees its descriptor closed, or reused, under it."""

    __slots__ = ("fd",)

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        # Readers go front to back; tell the kernel so it reads ahead.
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def __del__(self) -> None:
        os.close(self.fd)


def _message(size: int) -> zmq.Frame:
    fill = _ZEROS[:size] if size <= len(_ZEROS) else bytes(size)
    return zmq.Frame(fill, copy=True)


def read_members(
    file: ShardFile, members: Sequence[Member], check: bool
) -> tuple[list[zmq.Frame], Member | None]:
    """The bytes of ``members``, one message each, and the first member whose bytes fail
    its checksum (with ``check``; members without one are not checked), or None.

    Raises OSError for a read that fails (EIO), :class:`ShortRead` for a file that ends
    too soon. Blocking: large reads run it in a worker thread."""
    frames: list[Any] = [_message(m.size) for m in members]
    # A large reply's last member is read into a buffer of its own, sent zero-copy with a
    # tracker that says when ZeroMQ has written it out (cached/sent.py counts the bytes
    # until then); one hand-off to pyzmq's collector thread per reply, not per frame.
    tracked = _tracked(members)
    if tracked is not None:
        frames[tracked] = bytearray(members[tracked].size)
    fd = file.fd
    run: list[Any] = []  # writable buffers: messages and scratch
    start = end = 0
    for member, frame in zip(members, frames, strict=True):
        gap = member.offset - end
        if run and not (
            0 <= gap <= MAX_GAP and len(run) < _IOV_MAX - 1 and end - start < RUN_BYTES
        ):
            _preadv(fd, run, start, end)
            run = []
        if not run:
            start = member.offset
        elif gap:
            run.append(_SCRATCH[:gap])
        if member.size:
            run.append(frame)
        end = member.offset + member.size
    if run:
        _preadv(fd, run, start, end)
    if tracked is not None:
        frames[tracked] = zmq.Frame(frames[tracked], copy=False, track=True)
    if check:
        hash_of: Any = digest  # takes any buffer; pyzmq's stubs do not say Frame is one
        for member, frame in zip(members, frames, strict=True):
            if member.checksum is not None and hash_of(frame) != member.checksum:
                return frames, member
    return frames, None


def _tracked(members: Sequence[Member]) -> int | None:
    """The member whose frame is tracked: the last with bytes, in a reply of at least
    TRACK_BYTES; None for a smaller reply."""
    if sum(m.size for m in members) < TRACK_BYTES:
        return None
    return next((i for i in range(len(members) - 1, -1, -1) if members[i].size), None)


def _preadv(fd: int, run: list[Any], start: int, end: int) -> None:
    done = os.preadv(fd, run, start)
    if done == end - start:
        return
    # A count short of the run: the end of the file, or (rarely) a read the kernel cut
    # (2 GiB at most per call); go on from where it stopped until a read returns nothing.
    views = [memoryview(b).cast("B") for b in run]
    while done < end - start:
        skip, rest = done, []
        for view in views:
            if skip >= len(view):
                skip -= len(view)
                continue
            rest.append(view[skip:])
            skip = 0
        got = os.preadv(fd, rest, start + done)
        if got == 0:
            raise ShortRead(start + done)
        done += got
