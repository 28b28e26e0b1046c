"""One specification of FastLoader's local reader, held by both implementations: the
compiled one (``cached_client._gather``: ``layout``/``layout_packed``, then ``read``;
through ``local.laid_out`` and ``LocalPayload.read_planned``) and the Python one
(``fast._Filling.receive``'s loop after ``local.check_rows``, then
``LocalPayload.read_many``). Issue 21, item 3.

Inputs
    A local reply's layout: samples ``[key, members]`` in order, each member
    ``[ext, size, offset, checksum]`` (JSON), or the same as one packed frame
    (docs/protocol.md, "Packed layouts"; the compiled reader only). The batch so far:
    ``used`` (bytes used per extension), ``offsets`` and ``keys``. ``checked``: whether
    the checksums are looked at (the daemon names an algorithm the reader knows). The
    shard file, by descriptor.

Layout
    Each member is placed at ``used[ext]`` in its extension's buffer, which then grows by
    its size; ``offsets[ext]`` (``[0] * (n + 1)`` for an extension first met at sample
    ``n``) gets the member's end; a sample lacking an extension repeats that extension's
    last offset; ``keys`` gets the sample's key. Any number of extensions, in one sample
    or across samples (70, 3000), in the order first met. Members of no bytes, repeated
    extensions in one sample and samples of no members are laid out like any other.

    Malformed (``ProtocolError``, message starting ``local.MALFORMED``): a sample that is
    not a list ``[key, members]``; a member that is not a list of at least two fields with
    a string extension; a size that is not an integer in [0, 2^63 - 1]; an offset that is
    absent, None, or not an integer in [0, 2^64); where checked, a checksum that is neither
    None nor an integer in [0, 2^64); an extension whose members add up (with ``used``)
    past 2^63 - 1 bytes; for a packed frame, one that does not hold together (tables past
    its end, first members not ascending to the member count, keys not ascending or past
    the end or not UTF-8, an extension index not named). After such an error the batch
    being laid out is not used again.

Read
    Every member's ``size`` bytes from the file at ``offset`` land at its place. The
    members are taken in order; the first that fails is said, by its offset in the file,
    as ``LocalUnavailable`` (not lasting: the read goes through the socket):

    * ``"<path>: short read at <offset>"``: its bytes are not all in the file
      (``offset + size`` past the file's end; a member that would end past 2^63 - 1, the
      largest file offset, including offsets whose sum with the size wraps 64 bits). A
      member of no bytes is never short, wherever its offset.
    * ``"<path>: the member at byte <offset> fails its checksum"``: where checked and
      given, its bytes' XXH3-64 is not the checksum (a member of no bytes included).

    A failed read (EIO, ...) is ``LocalUnavailable`` "reading it failed". Members before
    the failing one are read and checked; what the buffers hold after a failure is not
    specified. How members are grouped into system calls (runs, gaps, IOV_MAX, the
    compiled reader's 256 KB runs) never changes the result.

The differential test below feeds both readers thousands of random layouts, hostile ones
among them, and requires the same bytes or the same error; another reads 70 member types
per sample through FastLoader and a daemon, with each reader.
"""

from __future__ import annotations

import os
import random
import struct
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import xxhash
from cached_client import FastLoader
from cached_client import local as local_module
from cached_client.errors import ProtocolError
from cached_client.fast import _Filling
from cached_client.local import (
    BYTES_MAX,
    MALFORMED,
    MAX_GAP,
    LocalFiles,
    LocalUnavailable,
    PackedRows,
    check_rows,
    laid_out,
    plan_places,
)
from cached_client.protocol import PACKED_MEMBER

from cached.demo.tars import make_tar
from tests.daemon import daemon_config, thread_daemon
from tests.s3server import S3Server
from tests.test_daemon import upload

GATHER = local_module.GATHER
U64 = 1 << 64
RUN_BYTES = 256 << 10  # _gather.c


def _compiled() -> Any:
    if GATHER is None:
        pytest.fail("cached_client._gather is not built: there is nothing to compare with")
    return GATHER


# -- random layouts -------------------------------------------------------------------------


def _offset(rng: random.Random, size: int, flen: int, last: int) -> int:
    """Where a member is: mostly just after the last (runs), else anywhere, past the end,
    or where offset + size wraps or passes the largest file offset."""
    roll = rng.random()
    if roll < 0.55:
        return last + rng.choice([0, 0, 1, 512, rng.randrange(MAX_GAP + 2)])
    if roll < 0.75:
        return rng.randrange(max(1, flen))
    if roll < 0.85:
        return max(0, flen - rng.randrange(0, size + 2) + rng.choice([0, 0, 1, 4096]))
    return rng.choice(
        [
            U64 - 1 - rng.randrange(size + 1),  # offset + size wraps 64 bits
            U64 - 1,
            BYTES_MAX - size + rng.choice([0, 1, 2]),  # ends at or just past off_t's end
            1 << 63,
            BYTES_MAX,
        ]
    )


def _layout(rng: random.Random, data: bytes, *, hostile: bool) -> list[list[Any]]:
    """Random JSON rows of a local reply over the file ``data``."""
    flen = len(data)
    n_ext = rng.choice([1, 2, 5, 70, 300] if hostile else [1, 3, 70])
    names = [f"e{i}.{rng.randrange(100)}" for i in range(n_ext)]
    rows: list[list[Any]] = []
    last = rng.randrange(2048)
    budget = rng.randrange(1, 400)
    while budget > 0:
        members: list[list[Any]] = []
        for _ in range(rng.choice([0, 1, 1, 2, 3, 8, 70])):
            budget -= 1
            size = rng.choice([0, 0, 1, 7, 512, 513, rng.randrange(20000)])
            if rng.random() < 0.01:
                size = rng.randrange(RUN_BYTES, 2 * RUN_BYTES)
            offset = _offset(rng, size, flen, last) if hostile else last + rng.randrange(600)
            if not hostile:
                offset = min(offset, max(0, flen - size))
                size = min(size, flen - offset)
            body = data[offset : offset + size] if offset + size <= flen else b"?"
            checksum: int | None = xxhash.xxh3_64_intdigest(body)
            if hostile and rng.random() < 0.05:
                checksum ^= 1 << rng.randrange(64)
            if rng.random() < 0.05:
                checksum = None
            members.append([rng.choice(names), size, offset, checksum])
            if offset < len(data) + MAX_GAP:
                last = offset + size
        rows.append([f"k{len(rows)}", members])
    return rows


def _file(tmp_path: Path, rng: random.Random, name: str) -> tuple[Path, bytes]:
    data = rng.randbytes(rng.choice([0, 1, 5000, 300_000, 700_000]))
    path = tmp_path / name
    path.write_bytes(data)
    return path, data


def _reply(path: Path, rows: list[Any], *, algorithm: str = "xxh3_64") -> dict[str, Any]:
    st = path.stat()
    where = {"path": str(path), "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return {"ok": True, "samples": rows, "local": {**where, "algorithm": algorithm}}


def _outcome(fn: Any) -> Any:
    """What a reader did: its result, or its error's class and message."""
    try:
        return ("ok", fn())
    except (LocalUnavailable, ProtocolError) as exc:
        lasting = getattr(exc, "lasting", None)
        said = str(exc) if isinstance(exc, LocalUnavailable) else str(exc).split(":")[0]
        return (type(exc).__name__, said, lasting)


def _read_compiled(files: LocalFiles, reply: dict[str, Any], checked: bool) -> Any:
    """Every member's bytes, by the compiled reader (FastLoader's _receive_planned)."""
    payload = files.payload(reply)
    used: dict[str, int] = {}
    exts: list[str] = []
    plan = laid_out(reply["samples"], used, {}, [], exts, checked=checked)
    buffers = [bytearray(used[x]) for x in exts]
    payload.read_planned(plan, buffers)
    return [bytes(buffers[e][at : at + size]) for e, at, size in plan_places(plan)]


def _read_python(files: LocalFiles, reply: dict[str, Any], checked: bool) -> Any:
    """Every member's bytes, by the Python reader (FastLoader's receive, not planned)."""
    payload = files.payload(reply)
    check_rows(reply["samples"], {}, checked=checked)
    buffers = [bytearray(m[1]) for _k, ms in reply["samples"] for m in ms]
    sizes = payload.read_many(0, buffers)
    assert sizes == [len(b) for b in buffers]
    return [bytes(b) for b in buffers]


def _expected(data: bytes, rows: list[Any]) -> list[bytes]:
    return [data[m[2] : m[2] + m[1]] for _k, ms in rows for m in ms]


def test_both_readers_give_the_same_bytes_or_the_same_error(tmp_path: Path) -> None:
    """Thousands of random layouts, most of them hostile (members past the file, offsets
    that wrap, members of no bytes, failing checksums, hundreds of member types), each
    read by both readers: the same bytes, or the same error said the same way."""
    _compiled()
    rng = random.Random(21)
    files = LocalFiles()
    seen: dict[str, int] = defaultdict(int)
    try:
        for f in range(8):
            path, data = _file(tmp_path, rng, f"f{f}.bin")
            for _ in range(130):
                hostile = rng.random() < 0.8
                rows = _layout(rng, data, hostile=hostile)
                algorithm = "xxh3_64" if rng.random() < 0.9 else "sha1"
                reply = _reply(path, rows, algorithm=algorithm)
                checked = algorithm == "xxh3_64"
                compiled = _outcome(lambda r=reply, c=checked: _read_compiled(files, r, c))
                python = _outcome(lambda r=reply, c=checked: _read_python(files, r, c))
                assert compiled == python, (rows, compiled[:1], python[:1])
                said = str(compiled[1])
                seen[
                    "short"
                    if "short" in said
                    else "checksum"
                    if "checksum" in said
                    else compiled[0]
                ] += 1
                if compiled[0] == "ok":
                    assert compiled[1] == _expected(data, rows)
                if not hostile:
                    assert compiled[0] == "ok"
    finally:
        files.close()
    # Each outcome was met often enough to mean something.
    assert seen["ok"] > 200 and seen["short"] > 200 and seen["checksum"] > 50, seen


def test_the_first_failing_member_is_said_whatever_the_runs(tmp_path: Path) -> None:
    """A failed checksum before a short member, in one run or in two, and members of no
    bytes past the end or at offsets that wrap: said alike, by the member that fails."""
    _compiled()
    data = os.urandom(100_000)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    good = xxhash.xxh3_64_intdigest
    cases = {
        # A rotten member, then one past the end in the same run: the rotten one.
        "checksum@100": [["k", [["a", 10, 100, 1], ["a", 50, 99_990, good(data[99_990:])]]]],
        # A member past the end, then a rotten one: the short one, by its own offset.
        "short@99990": [["k", [["a", 50, 99_990, 0], ["b", 10, 100, 1]]]],
        # Members of no bytes anywhere (past the end, wrapping, off_t's end) are read.
        "ok-empty": [
            [
                "k",
                [["a", 0, 200_000, good(b"")], ["b", 0, U64 - 1, None], ["a", 0, BYTES_MAX, None]],
            ]
        ],
        # ... and checked.
        "checksum@200000": [["k", [["a", 0, 200_000, 5]]]],
        # offset + size wraps 64 bits: short, not a write before the buffer.
        "short@18446744073709551615": [
            ["k", [["a", 10, 10, good(data[10:20])], ["a", 2, U64 - 1, 0]]]
        ],
        # A gap past the end before an empty member does not fail it.
        "ok-gap": [
            ["k", [["a", 10, 99_980, good(data[99_980:99_990])], ["b", 0, 99_999 + 9000, None]]]
        ],
    }
    files = LocalFiles()
    try:
        for name, rows in cases.items():
            reply = _reply(path, rows)
            compiled = _outcome(lambda: _read_compiled(files, reply, True))  # noqa: B023
            python = _outcome(lambda: _read_python(files, reply, True))  # noqa: B023
            assert compiled == python, name
            what, _, at = name.partition("@")
            if what.startswith("ok"):
                assert compiled == ("ok", _expected(data, rows)), name
            elif what == "short":
                assert compiled == ("LocalUnavailable", f"{path}: short read at {at}", False)
            else:
                want = f"{path}: the member at byte {at} fails its checksum"
                assert compiled == ("LocalUnavailable", want, False)
    finally:
        files.close()


# -- the layout, without a file ----------------------------------------------------------------


class _Places:
    """A slot whose buffers are ranges: no memory, any size; a view says where it is."""

    SPAN = 1 << 70

    def __init__(self) -> None:
        self.names: list[str] = []
        self.views: dict[str, range] = _RangeViews(self)

    def region(self, ext: str, at: int, size: int) -> range:
        return self.views[ext][at : at + size]

    def where(self, view: range) -> tuple[str, int, int]:
        return self.names[view.start // self.SPAN], view.start % self.SPAN, view.stop - view.start


class _RangeViews(dict):  # type: ignore[type-arg]
    def __init__(self, places: _Places) -> None:
        super().__init__()
        self.places = places

    def __missing__(self, ext: str) -> range:
        base = len(self.places.names) * _Places.SPAN
        self.places.names.append(ext)
        view = self[ext] = range(base, base + _Places.SPAN)
        return view


def _lay_out(batches: list[list[Any]], compiled: bool, checked: bool) -> Any:
    """FastLoader's layout of ``batches`` (one receive each, into one batch): used,
    offsets, keys and each member's (ext, place, size), by one reader."""
    places = _Places()
    filling = _Filling(places)  # type: ignore[arg-type]
    got: list[tuple[str, int, int]] = []

    class _Local:
        def plannable(self) -> bool:
            return compiled

        def checked(self) -> bool:
            return checked

        def read_planned(self, plan: bytes, buffers: list[range]) -> None:
            for e, at, size in plan_places(plan):
                got.append((places.where(buffers[e])[0], at, size))

    class _Reply:
        local = _Local()

        def read_many(self, views: list[range]) -> list[int]:
            got.extend(places.where(v) for v in views)
            return [v.stop - v.start for v in views]

    for rows in batches:
        filling.receive(rows, _Reply())  # type: ignore[arg-type]
    return filling.used, filling.offsets, filling.keys, got


def _hostile_rows(rng: random.Random) -> list[Any]:
    """Rows whose sizes are any 64-bit value (no file is read), many extensions, and now
    and then one field that breaks the specification."""
    n_ext = rng.choice([1, 4, 70, 3000])
    rows: list[Any] = []
    for s in range(rng.randrange(1, 40)):
        members: list[Any] = []
        for _ in range(rng.choice([0, 1, 3, 70, 100])):
            size = rng.choice([0, 1, 100, rng.randrange(1 << 40)])
            if rng.random() < 0.002:
                size = rng.choice([rng.randrange(1 << 62), BYTES_MAX])
            members.append(
                [f"x{rng.randrange(n_ext)}", size, rng.randrange(U64), rng.randrange(U64)]
            )
        rows.append([f"s{s}", members])
    if rng.random() < 0.4 and any(ms for _k, ms in rows):
        member = rng.choice([m for _k, ms in rows for m in ms])
        field, bad = rng.choice(
            [
                (1, -1),
                (1, BYTES_MAX + 1),
                (1, U64),
                (1, 1.5),
                (1, "7"),
                (2, -1),
                (2, U64),
                (2, "0"),
                (3, -1),
                (3, U64),
                (3, 2.0),
                (0, 5),
                (0, None),
            ]
        )
        member[field] = bad
    if rng.random() < 0.03:
        rows.append(["k", "not members"])
    return rows


def test_both_readers_lay_out_alike_any_number_of_extensions(tmp_path: Path) -> None:
    """The layout alone, for sizes up to 2^63 - 1, up to 3000 extensions per reply and
    some malformed fields: the same places, used, offsets and keys, or both refuse the
    layout as malformed."""
    _compiled()
    rng = random.Random(3)
    outcomes: dict[str, int] = defaultdict(int)
    for _ in range(250):
        batches = [_hostile_rows(rng) for _ in range(rng.choice([1, 2, 3]))]
        checked = rng.random() < 0.8
        compiled = _outcome(lambda: _lay_out(batches, True, checked))  # noqa: B023
        python = _outcome(lambda: _lay_out(batches, False, checked))  # noqa: B023
        assert compiled == python
        outcomes[compiled[0] if compiled[0] == "ok" else compiled[1]] += 1
    assert outcomes["ok"] > 30 and outcomes[MALFORMED] > 30, outcomes


def test_70_and_3000_member_types_in_one_sample() -> None:
    """More extensions than the compiled reader once took (64): laid out by both."""
    gather = _compiled()
    for n in (64, 65, 70, 3000):
        rows = [[f"k{s}", [[f"t{i:04d}", i % 5, 7 * i, None] for i in range(n)]] for s in range(3)]
        assert _lay_out([rows], True, True) == _lay_out([rows], False, True)
        exts: list[str] = []
        used: dict[str, int] = {}
        gather.layout(rows, used, {}, [], exts, True)
        assert exts == [f"t{i:04d}" for i in range(n)]
        assert used == {f"t{i:04d}": 3 * (i % 5) for i in range(n)}


def _pack(rows: list[Any]) -> tuple[bytes, list[str]]:
    """The daemon's packed layout of JSON ``rows`` (cached/server.py ``_packed_layout``)."""
    exts: dict[str, int] = {}
    first, key_start, records, keys = [0], [0], [], bytearray()
    for key, members in rows:
        for ext, size, offset, checksum in members:
            e = exts.setdefault(ext, len(exts))
            records.append(
                PACKED_MEMBER.pack(e, int(checksum is not None), size, offset, checksum or 0)
            )
        first.append(first[-1] + len(members))
        keys += key.encode()
        key_start.append(len(keys))
    count = len(first) - 1
    tables = struct.pack(f"<II{count + 1}I{count + 1}I", count, first[-1], *first, *key_start)
    return b"".join((tables, *records, bytes(keys))), list(exts)


def test_a_packed_layout_is_its_json_with_any_number_of_extensions() -> None:
    """The compiled reader's packed layouts (its own input: the Python reader takes the
    JSON) give the plan, used, offsets and keys of their JSON, for up to 3000
    extensions; a frame cut short or with a bad extension index is malformed."""
    _compiled()
    rng = random.Random(34)
    for _ in range(150):
        n_ext = rng.choice([1, 70, 3000])
        rows = [
            [
                f"k{s}",
                [
                    [
                        f"e{rng.randrange(n_ext)}",
                        rng.randrange(1 << 40),
                        rng.randrange(U64),
                        rng.choice([None, rng.randrange(U64)]),
                    ]
                    for _ in range(rng.choice([0, 1, 70]))
                ],
            ]
            for s in range(rng.randrange(1, 30))
        ]
        frame, names = _pack(rows)
        count = len(rows)
        first = rng.randrange(count)
        take = rng.randrange(count - first + 1)
        a: tuple[dict[str, int], dict[str, list[int]], list[str], list[str]] = ({}, {}, [], [])
        b: tuple[dict[str, int], dict[str, list[int]], list[str], list[str]] = ({}, {}, [], [])
        packed = laid_out(PackedRows(frame, names, first, take), *a, checked=True)
        json = laid_out(rows[first : first + take], *b, checked=True)
        assert (packed, a) == (json, b)
        # Any cut: the tables or the records, or the keys (never empty here), end early.
        cut = bytes(frame[: rng.randrange(len(frame))])
        with pytest.raises(ProtocolError, match=MALFORMED):
            laid_out(PackedRows(cut, names, 0, count), {}, {}, [], [], checked=True)
        if names and any(ms for _k, ms in rows):
            with pytest.raises(ProtocolError, match=MALFORMED):
                laid_out(
                    PackedRows(frame, names[:-1] or [], 0, count), {}, {}, [], [], checked=True
                )


# -- end to end --------------------------------------------------------------------------------


@pytest.mark.parametrize("reader", ["compiled", "python"])
def test_fast_loader_reads_70_member_types_per_sample(
    s3_server: S3Server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reader: str
) -> None:
    """Issue 21: more than 64 member types crashed FastLoader (the compiled reader
    refused them). 70 per sample, every one read from the files by each reader."""
    if reader == "python":
        monkeypatch.setattr(local_module, "GATHER", None)
    else:
        _compiled()
    rng = random.Random(70)
    exts = [f"m{i:02d}.bin" for i in range(70)]
    want: dict[str, dict[str, bytes]] = {}
    shards = []
    for s in range(2):
        samples = []
        for i in range(12):
            key = f"s{s}-{i:03d}"
            members = {ext: rng.randbytes(rng.choice([0, 1, 100, 3000])) for ext in exts}
            samples.append((key, members))
            want[key] = members
        shards.append(make_tar(samples))
    urls = upload(s3_server, bucket, shards)
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        loader = FastLoader(urls, socket=d.socket, batch_size=5, local_reads=True)
        seen: dict[str, dict[str, bytes]] = {}
        for batch in loader:
            assert set(batch.data) == set(exts)
            for i, key in enumerate(batch.keys):
                seen[key] = {
                    ext: batch.data[ext].numpy()[offs[i] : offs[i + 1]].tobytes()
                    for ext, offs in batch.offsets.items()
                }
        served, local = d.served()
    assert seen == want
    assert served == local > 0  # every byte from the files


def test_a_place_whose_end_wraps_is_outside_its_buffer(tmp_path: Path) -> None:
    """The compiled read's bounds check cannot wrap: at + size past 2^64 is refused
    (ValueError, before any byte is written), not taken for a small end."""
    gather = _compiled()
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(4096))
    place = struct.Struct("=IIQQQQ")
    fd = os.open(path, os.O_RDONLY)
    try:
        for at, size in [(U64 - 1, 2), (U64 - 16, 32), (1, U64 - 1), (0, 17)]:
            plan = place.pack(0, 1, at, size, 0, 0)
            with pytest.raises(ValueError, match="outside its buffer"):
                gather.read(fd, plan, [bytearray(16)], 0, 1)
        assert gather.read(fd, place.pack(0, 1, 4, 12, 0, 0), [bytearray(16)], 0, 1) is None
    finally:
        os.close(fd)
