"""One specification of a shard file's index and checksums, held by both ways of building
them after the download: the compiled scan (``cached_wire._tarscan``, through
``cached.hot.scan.index_file``) and the streaming path's own code (``TarIndexer`` fed
the whole file, ``StreamSums`` over it), which is the specification.

Each generated file goes through both, and they must agree exactly: the same samples,
keys, extensions, offsets, sizes and member checksums, the same size and whole-file
checksum, or the same NotATarError message. The files: archives that Python's tarfile
writes (ustar, GNU and pax formats, long and non-ASCII names, members of 0, 1, 511, 512,
513 and 300 KB bytes, directories, links, meta files, names without extensions, repeated
extensions, pax size overrides, GNU base-256 sizes, trailer variants); headers with odd
number fields that only Python's int() reads (which the compiled scan hands over to the
Python path); and hostile ones (flipped bytes, truncations at every boundary, bad and
signed checksums, crafted pax and GNU extension headers, garbage, empty and zero files,
bytes after the end marker).
"""

from __future__ import annotations

import contextlib
import io
import random
import tarfile
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from cached.errors import NotATarError
from cached.hot import scan
from cached.hot.index import ShardIndex, TarIndexer
from cached.hot.verify import ALGORITHM, StreamSums

URL = "s3://bucket/shard-000042.tar"
BLOCK = 512
FORMATS = (tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT)

Case = tuple[str, str, bytes]  # (category, what, the file's bytes)


# -- the specification ------------------------------------------------------------------------


def specified(data: bytes) -> tuple[ShardIndex, int]:
    """What the streaming path builds from these bytes."""
    indexer, sums = TarIndexer(URL), StreamSums()
    indexer.feed(data)
    sums.update(data, indexer.found)
    index = indexer.finish()
    return index.with_checksums(sums.member_sums, ALGORITHM), sums.whole


def outcome(fn: Callable[[], tuple[ShardIndex, int]]) -> Any:
    try:
        index, whole = fn()
    except NotATarError as exc:
        return ("NotATarError", str(exc))
    assert index.checksummed or not any(s.members for s in index.samples)
    return (index, index.size_bytes, index.algorithm, whole)


# -- building archives ------------------------------------------------------------------------


def pad(data: bytes) -> bytes:
    return data + bytes(-len(data) % BLOCK)


def rechecksum(header: bytearray, fmt: bytes = b"%06o\0 ") -> None:
    header[148:156] = b" " * 8
    header[148:156] = fmt % sum(header)


def raw_header(
    name: bytes, size: int, kind: bytes = b"0", prefix: bytes = b"", size_field: bytes | None = None
) -> bytearray:
    """A ustar header block written byte by byte, for what tarfile would not write."""
    h = bytearray(BLOCK)
    h[0:100] = name[:100].ljust(100, b"\0")
    h[100:108] = b"0000644\0"
    h[108:116] = h[116:124] = b"0000000\0"
    h[124:136] = size_field if size_field is not None else b"%011o\0" % size
    h[136:148] = b"%011o\0" % 0
    h[156:157] = kind
    h[257:265] = b"ustar\x0000"
    h[345:500] = prefix[:155].ljust(155, b"\0")
    rechecksum(h)
    return h


def raw_member(name: bytes, data: bytes, kind: bytes = b"0", **kw: Any) -> bytes:
    return bytes(raw_header(name, len(data), kind, **kw)) + pad(data)


def pax_header(payload: bytes, kind: bytes = b"x") -> bytes:
    return raw_member(b"././@PaxHeader", payload, kind)


def record(keyword: str, value: bytes | str) -> bytes:
    """One pax record, its length counting itself."""
    body = b" " + keyword.encode() + b"=" + (value if isinstance(value, bytes) else value.encode())
    body += b"\n"
    n = len(body) + 1
    while len(str(n).encode()) + len(body) != n:
        n += 1
    return str(n).encode() + body


END = bytes(2 * BLOCK)

KEYS = ["k", "dir/sub/k", "a/b.c", "ünïcødé/ß", "x" * 120, "p" * 90 + "/" + "q" * 60, "Ü" * 70]
EXTS = ["jpg", "json", "cls", "txt", "seg.png", "TXT", "JPEG", "a", "b"]
ODD_NAMES = [
    "__key__",
    "__meta__",
    "__meta__/inside.txt",
    "__notmeta__.txt",
    "nodot",
    "dir.d/nodot",
    "dir/.hidden",
    "trailing.dot.",
    "sp ace.t x t",
    "new\nline.txt",
]
SIZES = [0, 1, 2, 100, 511, 512, 513, 1023, 1024, 1025, 4096]


def random_size(rng: random.Random) -> int:
    roll = rng.random()
    if roll < 0.6:
        return rng.choice(SIZES)
    if roll < 0.97:
        return rng.randrange(20_000)
    return rng.randrange(200_000, 700_000)  # past the compiled scan's 256 KB windows


def add(tf: tarfile.TarFile, info: tarfile.TarInfo, data: bytes | None = None) -> None:
    with contextlib.suppress(ValueError):  # a name ustar cannot hold: tarfile writes nothing
        tf.addfile(info, None if data is None else io.BytesIO(data))


def tarfile_archive(rng: random.Random, fmt: int) -> bytes:
    """A random archive as Python's tarfile writes it in ``fmt``."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tf:
        n_samples = rng.choice([0, 1, 2, 5, 20])
        for s in range(n_samples):
            key = f"{rng.choice(KEYS)}{s}"
            exts = rng.sample(EXTS, rng.randrange(1, 4))
            if rng.random() < 0.1:
                exts.append(exts[0])  # a repeated extension starts a new sample
            for ext in exts:
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = random_size(rng)
                info.type = rng.choice([tarfile.REGTYPE] * 8 + [tarfile.AREGTYPE, tarfile.CONTTYPE])
                add(tf, info, rng.randbytes(info.size))
            roll = rng.random()
            if roll < 0.15:
                info = tarfile.TarInfo(rng.choice(ODD_NAMES))
                info.size = rng.choice(SIZES)
                add(tf, info, rng.randbytes(info.size))
            elif roll < 0.25:
                info = tarfile.TarInfo(f"d{s}/")
                info.type = tarfile.DIRTYPE
                add(tf, info)
            elif roll < 0.35:
                info = tarfile.TarInfo(f"link{s}.txt")
                info.type = rng.choice([tarfile.SYMTYPE, tarfile.LNKTYPE])
                info.linkname = "l" * rng.choice([5, 150])  # long: GNU "K" / pax linkpath
                add(tf, info)
            elif roll < 0.4:
                info = tarfile.TarInfo(f"fifo{s}")
                info.type = rng.choice([tarfile.FIFOTYPE, tarfile.CHRTYPE])
                add(tf, info)
    return trailer_variant(rng, out.getvalue())


def trailer_variant(rng: random.Random, data: bytes) -> bytes:
    """The archive's end as some writers leave it: tarfile's, one zero block, none, or
    bytes after the end marker (which the index ignores and the whole checksum covers)."""
    end = len(data.rstrip(b"\0"))
    end = -(-end // BLOCK) * BLOCK
    roll = rng.random()
    if roll < 0.5 or end == 0:
        return data
    if roll < 0.65:
        return data[:end]
    if roll < 0.8:
        return data[: end + BLOCK]
    return data[: end + BLOCK * rng.choice([1, 2])] + rng.randbytes(rng.randrange(1, 3000))


def crafted_archive(rng: random.Random) -> bytes:
    """What tarfile does not write but reads: pax size overrides, GNU base-256 sizes,
    ustar prefixes, GNU long names of odd shapes, global and link headers."""
    parts: list[bytes] = []
    for n in range(rng.randrange(1, 8)):
        data = rng.randbytes(rng.choice(SIZES))
        name = f"c{n}.{rng.choice(EXTS)}".encode()
        roll = rng.random()
        if roll < 0.2:  # the pax size rules; the header's own says something else
            parts.append(pax_header(record("size", str(len(data)))))
            parts.append(raw_member(name, b"", size_field=b"%011o\0" % rng.randrange(5)))
            parts.append(pad(data))
        elif roll < 0.35:  # base-256, as GNU tar writes sizes past 8 GiB
            field = b"\x80" + len(data).to_bytes(11, "big")
            parts.append(bytes(raw_header(name, 0, size_field=field)) + pad(data))
        elif roll < 0.5:  # a ustar prefix
            parts.append(
                raw_member(b"inner/" + name, data, prefix=b"pre/fix" * rng.randrange(1, 5))
            )
        elif roll < 0.6:  # pax path (trailing slashes stripped), name and size overrides
            path = f"paxdir/ü{n}.{rng.choice(EXTS)}" + "/" * rng.randrange(3)
            payload = record("path", path) + record("mtime", "1.5")
            if rng.random() < 0.5:
                payload += record("size", str(len(data)))
            parts.append(pax_header(payload) + raw_member(name, data))
        elif roll < 0.7:  # GNU long name, NUL-terminated or running into its padding
            long = b"L" * rng.randrange(100, 700) + b"." + rng.choice(EXTS).encode()
            parts.append(raw_member(b"././@LongLink", long + b"\0" * rng.randrange(2), b"L"))
            parts.append(raw_member(name, data))
        elif roll < 0.8:  # a global header and a long link name: skipped, then a member
            parts.append(pax_header(record("comment", "x" * rng.randrange(600)), b"g"))
            parts.append(raw_member(b"././@LongLink", b"t" * 300, b"K"))
            parts.append(raw_member(name, data))
        elif roll < 0.9:  # chained overrides: the first of each wins
            parts.append(pax_header(record("path", f"first{n}.a")))
            parts.append(raw_member(b"././@LongLink", b"second.b\0", b"L"))
            parts.append(raw_member(name, data))
        else:  # an unknown type's data is skipped; a dir-style AREGTYPE too
            parts.append(raw_member(name, data, rng.choice([b"V", b"M", b"N", b"\0"])))
            parts.append(raw_member(f"dirlike{n}/".encode(), b"", b"\0"))
    return trailer_variant(rng, b"".join(parts) + END)


# -- odd and hostile bytes --------------------------------------------------------------------


def headers_of(data: bytes) -> list[tuple[int, int, int]]:
    """(header offset, data offset, data size) of every header tarfile finds, extension
    headers included."""
    out = []
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
            for info in tf.getmembers():
                out.append((info.offset, info.offset_data, info.size))
    except tarfile.TarError:
        pass
    return out


ODD_NUMBERS = [
    b" %o ",  # white space around
    b"+%o",  # a sign
    b"0o%o",  # a prefix
    b"\t%o\0",
    b"%o\0 junk",  # text after the NUL: int() fails, the text before it is read
    b"\0%o",  # leading NUL: read as 0
    b"  %o",
    b"%o",  # no terminator
]


def odd_number(rng: random.Random, data: bytes) -> bytes | None:
    """A header whose size or checksum field only Python's int() reads (or refuses)."""
    found = headers_of(data)
    if not found:
        return None
    at, _, size = rng.choice(found)
    out = bytearray(data)
    h = bytearray(out[at : at + BLOCK])
    pattern = rng.choice(ODD_NUMBERS)
    if rng.random() < 0.5:
        h[124:136] = (pattern % size)[:12].ljust(12, b"\0")
        rechecksum(h)
    else:
        h[148:156] = b" " * 8
        h[148:156] = (pattern % sum(h))[:8].ljust(8, b"\0")
    out[at : at + BLOCK] = h
    return bytes(out)


def cuts(data: bytes, rng: random.Random) -> list[int]:
    """Every boundary of interest: around each header, its data and padding, the end."""
    points = {0, 1, len(data) - 1, len(data) - BLOCK, len(data) - 2 * BLOCK}
    for at, off, size in headers_of(data):
        end = off + size
        points |= {at + 1, at + 100, at + BLOCK - 1, at + BLOCK, off + 1, end - 1, end, end + 1}
        points |= {-(-end // BLOCK) * BLOCK - 1}
    points |= {rng.randrange(max(1, len(data))) for _ in range(3)}
    return sorted(p for p in points if 0 <= p < len(data))


def hostile(rng: random.Random, base: bytes) -> Iterator[tuple[str, bytes]]:
    found = headers_of(base)
    for cut in rng.sample(cuts(base, rng), min(12, len(cuts(base, rng)))):
        yield f"cut at {cut}", base[:cut]
    if found:
        at = rng.choice(found)[0]
        out = bytearray(base)
        out[at + rng.randrange(BLOCK)] ^= 1 << rng.randrange(8)
        yield "flipped header bit", bytes(out)
        h = bytearray(out[at : at + BLOCK])
        for _ in range(rng.randrange(1, 4)):  # the same, the checksum recomputed
            h[rng.choice([0, 99, 124, 130, 135, 156, 157, 345, rng.randrange(BLOCK)])] = (
                rng.randrange(256)
            )
        rechecksum(h)
        out[at : at + BLOCK] = h
        yield "changed header", bytes(out)
        h[124:136] = rng.choice(
            [
                b"\xff" + bytes(11),
                b"\xff" * 12,
                b"\x80" + b"\xff" * 11,
                b"\x80" + bytes(10) + b"\x01",
            ]
        )
        rechecksum(h)
        out[at : at + BLOCK] = h
        yield "base-256 size", bytes(out)
        h[10] = 0xE9  # a high byte makes the signed and unsigned sums differ
        signed = sum(b - 256 if b > 127 else b for b in h[:148] + h[156:]) + 256
        h[148:156] = rng.choice([b"%06o\0 " % signed, b"%07o\0" % (signed & 0o7777777)])
        out[at : at + BLOCK] = h
        yield "signed checksum", bytes(out)
    out = bytearray(base)
    for _ in range(rng.randrange(1, 5)):
        if out:
            out[rng.randrange(len(out))] = rng.randrange(256)
    yield "random bytes changed", bytes(out)


PAX_PAYLOADS = [
    b"0 path=x\n",  # a zero length
    record("GNU.sparse.map", "0,1"),
    record("size", "abc"),  # a bad number: tarfile reads 0
    record("size", ""),
    record("size", " 12"),
    record("size", "-1"),
    record("size", "1_2"),
    record("size", "9" * 30),
    record("size", str((1 << 64) + 5)),  # 5 if it wrapped at 64 bits
    record("path", "a/b.txt") + record("path", "c/d.txt"),  # the last record of one wins
    record("path", "///"),
    record("path", b"bin\xffary.\0txt"),
    b"5 path=long-record-length.txt\n",  # lengths that lie
    b"99 path=x.txt\n",
    b"12 =empty\n",
    b"12 noequals\n",
    b"x12 path=a.b\n",
    b"1" * 30 + b" path=a.b\n",
    b"0012 size=3\n",
]


def crafted_hostile(rng: random.Random) -> Iterator[tuple[str, bytes]]:
    member = raw_member(b"m.txt", b"hello")
    for payload in PAX_PAYLOADS:
        yield f"pax {payload[:30]!r}", pax_header(payload) + member + END
    for first, second in [(b"x", b"x"), (b"L", b"x"), (b"x", b"L"), (b"L", b"L")]:  # first wins
        chain = [
            raw_member(b"././@LongLink", f"{n}.{kind.decode()}\0".encode(), b"L")
            if kind == b"L"
            else pax_header(record("path", f"{n}.{kind.decode()}") + record("size", str(n)))
            for n, kind in ((1, first), (2, second))
        ]
        yield f"chained {first!r} then {second!r}", b"".join(chain) + member + END
    negative = raw_header(b"\x80" * 90 + b".txt", 0)  # a negative signed sum
    signed = sum(b - 256 if b > 127 else b for b in negative[:148] + negative[156:]) + 256
    assert signed < 0
    negative[148:156] = b"\xff" + (signed + (1 << 56)).to_bytes(7, "big")  # base-256
    yield "negative base-256 checksum", bytes(negative) + END
    trailing = rng.randbytes(700_000)  # past the compiled scan's window
    yield "bytes after the end marker", member + END + trailing
    yield "zero blocks after the end marker", member + bytes(300 * BLOCK)
    yield "pax ended by a zero block", pax_header(record("path", "a.b")) + END
    yield "pax at the end", pax_header(record("path", "a.b"))
    yield "pax cut short", pax_header(record("comment", "c" * 900))[: BLOCK + 600]
    yield "long name at the end", raw_member(b"././@LongLink", b"n.txt\0", b"L")
    yield "global header at the end", pax_header(record("comment", "c"), b"g")
    yield "global header cut short", pax_header(record("comment", "c" * 900), b"g")[:800]
    yield "sparse", raw_member(b"s.txt", b"abc", b"S") + END
    yield "long name of 2 MB", bytes(raw_header(b"././@LongLink", 2 << 20, b"L")) + END
    yield "pax of 1 MB", bytes(raw_header(b"././@PaxHeader", 1 << 20, b"x")) + END
    yield "empty pax", bytes(raw_header(b"././@PaxHeader", 0, b"x")) + member + END
    yield "dir with data", raw_member(b"d/", b"x" * 700, b"5") + member + END
    yield "old-style dir with data", raw_member(b"d/", b"x" * 700, b"\0") + member + END
    yield "old-style dir, no data", raw_member(b"d/", b"", b"\0") + member + END
    yield "empty", b""
    yield "one byte", b"\0"
    yield "100 zero bytes", bytes(100)
    yield "a zero block", bytes(BLOCK)
    yield "zero blocks", bytes(BLOCK * rng.randrange(2, 30))
    yield "zero blocks, then a member", END + member
    yield "garbage", rng.randbytes(rng.choice([511, 512, 4096]))
    yield "text", b"<html><body>503 Service Unavailable</body></html>\n" * 30
    yield "digits", b"1234567" * 200
    yield "a header alone", bytes(raw_header(b"m.txt", 0))
    yield "a header cut", bytes(raw_header(b"m.txt", 0))[:300]


def cases(seed: int, n: int) -> Iterator[Case]:
    rng = random.Random(seed)
    for i in range(n):
        fmt = FORMATS[i % 3]
        base = crafted_archive(rng) if i % 4 == 3 else tarfile_archive(rng, fmt)
        yield "valid", f"archive {i}", base
        odd = odd_number(rng, base)
        if odd is not None:
            yield "odd", f"odd number in archive {i}", odd
        if i % 3 == 0:
            for what, data in hostile(rng, base):
                yield "hostile", f"{what} of archive {i}", data
    for what, data in crafted_hostile(rng):
        yield "hostile", what, data


# -- the tests --------------------------------------------------------------------------------


def check(tmp_path: Path, cases_: Iterator[Case]) -> Counter[tuple[str, str]]:
    """Each case through index_file and the specification; what way each went."""
    path = tmp_path / "shard.tar.partial"
    ways: Counter[tuple[str, str]] = Counter()
    for category, what, data in cases_:
        path.write_bytes(data)
        before = Counter(scan.paths)
        got = outcome(lambda: scan.index_file(path, URL))
        (way,) = (scan.paths - before).keys()
        ways[category, way] += 1
        assert got == outcome(partial(specified, data)), (category, what, way)
    return ways


def test_the_compiled_scan_meets_the_specification(tmp_path: Path) -> None:
    pytest.importorskip("cached_wire._tarscan")
    assert scan.COMPILED
    ways = check(tmp_path, cases(seed=7, n=240))
    print(dict(ways))  # how often each way was taken (pytest -s)
    valid = ways["valid", "compiled"] + ways["valid", "fallback"]
    assert valid > 200 and ways["valid", "compiled"] >= 0.9 * valid, ways
    # The odd number fields are why there is a fallback; it must not be the common way
    # for the hostile bytes either (their errors are found in C).
    assert ways["odd", "fallback"] > 0
    hostile = ways["hostile", "compiled"] + ways["hostile", "fallback"]
    assert ways["hostile", "compiled"] >= 0.7 * hostile, ways


def test_the_python_path_meets_the_specification(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the compiled module (no C compiler), the same results from Python."""
    monkeypatch.setattr(scan, "_tarscan", None)
    ways = check(tmp_path, cases(seed=11, n=60))
    assert set(way for _, way in ways) == {"python"}


def test_a_large_archive_across_many_windows(tmp_path: Path) -> None:
    """Members spanning the compiled scan's windows, members of every size near them."""
    rng = random.Random(5)
    parts = []
    for n in range(60):
        size = rng.choice([(256 << 10) - 1, 256 << 10, (256 << 10) + 1, 700_000, 3, 100_000])
        parts.append(raw_member(f"big{n // 2}.{'ab'[n % 2]}".encode(), rng.randbytes(size)))
    data = b"".join(parts) + END + rng.randbytes(5000)
    ways = check(tmp_path, iter([("valid", "large", data)]))
    if scan.COMPILED:
        assert ways["valid", "compiled"] == 1
