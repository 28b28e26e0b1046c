"""Streaming tar indexer: builds a shard's sample index while its bytes arrive.

The fetcher feeds every downloaded chunk (any size, boundaries anywhere) to a
`TarIndexer`, so the index exists the moment the download ends, with no second pass.
Member data is never buffered: the indexer skips it by arithmetic and keeps at most
one partial 512-byte header and one GNU long-name / pax payload (capped) in memory.

Header parsing mirrors Python's `tarfile` (which `webdataset` reads shards with) and
naming/grouping mirrors `webdataset.tariterators` 1.0.2, so a sample served from the
cache has the same key, extensions and bytes as `webdataset.WebDataset` would yield.
Where tarfile quietly stops (bad checksum or truncation after the first header) we
raise instead: a damaged shard must not enter the cache looking whole.
"""

from __future__ import annotations

import itertools
import json
import re
import struct
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

from cached.errors import CacheError, NotATarError

_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
_MAX_META = 1 << 20  # cap on a GNU long name / pax payload; real ones are < 4 KiB
_FORMAT = "cached-tar-index"
_VERSION = 1

# webdataset.tariterators: base_plus_ext, the meta-file rule and tar_file_iterator's
# default skip_meta. Same patterns with re.match, so even quirks (`$` before a final
# newline) agree.
_BASE_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_SKIP_META = re.compile(r"__[^/]*__($|/)")
_PAX_RECORD = re.compile(rb"(\d+) ([^=]+)=")
_SIGNED = struct.Struct("148b8x356b")

_REGULAR = frozenset((b"0", b"\0", b"7"))  # tarfile.REGULAR_TYPES minus sparse "S"
# tarfile skips data only for regular files and types it does not know; dirs, links
# and devices are assumed to have none, whatever their size field says.
_SUPPORTED = frozenset((b"0", b"\0", b"1", b"2", b"3", b"4", b"5", b"6", b"7", b"L", b"K", b"S"))
# GNU long name/link, pax per-file ("X": Solaris' "x") and global headers
_EXTENDED = frozenset((b"L", b"K", b"x", b"X", b"g"))


# Member and Sample are named tuples, not frozen dataclasses: a shard of small samples has
# thousands of members, and building one took 1.8 us as a frozen dataclass against about
# 0.3 us as a tuple (the index of a downloaded shard is built member by member).
class Member(NamedTuple):
    """One file of a sample: its extension (lower-cased), where its data lies, and the
    checksum of that data once the download has seen it (None: not known)."""

    ext: str
    offset: int  # byte offset of the member's data in the tar file
    size: int  # data size in bytes
    checksum: int | None = None  # of the data (ShardIndex.algorithm); checked when served


_new_member = Member._make  # from one tuple: a third of the keyword constructor's time


class Sample(NamedTuple):
    """Consecutive members sharing a key, in archive order (webdataset's grouping)."""

    key: str
    members: tuple[Member, ...]


@dataclass(frozen=True)
class ShardIndex:
    """The sample index of one tar shard, stored beside it as a sidecar file."""

    samples: tuple[Sample, ...]
    size_bytes: int  # total tar size seen
    algorithm: str | None = None  # of the members' checksums ("xxh3_64"); None: none
    # Renderings of this index that its server makes once and sends often (the layout of
    # a whole-shard local read: cached/server.py), by what was asked. Not part of it.
    memo: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def checksummed(self) -> bool:
        """Whether every member carries a checksum (indexes written before checksums, and
        fresh ones before :meth:`with_checksums`, do not)."""
        return self.algorithm is not None and all(
            m.checksum is not None for s in self.samples for m in s.members
        )

    def with_checksums(self, sums: Sequence[int], algorithm: str) -> ShardIndex:
        """This index with ``sums`` (one per member, in archive order) as the members'
        checksums, computed with ``algorithm``."""
        if len(sums) != sum(len(s.members) for s in self.samples):
            raise ValueError(f"{len(sums)} checksums for another number of members")
        return self._replace_sums(iter(sums), algorithm)

    def without_checksums(self) -> ShardIndex:
        """This index with no checksums (they were made with an algorithm not in use)."""
        return self._replace_sums(itertools.repeat(None), None)

    def _replace_sums(self, sums: Iterator[int | None], algorithm: str | None) -> ShardIndex:
        samples = tuple(
            Sample(s.key, tuple(Member(m.ext, m.offset, m.size, next(sums)) for m in s.members))
            for s in self.samples
        )
        return ShardIndex(samples, self.size_bytes, algorithm)

    def to_bytes(self) -> bytes:
        """Serialize as versioned, columnar JSON; `from_bytes` restores it exactly."""
        # Columns of plain ints and strings: a fraction of the size and time of one
        # JSON object per member, and no per-member containers for the GC to scan.
        members = [m for s in self.samples for m in s.members]
        ext_ids: dict[str, int] = {}
        doc: dict[str, Any] = {
            "format": _FORMAT,
            "version": _VERSION,
            "size": self.size_bytes,
            "keys": [s.key for s in self.samples],
            "counts": [len(s.members) for s in self.samples],
            "exts": [ext_ids.setdefault(m.ext, len(ext_ids)) for m in members],
            "offsets": [m.offset for m in members],
            "sizes": [m.size for m in members],
            "ext_names": list(ext_ids),
        }
        if self.checksummed:
            # Optional: readers of version 1 that predate them ignore them, and an index
            # without them loads as unchecksummed (the hot tier checks those first).
            doc["checksum"] = self.algorithm
            doc["checksums"] = [m.checksum for m in members]
        # ensure_ascii keeps surrogate-escaped (non-UTF-8) names representable.
        return json.dumps(doc, separators=(",", ":")).encode("ascii")

    @classmethod
    def from_bytes(cls, data: bytes) -> ShardIndex:
        """Parse `to_bytes` output; CacheError if it is corrupt or of another version."""
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
                raise ValueError("not a cached tar index")
            if doc.get("version") != _VERSION:
                raise ValueError(f"unknown index version {doc.get('version')!r}")
            keys, names = _column(doc, "keys", str), _column(doc, "ext_names", str)
            counts, exts = _column(doc, "counts", int), _column(doc, "exts", int)
            offsets, sizes = _column(doc, "offsets", int), _column(doc, "sizes", int)
            if not len(exts) == len(offsets) == len(sizes) == sum(counts):
                raise ValueError("columns of different lengths")
            if len(keys) != len(counts) or (exts and max(exts) >= len(names)):
                raise ValueError("columns do not agree")
            sums: list[int | None] = [None] * len(sizes)
            algorithm = doc.get("checksum")
            if "checksums" in doc:
                column: list[int] = _column(doc, "checksums", int)
                if len(column) != len(sizes) or (column and max(column) >= 1 << 64):
                    raise ValueError("bad 'checksums' column")
                if not isinstance(algorithm, str):
                    raise ValueError(f"bad checksum algorithm {algorithm!r}")
                sums = list(column)
            else:
                algorithm = None
            members = list(map(Member, [names[e] for e in exts], offsets, sizes, sums))
            samples, pos = [], 0
            for key, count in zip(keys, counts, strict=True):
                samples.append(Sample(key, tuple(members[pos : pos + count])))
                pos += count
            size = doc["size"]
            if type(size) is not int or size < 0:
                raise ValueError(f"bad size {size!r}")
            return cls(tuple(samples), size, algorithm)
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            raise CacheError(f"corrupt shard index ({exc}); delete it to rebuild") from None

    @cached_property
    def payload_bytes(self) -> int:
        """Sum of member sizes: the sample bytes the shard holds, without tar overhead."""
        return sum(m.size for s in self.samples for m in s.members)


def _column(doc: dict[str, Any], name: str, kind: type) -> list[Any]:
    """doc[name] as a list of `kind` (ints non-negative), else ValueError."""
    items = doc[name]
    if not isinstance(items, list):
        raise ValueError(f"bad {name!r} column")
    # type() rather than isinstance(): bool is an int subclass and must not pass
    if not set(map(type, items)) <= {kind} or (kind is int and items and min(items) < 0):
        raise ValueError(f"bad {name!r} column")
    return items


class _Corrupt(Exception):
    """Internal: a header failed validation; feed() turns it into NotATarError."""


def _nts(field: bytes) -> str:
    # tarfile.nts with the stream default encoding (utf-8, surrogateescape)
    end = field.find(b"\0")
    return (field if end < 0 else field[:end]).decode("utf-8", "surrogateescape")


def _num(field: bytes) -> int:
    """tarfile.nti: octal text, or GNU base-256 when the first byte is 0x80/0xff."""
    try:  # fast path; where it fails, the exact rules below decide
        return int(field.rstrip(b"\0 "), 8)
    except ValueError:
        pass
    if field[0] in (0o200, 0o377):
        n = int.from_bytes(field[1:], "big")
        return n - 256 ** (len(field) - 1) if field[0] == 0o377 else n
    end = field.find(b"\0")
    try:
        return int((field if end < 0 else field[:end]).decode("ascii").strip() or "0", 8)
    except ValueError:
        raise _Corrupt("invalid number field") from None


def _checksum_ok(block: bytes) -> bool:
    stored = _num(block[148:156])
    # adler32 seeded with 0 keeps the plain byte sum mod 65521 in its low half; runs of
    # <= 256 bytes cannot reach the modulus, so three calls give the exact sum in C.
    # (sum(block) costs microseconds per header, which dominates on small members.)
    a = zlib.adler32
    total = 256 + (a(block[:148], 0) & 0xFFFF) + (a(block[156:412], 0) & 0xFFFF)
    if stored == total + (a(block[412:], 0) & 0xFFFF):
        return True
    signed: int = sum(_SIGNED.unpack(block))  # old Sun/NeXT tars sum signed chars
    return stored == 256 + signed


class TarIndexer:
    """Incremental tar parser: `feed` chunks as they download, then `finish`."""

    def __init__(self, url: str) -> None:
        self._url = url  # only for error messages
        self._pos = 0  # absolute offset of the next byte feed() will see
        self._skip = 0  # member data + padding still to pass over
        self._hdr = bytearray()  # a header block split across chunks
        self._meta = bytearray()  # payload of an "L"/"x" header being collected
        self._meta_left = 0  # bytes of that payload (padded) still to come
        self._meta_type = b""
        self._headers = 0  # headers parsed so far; the first one decides "is it a tar"
        self._at = 0  # offset of the header being parsed, for error messages
        self._ended = False  # saw the end-of-archive zero block
        self._error: NotATarError | None = None
        self._name: str | None = None  # pending long name (GNU "L" or pax path)
        self._size: int | None = None  # pending pax size
        self._pending = False  # an extension header awaits the header it describes
        self._samples = Grouper()
        # Every member so far, in archive order: the writer checksums their data as it
        # streams past (a member is listed before its first data byte is fed).
        self.found: list[Member] = self._samples.found

    def feed(self, chunk: bytes | memoryview) -> None:
        """Consume the next bytes of the archive; NotATarError once they cannot be a tar."""
        if self._error is not None:
            raise self._error
        # bytes slice without an extra copy; anything else is viewed as raw bytes
        data = chunk if isinstance(chunk, bytes) else memoryview(chunk).cast("B")
        n = len(data)
        if self._ended:  # trailing zero blocks (or anything) after the end marker
            self._pos += n
            return
        base, i, skip = self._pos, 0, self._skip
        try:
            while i < n:
                if skip:  # member data and padding: pure arithmetic, never copied
                    if skip >= n - i:
                        skip -= n - i
                        break
                    i += skip
                    skip = 0
                if self._meta_left:
                    step = min(self._meta_left, n - i)
                    self._meta += data[i : i + step]
                    self._meta_left -= step
                    i += step
                    if not self._meta_left:
                        self._extension(bytes(self._meta))
                elif self._hdr or n - i < _BLOCK:
                    step = min(_BLOCK - len(self._hdr), n - i)
                    self._hdr += data[i : i + step]
                    i += step
                    if len(self._hdr) == _BLOCK:
                        block = bytes(self._hdr)
                        self._hdr.clear()
                        skip = self._header(block, base + i)
                else:
                    i += _BLOCK
                    skip = self._header(bytes(data[i - _BLOCK : i]), base + i)
                if self._ended:
                    break
        except _Corrupt as exc:
            self._error = corrupt_error(self._url, self._headers, str(exc), self._at)
            raise self._error from None
        self._skip = skip
        self._pos = base + n

    def finish(self) -> ShardIndex:
        """End of input: return the index, or NotATarError if the archive is incomplete."""
        if self._error is not None:
            raise self._error
        where = ""
        if self._ended:
            pass
        elif self._pos == 0:
            where = "is empty"
        elif self._hdr:
            where = "ends inside a header"
        elif self._meta_left or self._pending:
            where = "ends inside an extended header"
        elif self._skip:
            where = "ends inside a member's data"
        if where:
            self._error = cut_short_error(self._url, self._headers, where, self._pos)
            raise self._error
        return ShardIndex(self._samples.finish(), self._pos)

    def _header(self, block: bytes, data_off: int) -> int:
        """Handle one header block (its data starts at `data_off`); return bytes to skip."""
        self._at = data_off - _BLOCK
        if block == _ZERO_BLOCK:
            if self._pending:  # tarfile: SubsequentHeaderError
                raise _Corrupt("end-of-archive marker after an extended header")
            # tarfile stops at the first zero block (the second is not checked), and an
            # archive that starts with one is a valid, empty archive.
            self._ended = True
            return 0
        if not _checksum_ok(block):
            raise _Corrupt("bad header checksum")
        self._headers += 1
        size = _num(block[124:136])
        if size < 0:
            raise _Corrupt("negative member size")
        kind = block[156:157]
        if kind in _EXTENDED:
            self._pending = True
            if kind in (b"K", b"g"):  # link targets and global pax headers: not needed
                return -(-size // _BLOCK) * _BLOCK
            if size > _MAX_META:
                raise _Corrupt(f"extended header of {size} bytes")
            self._meta_type = kind
            self._meta.clear()
            self._meta_left = -(-size // _BLOCK) * _BLOCK
            if not size:
                self._extension(b"")
            return 0
        if kind == b"S":
            raise _Corrupt("GNU sparse members are not supported")
        name = None
        if self._pending:  # of chained overrides the first wins, as in tarfile's recursion
            name, size = self._name, size if self._size is None else self._size
            self._name = self._size = None
            self._pending = False
        short = _nts(block[:100])
        regular = kind in _REGULAR and not (kind == b"\0" and short.endswith("/"))
        if regular:
            if name is None:
                name = short
                if block[345]:  # ustar prefix, applied whatever the magic says (tarfile)
                    name = f"{_nts(block[345:500])}/{short}"
            self._samples.add(name, data_off, size)
        elif kind in _SUPPORTED:
            return 0
        return -(-size // _BLOCK) * _BLOCK

    def _extension(self, payload: bytes) -> None:
        """A GNU long name or pax extended header is complete: remember its overrides."""
        if self._meta_type == b"L":
            if self._name is None:
                self._name = _nts(payload)
            return
        pos = 0
        name = size = None
        while (m := _PAX_RECORD.match(payload, pos)) is not None:
            try:
                length = int(m.group(1))
            except ValueError:  # past Python's limit on digits (4,300): no real record
                raise _Corrupt("invalid pax record") from None
            if length == 0:
                raise _Corrupt("invalid pax record")
            keyword = m.group(2).decode("utf-8", "surrogateescape")
            value = payload[m.end(2) + 1 : m.start(1) + length - 1]
            if keyword.startswith("GNU.sparse."):
                raise _Corrupt("GNU sparse members are not supported")
            if keyword == "path":
                name = value.decode("utf-8", "surrogateescape").rstrip("/")
            elif keyword == "size":
                try:
                    size = int(value.decode("utf-8", "surrogateescape"))
                except ValueError:
                    size = 0  # what tarfile does with a bad pax number
            # A length past the payload ends the records (the next match finds nothing,
            # as in tarfile), without carrying an offset too large to index with.
            pos = min(pos + length, len(payload))
        if name is not None and self._name is None:
            self._name = name
        if size is not None and self._size is None:
            if size < 0:
                raise _Corrupt("negative member size")
            self._size = size


def corrupt_error(url: str, headers: int, reason: str, at: int) -> NotATarError:
    """The error for a header that fails validation (``reason``) at byte ``at``, after
    ``headers`` valid headers: with none, the bytes are not a tar archive at all."""
    what = "is not a tar archive" if headers == 0 else "is a corrupt tar archive"
    return NotATarError(f"{url} {what}: {reason} (header at byte {at})")


def cut_short_error(url: str, headers: int, where: str, pos: int) -> NotATarError:
    """The error for an archive whose ``pos`` bytes end ``where`` ("ends inside a
    header", ...) after ``headers`` valid headers."""
    what = "is not a tar archive" if headers == 0 else "is truncated"
    return NotATarError(f"{url} {what}: it {where} (at byte {pos})")


def base_plus_ext(name: str) -> tuple[str, str] | None:
    """webdataset's split of a member's name into its sample key and its extension
    (lower-cased); None where the name has none (:data:`_BASE_EXT`).

    String methods give the regex's answer for every name without a newline whose base
    name does not start with a dot (tests/test_index.py holds the two together); the
    regex itself decides the others.
    """
    if "\n" not in name:
        slash = name.rfind("/")
        dot = name.find(".", slash + 1)
        if dot > slash + 1:
            return name[:dot], name[dot + 1 :].lower()
        if dot < 0:  # no dot after the last slash: an extension would hold a "/"
            return None
    m = _BASE_EXT.match(name)
    return None if m is None else (m.group(1), m.group(2).lower())


class Grouper:
    """webdataset's naming and grouping of a tar's regular files, in archive order.

    One piece of code for every way an index is built: :class:`TarIndexer` while the
    bytes stream in, and the one-pass scan of a downloaded file (:mod:`.scan`).
    """

    def __init__(self) -> None:
        self._samples: list[Sample] = []
        self._key: str | None = None
        self._members: list[Member] = []
        self._exts: list[str] = []
        self.found: list[Member] = []  # every member added, in archive order

    def add(self, name: str, offset: int, size: int, checksum: int | None = None) -> None:
        """Account the regular file ``name`` whose data lies at ``offset`` (webdataset's
        naming skips meta files and names without an extension)."""
        self.add_all(((name, offset, size, checksum),))

    def add_all(self, files: Iterable[tuple[str, int, int, int | None]]) -> None:
        """:meth:`add` for many files at once, in archive order, each ``(name, offset,
        size, checksum)``: one loop in Python for a whole shard, whose cost is per member."""
        samples, found, member = self._samples, self.found, _new_member
        key, members, exts = self._key, self._members, self._exts
        for name, offset, size, checksum in files:
            # tar_file_iterator's two meta-file rules (both need a leading "__"), then
            # base_plus_ext and group_by_keys.
            if name.startswith("__") and (
                ("/" not in name and name.endswith("__")) or _SKIP_META.match(name)
            ):
                continue
            split = base_plus_ext(name)
            if split is None:
                continue
            # A repeated extension under the same key also starts a new sample (cached's
            # rule; webdataset 1.0.2 raises ValueError there instead).
            if split[0] != key or split[1] in exts:
                if members:
                    samples.append(Sample(key or "", tuple(members)))
                key, members, exts = split[0], [], []
            m = member((split[1], offset, size, checksum))
            members.append(m)
            found.append(m)
            exts.append(split[1])
        self._key, self._members, self._exts = key, members, exts

    def finish(self) -> tuple[Sample, ...]:
        """Every sample so far, the last one included (calling it again is harmless)."""
        self._flush()
        return tuple(self._samples)

    def _flush(self) -> None:
        if self._members:
            self._samples.append(Sample(self._key or "", tuple(self._members)))
            self._members = []
            self._exts = []
