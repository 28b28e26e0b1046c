"""One specification of the local reader, held by both implementations: the compiled
one (``cached_client._gather``: ``layout_packed``, then ``read``; through
``local.laid_out`` and ``LocalPayload.read_planned``) and the Python one
(``layouts.unpacked`` and ``layouts.check_rows``, ``filling.Filling.receive``'s loop, then
``LocalPayload.read_many``). Issue 21, item 3.

Inputs
    A local reply's layout, one packed frame (docs/protocol.md, "Local reads"): the
    samples in order, each a key and its members ``(ext index, flags, size, offset,
    checksum)``, and the extension names by index. The batch so far: ``used`` (bytes
    used per extension), ``offsets`` and ``keys``. ``checked``: whether the checksums are
    looked at (the daemon names an algorithm the reader knows). The shard file, by
    descriptor.

Layout
    Each member is placed at ``used[ext]`` in its extension's buffer, which then grows by
    its size; ``offsets[ext]`` (``[0] * (n + 1)`` for an extension first met at sample
    ``n``) gets the member's end; a sample lacking an extension repeats that extension's
    last offset; ``keys`` gets the sample's key. Any number of extensions, in one sample
    or across samples (70, 3000), in the order first met. Members of no bytes, repeated
    extensions in one sample and samples of no members are laid out like any other. A
    member's checksum is used where its flag's bit 1 is set.

    Malformed (``ProtocolError``, message starting ``local.MALFORMED``): a frame that
    does not hold together (shorter than its counts, tables or members; first members not
    ascending to the member count; key starts not ascending or past the end), samples
    asked outside it, a member whose extension index is not named, a key that is not
    UTF-8, a size past 2^63 - 1, an extension whose members add up (with ``used``) past
    2^63 - 1 bytes. After such an error the batch being laid out is not used again.

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

The differential tests below feed both readers thousands of random layouts, hostile ones
among them (frames cut or with broken tables too), and require the same bytes or the same
error; another reads 70 member types per sample through FastLoader and a daemon, with
each reader.
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
from cached_client.filling import Filling as _Filling
from cached_client.local import (
    MAX_GAP,
    LocalFiles,
    LocalRead,
    LocalUnavailable,
    laid_out,
    plan_places,
)
from cached_wire.layouts import BYTES_MAX, MALFORMED, PackedRows, check_rows, unpacked
from cached_wire.protocol import PACKED_MEMBER

from cached_demo.tars import make_tar
from tests.daemon import daemon_config, thread_daemon
from tests.layouts import local_reply, no_socket, packed
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


def _broken(rng: random.Random, frame: bytes) -> bytes:
    """``frame`` broken one way a hostile or corrupt reply could break it: cut short, a
    table entry changed (counts, first members, key starts), a member's extension index
    past the names, a key's bytes made invalid UTF-8."""
    buf = bytearray(frame)
    samples, members = struct.unpack_from("<II", buf)
    members_at = 8 + 8 * (samples + 1)
    keys_at = members_at + PACKED_MEMBER.size * members
    how = rng.choice(["cut", "table", "ext", "key"])
    if how == "cut":
        return bytes(buf[: rng.randrange(len(buf))])
    if how == "table" or not members or keys_at == len(buf):
        at = 4 * rng.randrange(2 + 2 * (samples + 1))
        struct.pack_into("<I", buf, at, rng.choice([0, 1, 0xFFFFFFFF, rng.randrange(1 << 32)]))
    elif how == "ext":
        struct.pack_into(
            "<I", buf, members_at + PACKED_MEMBER.size * rng.randrange(members), 1 << 20
        )
    else:
        buf[rng.randrange(keys_at, len(buf))] = 0xFF
    return bytes(buf)


def _local(
    path: Path, rows: list[Any], *, algorithm: str = "xxh3_64", frame: bytes | None = None
) -> LocalRead:
    """The reader's view of a local reply of ``rows`` (or of ``frame``, with their names)."""
    header, made = local_reply(path, rows, algorithm=algorithm)
    return LocalRead(LocalFiles(), header, made if frame is None else frame, no_socket, print)


def _outcome(fn: Any) -> Any:
    """What a reader did: its result, or its error's class and message."""
    try:
        return ("ok", fn())
    except (LocalUnavailable, ProtocolError) as exc:
        lasting = getattr(exc, "lasting", None)
        said = str(exc) if isinstance(exc, LocalUnavailable) else str(exc).split(":")[0]
        return (type(exc).__name__, said, lasting)


def _read_compiled(read: LocalRead, checked: bool) -> Any:
    """Every member's bytes, by the compiled reader (FastLoader's _receive_planned)."""
    used: dict[str, int] = {}
    exts: list[str] = []
    plan = laid_out(read.rows, used, {}, [], exts, checked=checked)
    buffers = [bytearray(used[x]) for x in exts]
    read._source().read_planned(plan, buffers)
    return [bytes(buffers[e][at : at + size]) for e, at, size in plan_places(plan)]


def _read_python(read: LocalRead, checked: bool) -> Any:
    """Every member's bytes, by the Python reader (FastLoader's receive, not planned)."""
    rows = unpacked(read.rows)
    check_rows(rows, {})
    buffers = [bytearray(m[1]) for _k, ms in rows for m in ms]
    sizes = read._source().read_many(0, buffers)
    assert sizes == [len(b) for b in buffers]
    return [bytes(b) for b in buffers]


def _expected(data: bytes, rows: list[Any]) -> list[bytes]:
    return [data[m[2] : m[2] + m[1]] for _k, ms in rows for m in ms]


def test_both_readers_give_the_same_bytes_or_the_same_error(tmp_path: Path) -> None:
    """Thousands of random layouts, most of them hostile (members past the file, offsets
    that wrap, members of no bytes, failing checksums, hundreds of member types, frames
    that do not hold together), each read by both readers: the same bytes, or the same
    error said the same way."""
    _compiled()
    rng = random.Random(21)
    seen: dict[str, int] = defaultdict(int)
    for f in range(8):
        path, data = _file(tmp_path, rng, f"f{f}.bin")
        for _ in range(130):
            hostile = rng.random() < 0.8
            rows = _layout(rng, data, hostile=hostile)
            algorithm = "xxh3_64" if rng.random() < 0.9 else "sha1"
            checked = algorithm == "xxh3_64"
            frame = _broken(rng, packed(rows)[0]) if hostile and rng.random() < 0.1 else None
            outcomes = []
            for reader in (_read_compiled, _read_python):
                read = _local(path, rows, algorithm=algorithm, frame=frame)
                outcomes.append(_outcome(lambda r=read, c=checked, f=reader: f(r, c)))
                read._files.close()
            compiled, python = outcomes
            assert compiled == python, (rows, compiled[:1], python[:1])
            said = str(compiled[1])
            seen[
                "short"
                if "short" in said
                else "checksum"
                if "checksum" in said
                else "malformed"
                if said == MALFORMED
                else compiled[0]
            ] += 1
            if compiled[0] == "ok" and frame is None:
                assert compiled[1] == _expected(data, rows)
            if not hostile:
                assert compiled[0] == "ok"
    # Each outcome was met often enough to mean something.
    assert seen["ok"] > 200 and seen["short"] > 200 and seen["checksum"] > 50, seen
    assert seen["malformed"] > 40, seen


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
    for name, rows in cases.items():
        compiled = _outcome(lambda: _read_compiled(_local(path, rows), True))  # noqa: B023
        python = _outcome(lambda: _read_python(_local(path, rows), True))  # noqa: B023
        assert compiled == python, name
        what, _, at = name.partition("@")
        if what.startswith("ok"):
            assert compiled == ("ok", _expected(data, rows)), name
        elif what == "short":
            assert compiled == ("LocalUnavailable", f"{path}: short read at {at}", False)
        else:
            want = f"{path}: the member at byte {at} fails its checksum"
            assert compiled == ("LocalUnavailable", want, False)


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


def _lay_out(batches: list[PackedRows], compiled: bool, checked: bool) -> Any:
    """FastLoader's layout of ``batches`` (one reply's layout each, into one batch): used,
    offsets, keys and each member's (ext, place, size), by one reader."""
    places = _Places()
    filling = _Filling(places)  # type: ignore[arg-type]
    got: list[tuple[str, int, int]] = []

    class _Local:
        def __init__(self, rows: PackedRows) -> None:
            self.rows = rows

        def samples(self) -> list[Any]:
            return unpacked(self.rows)

        def plannable(self) -> bool:
            return compiled

        def checked(self) -> bool:
            return checked

        def read_planned(self, plan: bytes, buffers: list[range]) -> None:
            for e, at, size in plan_places(plan):
                got.append((places.where(buffers[e])[0], at, size))

    class _Reply:
        def __init__(self, rows: PackedRows) -> None:
            self.local = _Local(rows)

        def read_many(self, views: list[range]) -> list[int]:
            got.extend(places.where(v) for v in views)
            return [v.stop - v.start for v in views]

    for rows in batches:
        filling.receive(rows, _Reply(rows))  # type: ignore[arg-type]
    return filling.used, filling.offsets, filling.keys, got


def _hostile_rows(rng: random.Random) -> PackedRows:
    """A layout whose sizes are any 64-bit value (no file is read), with many extensions;
    now and then a size past 2^63 - 1 or a frame that does not hold together."""
    n_ext = rng.choice([1, 4, 70, 3000])
    rows: list[Any] = []
    for s in range(rng.randrange(1, 40)):
        members: list[Any] = []
        for _ in range(rng.choice([0, 1, 3, 70, 100])):
            size = rng.choice([0, 1, 100, rng.randrange(1 << 40)])
            if rng.random() < 0.002:
                size = rng.choice([rng.randrange(1 << 62), BYTES_MAX])
            checksum = rng.choice([None, rng.randrange(U64)])
            members.append([f"x{rng.randrange(n_ext)}", size, rng.randrange(U64), checksum])
        rows.append([f"s{s}", members])
    if rng.random() < 0.2 and any(ms for _k, ms in rows):
        member = rng.choice([m for _k, ms in rows for m in ms])
        member[1] = rng.choice([BYTES_MAX + 1, U64 - 1, 1 << 63])
    frame, names = packed(rows)
    if rng.random() < 0.2:
        frame = _broken(rng, frame)
    # Now and then samples asked past the frame's end (the header's count says more).
    count = len(rows) + (rng.random() < 0.03)
    return PackedRows(frame, names, 0, count)


def test_both_readers_lay_out_alike_any_number_of_extensions() -> None:
    """The layout alone, for sizes up to 2^63 - 1, up to 3000 extensions per reply and
    some malformed frames and sizes: the same places, used, offsets and keys, or both
    refuse the layout as malformed."""
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
    _compiled()
    for n in (64, 65, 70, 3000):
        rows = [[f"k{s}", [[f"t{i:04d}", i % 5, 7 * i, None] for i in range(n)]] for s in range(3)]
        frame, names = packed(rows)
        layout = PackedRows(frame, names, 0, 3)
        assert _lay_out([layout], True, True) == _lay_out([layout], False, True)
        exts: list[str] = []
        used: dict[str, int] = {}
        laid_out(layout, used, {}, [], exts, checked=True)
        assert exts == [f"t{i:04d}" for i in range(n)]
        assert used == {f"t{i:04d}": 3 * (i % 5) for i in range(n)}


def test_the_python_reader_unpacks_what_the_daemon_packed() -> None:
    """The daemon's packed layout (cached/layouts.py) decoded by the Python reader gives
    back its samples, members and checksums, any part of it, for up to 3000 extensions."""
    rng = random.Random(34)
    for _ in range(150):
        n_ext = rng.choice([1, 70, 3000])
        rows = [
            [
                f"k{s}-é",
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
        frame, names = packed(rows)
        first = rng.randrange(len(rows))
        take = rng.randrange(len(rows) - first + 1)
        whole = PackedRows(frame, names, 0, len(rows))
        assert unpacked(whole) == rows
        assert unpacked(whole[first : first + take]) == rows[first : first + take]


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
