"""The streaming tar indexer against real archives (Python's tarfile and webdataset's
TarWriter): its index must name the same samples, extensions and bytes as webdataset."""

from __future__ import annotations

import io
import json
import os
import random
import tarfile
from collections.abc import Iterable
from pathlib import Path

import pytest
import webdataset as wds
from webdataset.tariterators import group_by_keys, tar_file_expander

from cached.errors import CacheError, NotATarError
from cached.hot.index import _BASE_EXT, Member, Sample, ShardIndex, TarIndexer, base_plus_ext

CHUNKS = [1, 7, 512, 513, 4096, None]  # None: the whole file in one feed
URL = "s3://bucket/shard-000001.tar"
_WDS_FIELDS = {"__key__", "__url__", "__local_path__"}  # not members

# Names that exercise webdataset's naming rules; data sizes straddle block bounds.
NAMES: list[tuple[str, int]] = [
    ("plain.txt", 5),
    ("plain.cls", 1),
    ("dir/sub/nested.jpg", 512),
    ("dir/sub/nested.json", 513),
    ("a/b.c.seg.png", 1024),  # key a/b, ext c.seg.png
    ("a/b.TXT", 3),  # upper-case extension, same sample
    ("UPPER.JPEG", 0),  # empty file
    ("__meta__", 4),  # meta file: skipped
    ("__meta__/inside.txt", 4),  # skip_meta regex: skipped
    ("__notmeta__.txt", 2),  # kept: the name does not end in "__"
    ("nodot", 9),  # no extension: skipped
    ("dir.d/nodot", 9),  # dot only in a directory: skipped
    ("dir/.hidden", 6),  # key "dir/", ext "hidden" (webdataset's regex)
    ("long/" + "x" * 120 + ".img.png", 700),  # > 100 chars: GNU L / pax / ustar prefix
    ("p" * 90 + "/" + "q" * 80 + ".bin", 10),  # fits ustar name + prefix
    ("ünïcødé/ß.txt", 8),  # non-ASCII: pax path record in PAX format
    ("empty.a", 0),
    ("empty.b", 0),
]


def _data(name: str, size: int) -> bytes:
    return (name.encode() * (size // max(1, len(name)) + 1))[:size]


def write_tarfile(path: Path, fmt: int, names: Iterable[tuple[str, int]] = NAMES) -> bytes:
    """A tar with directories, links and the given files, as Python's tarfile writes it."""
    with tarfile.open(path, "w", format=fmt) as tf:
        for dirname in ("dir", "dir/sub"):
            info = tarfile.TarInfo(dirname)
            info.type = tarfile.DIRTYPE
            tf.addfile(info)
        for name, size in names:
            info = tarfile.TarInfo(name)
            info.size = size
            tf.addfile(info, io.BytesIO(_data(name, size)))
        link = tarfile.TarInfo("link.txt")
        link.type = tarfile.SYMTYPE
        link.linkname = "plain.txt"
        tf.addfile(link)
        hard = tarfile.TarInfo("hard.txt")
        hard.type = tarfile.LNKTYPE
        hard.linkname = "plain.txt"
        tf.addfile(hard)
        info = tarfile.TarInfo("last.txt")
        info.size = 3
        tf.addfile(info, io.BytesIO(b"end"))
    return path.read_bytes()


def webdataset_samples(path: Path) -> list[tuple[str, dict[str, bytes]]]:
    """What webdataset.WebDataset yields for the file (its own expander and grouper)."""
    with path.open("rb") as stream:
        out = []
        for sample in group_by_keys(tar_file_expander([{"url": str(path), "stream": stream}])):
            fields = {k: v for k, v in sample.items() if k not in _WDS_FIELDS}
            out.append((sample["__key__"], fields))
        return out


def index_bytes(data: bytes, chunk: int | None) -> ShardIndex:
    indexer = TarIndexer(URL)
    step = chunk or max(1, len(data))
    for start in range(0, len(data), step):
        indexer.feed(data[start : start + step])
    return indexer.finish()


def as_samples(index: ShardIndex, data: bytes) -> list[tuple[str, dict[str, bytes]]]:
    """The index resolved against the file's bytes, in webdataset's shape."""
    return [
        (s.key, {m.ext: data[m.offset : m.offset + m.size] for m in s.members})
        for s in index.samples
    ]


def check_matches_webdataset(path: Path, data: bytes, chunk: int | None) -> ShardIndex:
    index = index_bytes(data, chunk)
    expected = webdataset_samples(path)
    got = as_samples(index, data)
    assert got == expected
    # extension order too (dict equality ignores it)
    assert [list(f) for _, f in got] == [list(f) for _, f in expected]
    assert index.size_bytes == len(data)
    return index


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize(
    "fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT], ids=str
)
def test_tarfile_archives_match_webdataset(tmp_path: Path, fmt: int, chunk: int | None) -> None:
    names = NAMES
    if fmt == tarfile.USTAR_FORMAT:  # ustar can hold neither > 255-char nor non-ASCII names
        names = [(n, s) for n, s in NAMES if len(n) < 100 or n.startswith("p")]
    path = tmp_path / "shard.tar"
    data = write_tarfile(path, fmt, names)
    index = check_matches_webdataset(path, data, chunk)
    keys = [s.key for s in index.samples]
    assert "a/b" in keys and "dir/" in keys and "nodot" not in keys
    assert not any(k.startswith("__meta") for k in keys)
    sample = next(s for s in index.samples if s.key == "a/b")
    assert [m.ext for m in sample.members] == ["c.seg.png", "txt"]


@pytest.mark.parametrize("chunk", CHUNKS)
def test_webdataset_tarwriter_archive(tmp_path: Path, chunk: int | None) -> None:
    path = tmp_path / "wds.tar"
    rng = random.Random(7)
    with wds.TarWriter(str(path)) as sink:
        for i in range(60):
            sink.write(
                {
                    "__key__": f"sample{i:06d}",
                    "jpg": rng.randbytes(rng.randrange(0, 3000)),
                    "cls": str(i % 10).encode(),
                    "seg.png": rng.randbytes(rng.randrange(0, 600)),
                }
            )
    data = path.read_bytes()
    index = check_matches_webdataset(path, data, chunk)
    assert len(index.samples) == 60
    assert index.samples[0].key == "sample000000"
    assert index.payload_bytes == sum(m.size for s in index.samples for m in s.members)


def test_duplicate_extension_starts_a_new_sample(tmp_path: Path) -> None:
    # webdataset 1.0.2 raises on this; cached's documented rule splits the sample.
    path = tmp_path / "dup.tar"
    data = write_tarfile(path, tarfile.GNU_FORMAT, [("k.txt", 1), ("k.txt", 2), ("k.cls", 3)])
    with pytest.raises(ValueError, match="duplicate"):
        webdataset_samples(path)
    got = as_samples(index_bytes(data, 7), data)
    assert got[:2] == [("k", {"txt": b"k"}), ("k", {"txt": b"k.", "cls": b"k.c"})]


def test_chunk_types_and_sizes_agree(tmp_path: Path) -> None:
    path = tmp_path / "shard.tar"
    data = write_tarfile(path, tarfile.PAX_FORMAT)
    want = index_bytes(data, None)
    rng = random.Random(1)
    for _ in range(20):  # random boundaries, as bytes, bytearray and memoryview
        indexer, pos = TarIndexer(URL), 0
        while pos < len(data):
            step = rng.choice([1, 3, 100, 511, 1500, 20000])
            piece = data[pos : pos + step]
            indexer.feed(rng.choice([bytes, bytearray, memoryview])(piece))
            pos += step
        assert indexer.finish() == want


def test_trailer_variants(tmp_path: Path) -> None:
    path = tmp_path / "shard.tar"
    data = write_tarfile(path, tarfile.GNU_FORMAT)
    want = index_bytes(data, None)
    end = max(m.offset + m.size for s in want.samples for m in s.members)
    end = -(-end // 512) * 512  # the last member's padding
    for cut in (end, end + 512):  # no zero block; a single zero block
        assert index_bytes(data[:cut], 513).samples == want.samples
    # anything after the end marker is counted, not parsed
    junk = index_bytes(data + os.urandom(1000), 4096)
    assert junk.samples == want.samples and junk.size_bytes == len(data) + 1000


def test_empty_archive(tmp_path: Path) -> None:
    path = tmp_path / "empty.tar"
    with tarfile.open(path, "w"):
        pass
    index = check_matches_webdataset(path, path.read_bytes(), 7)
    assert index.samples == () and index.payload_bytes == 0


def test_global_pax_header_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "g.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "hi"}) as tf:
        for name in ("a.txt", "a.cls"):
            info = tarfile.TarInfo(name)
            info.size = 2
            tf.addfile(info, io.BytesIO(b"xy"))
    data = path.read_bytes()
    assert data[156:157] == b"g"
    check_matches_webdataset(path, data, 1)


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT], ids=str)
def test_member_over_8_gib_is_skipped_not_buffered(fmt: int) -> None:
    # GNU stores such a size in base-256, pax in a "size" record. 9 GiB of data go
    # through feed() as 16 MiB views of one buffer: only arithmetic, no copies.
    size = 9 << 30
    info = tarfile.TarInfo("big.bin")
    info.size = size
    header = info.tobuf(fmt)
    block = memoryview(bytes(16 << 20))
    indexer = TarIndexer(URL)
    indexer.feed(header)
    for _ in range(size // len(block)):
        indexer.feed(block)
    small = tarfile.TarInfo("big.txt")
    small.size = 1
    indexer.feed(small.tobuf(fmt) + b"z".ljust(512, b"\0") + bytes(1024))
    index = indexer.finish()
    assert index.samples == (
        Sample(
            "big", (Member("bin", len(header), size), Member("txt", len(header) + size + 512, 1))
        ),
    )


def test_random_bytes_are_not_a_tar() -> None:
    noise = random.Random(3).randbytes(4096)
    indexer = TarIndexer(URL)
    indexer.feed(noise[:511])  # not yet decidable
    with pytest.raises(NotATarError, match="is not a tar archive") as info:
        indexer.feed(noise[511:1024])
    assert URL in str(info.value)
    with pytest.raises(NotATarError):  # the indexer stays failed
        indexer.finish()


@pytest.mark.parametrize("data", [b"", b"short", bytes(100)], ids=["empty", "short", "zeros"])
def test_too_short_is_not_a_tar(data: bytes) -> None:
    indexer = TarIndexer(URL)
    indexer.feed(data)
    with pytest.raises(NotATarError, match="is not a tar archive") as info:
        indexer.finish()
    assert URL in str(info.value)


def test_truncated_archives_fail_at_finish(tmp_path: Path) -> None:
    path = tmp_path / "shard.tar"
    data = write_tarfile(path, tarfile.GNU_FORMAT)
    index = index_bytes(data, None)
    big = next(m for s in index.samples for m in s.members if m.size == 1024)
    long_header = data.index(b"././@LongLink")  # the GNU "L" header of the long name
    cuts = {
        "mid-header": big.offset - 200,
        "mid-member": big.offset + 100,
        "mid-padding": index.samples[0].members[0].offset + 100,
        "mid-long-name": long_header + 600,
        "after-long-name": long_header + 1024,
    }
    for what, cut in cuts.items():
        for chunk in (1, 512, None):
            indexer = TarIndexer(URL)
            step = chunk or cut
            for start in range(0, cut, step):
                indexer.feed(data[start : min(cut, start + step)])
            with pytest.raises(NotATarError, match="truncated") as info:
                indexer.finish()
            assert URL in str(info.value), what


def _rechecksum(header: bytearray) -> None:
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)


def test_bad_checksum(tmp_path: Path) -> None:
    path = tmp_path / "shard.tar"
    data = bytearray(write_tarfile(path, tarfile.GNU_FORMAT))
    first = bytearray(data)
    first[10] ^= 0x01  # inside the first name
    with pytest.raises(NotATarError, match=r"is not a tar archive.*checksum"):
        index_bytes(bytes(first), 513)
    later_at = index_bytes(bytes(data), None).samples[2].members[0].offset - 512
    data[later_at + 3] ^= 0x01
    with pytest.raises(NotATarError, match=r"corrupt tar archive.*checksum") as info:
        index_bytes(bytes(data), 7)
    assert URL in str(info.value)
    # the same change with a recomputed checksum is accepted (and renames the member)
    header = bytearray(data[later_at : later_at + 512])
    _rechecksum(header)
    data[later_at : later_at + 512] = header
    index_bytes(bytes(data), 7)


def test_signed_checksum_and_base256_size_are_accepted(tmp_path: Path) -> None:
    # Old Sun tars summed signed chars; GNU may write any size in base-256.
    info = tarfile.TarInfo("caf\xe9.txt")  # a high-bit byte makes the two sums differ
    info.size = 5
    header = bytearray(info.tobuf(tarfile.GNU_FORMAT, encoding="latin-1"))
    header[124:136] = b"\x80" + (5).to_bytes(11, "big")
    header[148:156] = b" " * 8
    signed = sum(b - 256 if b > 127 else b for b in header)
    header[148:156] = b"%06o\0 " % signed
    data = bytes(header) + b"hello".ljust(512, b"\0") + bytes(1024)
    path = tmp_path / "sun.tar"
    path.write_bytes(data)
    index = index_bytes(data, 1)
    assert [m.size for s in index.samples for m in s.members] == [5]
    assert index.samples[0].key == "caf\udce9"  # non-UTF-8 byte, surrogate-escaped
    assert as_samples(index, data) == webdataset_samples(path)


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "shard.tar"
    index = index_bytes(write_tarfile(path, tarfile.PAX_FORMAT), 4096)
    blob = index.to_bytes()
    again = ShardIndex.from_bytes(blob)
    assert again == index and again.size_bytes == index.size_bytes
    assert again.payload_bytes == index.payload_bytes > 0
    assert ShardIndex.from_bytes(ShardIndex((), 0).to_bytes()) == ShardIndex((), 0)
    surrogate = ShardIndex((Sample("caf\udce9", (Member("txt", 512, 3),)),), 2048)
    assert ShardIndex.from_bytes(surrogate.to_bytes()) == surrogate


def _doc(**changes: object) -> bytes:
    doc: dict[str, object] = {
        "format": "cached-tar-index",
        "version": 1,
        "size": 4096,
        "keys": ["a", "b"],
        "counts": [2, 1],
        "exts": [0, 1, 0],
        "offsets": [512, 1536, 2560],
        "sizes": [3, 4, 5],
        "ext_names": ["jpg", "cls"],
    }
    doc.update(changes)
    return json.dumps({k: v for k, v in doc.items() if v is not None}).encode()


def test_from_bytes_reads_the_documented_format() -> None:
    index = ShardIndex.from_bytes(_doc())
    assert index == ShardIndex(
        (
            Sample("a", (Member("jpg", 512, 3), Member("cls", 1536, 4))),
            Sample("b", (Member("jpg", 2560, 5),)),
        ),
        4096,
    )
    assert ShardIndex.from_bytes(index.to_bytes()) == index


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"\xff\xfe",
        b"not json",
        b"[]",
        b"[" * 100000,
        _doc(version=999),
        _doc(version=None),
        _doc(format="other"),
        _doc(size=-1),
        _doc(size=True),
        _doc(size=[1]),
        _doc(keys=None),
        _doc(keys=["a", 1]),
        _doc(keys=["a"]),
        _doc(counts=[2, 2]),
        _doc(counts=[1, 1]),
        _doc(counts="21"),
        _doc(exts=[0, 1, 2]),
        _doc(exts=[0, 1, -1]),
        _doc(exts=[0, 1]),
        _doc(offsets=[512, "1536", 2560]),
        _doc(offsets=[512, -1, 2560]),
        _doc(offsets=[512, 1536.0, 2560]),
        _doc(sizes=[3, 4, True]),
        _doc(sizes={"a": 1}),
        _doc(ext_names=["jpg", 7]),
    ],
)
def test_from_bytes_rejects_garbage(blob: bytes) -> None:
    with pytest.raises(CacheError):
        ShardIndex.from_bytes(blob)


def test_from_bytes_rejects_truncated_index(tmp_path: Path) -> None:
    path = tmp_path / "shard.tar"
    blob = index_bytes(write_tarfile(path, tarfile.GNU_FORMAT), None).to_bytes()
    for cut in (1, len(blob) // 2, len(blob) - 1):
        with pytest.raises(CacheError):
            ShardIndex.from_bytes(blob[:cut])


def test_oversized_long_name_is_refused() -> None:
    # A GNU long name is the one payload the indexer buffers; a hostile size must not
    # make it buffer without bound.
    info = tarfile.TarInfo("x" * 200 + ".txt")
    info.size = 1
    header = bytearray(info.tobuf(tarfile.GNU_FORMAT)[:512])  # the "L" header alone
    assert header[156:157] == b"L"
    header[124:136] = b"%011o\0" % (64 << 20)
    _rechecksum(header)
    indexer = TarIndexer(URL)
    with pytest.raises(NotATarError, match="extended header") as caught:
        indexer.feed(bytes(header))
    assert URL in str(caught.value)


def _regex_split(name: str) -> tuple[str, str] | None:
    """webdataset's base_plus_ext as it is written: the regex alone."""
    m = _BASE_EXT.match(name)
    return None if m is None else (m.group(1), m.group(2).lower())


@pytest.mark.parametrize(
    "name",
    [
        "a.jpg", "dir/a.JPG", "a/b/c.seg.png", "a.b/c.d", "a.b/c", "a/.b", "a/b/.c",
        ".x", ".", "a.", "a..b", "/a.b", "a//b.c", "x\n.y", "a/\nb.c", "a.b\n", "a\n/b.c",
        "ä/ö.ÄBC", "caf\udce9.txt", "", "noext", "dir/", "a.b/",
    ],
)  # fmt: skip
def test_base_plus_ext_gives_the_regex_answer_on_its_corners(name: str) -> None:
    assert base_plus_ext(name) == _regex_split(name)


def test_base_plus_ext_gives_the_regex_answer_on_random_names() -> None:
    # The string methods serve every name without a newline whose base name does not
    # start with a dot; names of these few characters reach every branch of both.
    rng = random.Random(1234)
    alphabet = "ab./\nA_é"
    names = {"".join(rng.choices(alphabet, k=rng.randrange(0, 9))) for _ in range(30_000)}
    assert len(names) > 10_000
    for name in names:
        assert base_plus_ext(name) == _regex_split(name), repr(name)
