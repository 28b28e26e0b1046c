"""A local reply's layout, one packed frame (docs/protocol.md, "Local reads"; D34): made by
the daemon (:func:`pack`, from its index: ``cached/layouts.py``), its tables checked and
decoded for the client's Python reader (:func:`unpacked`; the compiled one is
``_gather.c``), and the specification's checks that both readers apply
(tests/test_reader_spec.py). Bytes only: no file is read here.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from .errors import ProtocolError
from .protocol import PACKED_MEMBER

# The most bytes a member may end at in a file (off_t), and the most one extension's
# members may add up to in a batch (ssize_t): a member that ends further is in no file
# (a short read), a layout that adds up further is malformed (_gather.c, BYTES_MAX).
BYTES_MAX = (1 << 63) - 1


# How a layout that breaks the specification (tests/test_reader_spec.py) is refused, by
# either reader: ProtocolError(f"{MALFORMED}: ...").
MALFORMED = "a malformed local layout"


class PackedMember(Protocol):
    """What :func:`pack` reads of a member (the daemon's ``hot.index.Member``)."""

    @property
    def ext(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def checksum(self) -> int | None: ...


def pack(samples: Iterable[tuple[str, Sequence[PackedMember]]]) -> tuple[bytes, list[str], int]:
    """The packed layout of ``samples`` (each its key and the members to read), the names
    of the extensions its members refer to by index, and the members' payload bytes."""
    exts: dict[str, int] = {}
    first, key_start = [0], [0]
    records: list[bytes] = []
    keys = bytearray()
    nbytes = 0
    for key, members in samples:
        for m in members:
            e = exts.setdefault(m.ext, len(exts))
            has = m.checksum is not None
            records.append(PACKED_MEMBER.pack(e, int(has), m.size, m.offset, m.checksum or 0))
            nbytes += m.size
        first.append(first[-1] + len(members))
        keys += key.encode()
        key_start.append(len(keys))
    count = len(first) - 1
    tables = struct.pack(f"<II{count + 1}I{count + 1}I", count, first[-1], *first, *key_start)
    return b"".join((tables, *records, bytes(keys))), list(exts), nbytes


def spans(rows: list[Any], checked: bool) -> Any:
    """Each member of ``rows`` (:func:`unpacked`) as (offset, size, checksum or None), in
    order (the checksum only where ``checked``); raises ProtocolError for a size past
    :data:`BYTES_MAX`, as the compiled reader does."""
    for _key, members in rows:
        for _ext, size, offset, checksum in members:
            if size > BYTES_MAX:
                raise ProtocolError(f"{MALFORMED}: a member's size of {size}")
            yield offset, size, checksum if checked else None


def check_rows(rows: Sequence[Any], used: dict[str, int]) -> None:
    """The Python reader's check of ``rows`` (:func:`unpacked`) before it lays them out
    after ``used`` (FastLoader's ``Filling.receive``): what the compiled reader's layout
    refuses, refused alike and said alike (ProtocolError): an extension's members adding
    up past :data:`BYTES_MAX` in the batch, one member's size past it included."""
    total = dict(used)
    for _key, members in rows:
        for m in members:
            end = total.get(m[0], 0) + m[1]
            if end > BYTES_MAX:
                raise ProtocolError(
                    f"{MALFORMED}: an extension's members add up past 2^63 - 1 bytes"
                )
            total[m[0]] = end


class PackedRows:
    """Samples ``first .. first + count`` of a packed layout (docs/protocol.md, "Local
    reads"), the layout of every local reply; sliced as a list is."""

    __slots__ = ("count", "exts", "first", "frame")

    def __init__(self, frame: Any, exts: list[str], first: int, count: int) -> None:
        self.frame, self.exts, self.first, self.count = frame, exts, first, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, part: slice) -> PackedRows:
        start, stop, _ = part.indices(self.count)
        return PackedRows(self.frame, self.exts, self.first + start, max(0, stop - start))

    def key_of(self, member: int) -> str:
        """The key of the sample whose member ``member`` (counted from this part's first
        member) is; for an error's message."""
        buf = memoryview(self.frame).cast("B")
        samples, first, starts, _, keys_at = _packed_tables(buf)
        target = first[self.first] + member
        s = next((s for s in range(self.first, samples) if first[s + 1] > target), samples - 1)
        return bytes(buf[keys_at + starts[s] : keys_at + starts[s + 1]]).decode()


def _malformed(why: str) -> ProtocolError:
    return ProtocolError(f"{MALFORMED}: {why}")


def _packed_tables(buf: memoryview) -> tuple[int, tuple[int, ...], tuple[int, ...], int, int]:
    """A packed layout frame's tables (docs/protocol.md, "Local reads"): the sample
    count, ``first_member``, ``key_start``, and where the members and the keys begin.
    Raises ProtocolError where they do not hold together, as the compiled reader's
    ``parse_packed`` does: tables or records past the frame's end, first members not
    ascending to the member count, key starts not ascending or past the end."""
    if len(buf) < 8:
        raise _malformed("a packed layout shorter than its counts")
    samples, members = struct.unpack_from("<II", buf)
    members_at = 8 + 8 * (samples + 1)
    keys_at = members_at + PACKED_MEMBER.size * members
    if len(buf) < keys_at:
        raise _malformed("a packed layout shorter than its tables and members")
    first = struct.unpack_from(f"<{samples + 1}I", buf, 8)
    starts = struct.unpack_from(f"<{samples + 1}I", buf, 8 + 4 * (samples + 1))
    if first[samples] != members or starts[samples] > len(buf) - keys_at:
        raise _malformed("a packed layout whose tables do not add up")
    for s in range(samples):
        if first[s] > first[s + 1] or starts[s] > starts[s + 1]:
            raise _malformed("a packed layout whose tables do not ascend")
    return samples, first, starts, members_at, keys_at


def unpacked(rows: PackedRows) -> list[list[Any]]:
    """The samples of ``rows`` as ``[key, [[ext, size, offset, checksum or None], ...]]``:
    the Python reader's form of a packed layout. Raises ProtocolError (:data:`MALFORMED`)
    where the compiled reader's ``layout_packed`` refuses it: a frame that does not hold
    together (:func:`_packed_tables`), samples outside it, a member of an extension index
    not named, a key that is not UTF-8."""
    buf = memoryview(rows.frame).cast("B")
    samples, first, starts, members_at, keys_at = _packed_tables(buf)
    a, b = rows.first, rows.first + rows.count
    if a < 0 or rows.count < 0 or b > samples:
        raise _malformed("samples outside the packed layout")
    exts, base = rows.exts, first[a]
    records = PACKED_MEMBER.iter_unpack(
        buf[members_at + PACKED_MEMBER.size * base : members_at + PACKED_MEMBER.size * first[b]]
    )
    try:
        members = [[exts[e], size, at, sum_ if f & 1 else None] for e, f, size, at, sum_ in records]
    except IndexError:
        raise _malformed("a packed member of an extension not named") from None
    blob = bytes(buf[keys_at + starts[a] : keys_at + starts[b]])
    try:
        text = blob.decode()
        k0 = starts[a]
        if len(text) == len(blob):  # ASCII keys (the common case): sliced as the bytes are
            keys = [text[starts[s] - k0 : starts[s + 1] - k0] for s in range(a, b)]
        else:
            keys = [blob[starts[s] - k0 : starts[s + 1] - k0].decode() for s in range(a, b)]
    except UnicodeDecodeError as exc:
        raise _malformed(str(exc)) from None
    return [
        [key, members[first[s] - base : first[s + 1] - base]]
        for key, s in zip(keys, range(a, b), strict=True)
    ]


def described(rows: Sequence[Any]) -> list[tuple[str, list[tuple[str, int]]]]:
    """The samples ``rows`` describe (``[key, [[ext, size, ...], ...]]``: a socket reply's,
    or a local one's :func:`unpacked`), as ``(key, [(ext, size), ...])`` each."""
    return [(key, [(m[0], m[1]) for m in members]) for key, members in rows]


def _sizes(reply: Any) -> list[tuple[str, list[tuple[str, int]]]] | None:
    """A socket reply's ``samples`` :func:`described`; None where they are not
    ``[key, [[ext, size, ...], ...]]``."""
    rows = reply.get("samples") if isinstance(reply, dict) else None
    try:
        return described(rows or [])
    except (TypeError, ValueError, IndexError):
        return None


# I43: a read asked again must describe the same samples.
def check_refetch(url: str, local: list[Any], socket: Any) -> None:
    """A read asked again through the socket must describe the samples its local reply
    did (``local``: ``(key, [(ext, size), ...])`` each): the same keys, members and
    sizes, or the bytes read so far and those to come would be of two copies. Raises
    ProtocolError naming the shard (it changed in the store in between: read it again)."""
    if _sizes(socket) != local:
        raise ProtocolError(
            f"{url}: the read through the socket does not describe the samples of the local "
            "reply it replaces (the shard changed in the store in between); read it again"
        )
