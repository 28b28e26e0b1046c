"""The compiled local reader (``cached_client._gather``, D32) against the Python one: the
same batches from the same shard file, and the same failures said the same way.

Real parts: a real tar file on disk, read with ``preadv`` by both readers into real ring
slots, each member checked against XXH3 as the daemon computes it.
"""

from __future__ import annotations

import logging
import os
import random
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from cached_client import local
from cached_client.buffers import Slot
from cached_client.filling import Filling as _Filling
from cached_client.local import LocalFiles, LocalUnavailable
from cached_wire.layouts import PackedRows

from cached_demo.tars import make_tar
from tests.layouts import local_read, packed

RUN_BYTES = 256 << 10  # _gather.c: a run ends once it holds this many bytes


def _shard(tmp_path: Path, seed: int) -> tuple[Path, list[tuple[str, dict[str, bytes]]]]:
    """A tar whose members test every way a run can start and end: uneven sizes (empty,
    a tar block's size and one either side), members larger than a run, members that a
    reader skips larger than the gap one read spans, samples without some extension."""
    rng = random.Random(seed)
    samples = []
    for i in range(60):
        members: dict[str, bytes] = {}
        size = rng.choice([0, 1, 511, 512, 513, rng.randrange(1, 9000), RUN_BYTES + 77])
        members["a"] = rng.randbytes(size)
        if i % 5 != 2:  # some samples have no "c"
            members["c"] = str(i).encode()
        members["skip"] = rng.randbytes(local.MAX_GAP + 1000) if i % 7 == 3 else b"s"
        samples.append((f"k{i:03d}", members))
    path = tmp_path / f"shard-{seed}.tar"
    path.write_bytes(make_tar(samples))
    return path, samples


def _rows(path: Path, exts: set[str]) -> list[Any]:
    """The layout of every sample of ``path``, members in ``exts``, as rows (what the
    daemon packs: tests/layouts.py)."""
    samples: list[Any] = []
    data = path.read_bytes()
    with tarfile.open(path) as tar:
        for info in tar.getmembers():
            key, ext = info.name.split(".", 1)
            if not samples or samples[-1][0] != key:
                samples.append([key, []])
            if ext in exts:
                body = data[info.offset_data : info.offset_data + info.size]
                member = [ext, info.size, info.offset_data, xxhash.xxh3_64_intdigest(body)]
                samples[-1][1].append(member)
    return samples


def _fill(
    path: Path,
    rows: list[Any],
    batch: int,
    compiled: bool,
    monkeypatch: pytest.MonkeyPatch,
    *,
    algorithm: str = "xxh3_64",
) -> list[Any]:
    """Receive the local reply of ``rows`` into batches of ``batch``, as FastLoader does;
    each batch's keys, offsets and bytes per extension."""
    monkeypatch.setattr(local, "GATHER", local.GATHER if compiled else None)
    files = LocalFiles()
    read = local_read(files, path, rows, algorithm=algorithm)

    class _Reply:  # what transport.Reply gives _Filling: the local read
        local = read

        def read_many(self, buffers: Any) -> list[int]:
            return read.read_many(buffers)

    out = []
    done = 0
    while done < len(read.rows):
        filling = _Filling(Slot())
        take = read.rows[done : done + batch]
        # Two calls per batch, as when a batch takes the end of one reply and the start
        # of the next: the second lays out after what the first used.
        half = len(take) // 2
        filling.receive(take[:half], _Reply())  # type: ignore[arg-type]
        filling.receive(take[half:], _Reply())  # type: ignore[arg-type]
        got = filling.batch()
        out.append((got.keys, got.offsets, {e: t.numpy().tobytes() for e, t in got.data.items()}))
        done += len(take)
    files.close()
    monkeypatch.undo()
    return out


def test_the_compiled_reader_is_built_and_checks_as_the_daemon_does() -> None:
    """The install builds it (client/setup.py): without it FastLoader reads in Python."""
    assert local.GATHER is not None, "cached_client._gather was not built"
    data = os.urandom(RUN_BYTES + 12345)
    assert local.GATHER.checksum(data) == xxhash.xxh3_64_intdigest(data)


@pytest.mark.parametrize("batch", [7, 64])
@pytest.mark.parametrize("exts", [{"a", "c"}, {"a", "c", "skip"}, {"c"}], ids=["ac", "all", "c"])
def test_the_compiled_and_the_python_reader_fill_the_same_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch: int, exts: set[str]
) -> None:
    path, samples = _shard(tmp_path, seed=batch)
    rows = _rows(path, exts)
    compiled = _fill(path, rows, batch, True, monkeypatch)
    python = _fill(path, rows, batch, False, monkeypatch)
    assert compiled == python
    # And both are the shard's bytes: each member where the offsets say.
    want = {key: {e: v for e, v in members.items() if e in exts} for key, members in samples}
    seen: dict[str, dict[str, bytes]] = {}
    for keys, offsets, data in compiled:
        for i, key in enumerate(keys):
            seen[key] = {}
            for ext, offs in offsets.items():
                if offs[i + 1] > offs[i] or ext in want[key]:
                    seen[key][ext] = data[ext][offs[i] : offs[i + 1]]
    assert seen == want


def test_an_unknown_checksum_is_read_unchecked_by_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = _shard(tmp_path, seed=3)
    rows = _rows(path, {"a", "c"})
    for sample in rows:
        for member in sample[1]:
            member[3] = 0  # wrong for XXH3: a reader that checked it would fail
    compiled = _fill(path, rows, 16, True, monkeypatch, algorithm="sha1")
    assert compiled == _fill(path, rows, 16, False, monkeypatch, algorithm="sha1")


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_a_rotten_member_and_a_short_file_are_said_with_their_offset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiled: bool
) -> None:
    """What the loader falls back to the socket on (LocalUnavailable, not lasting), said
    alike by both readers: the member that fails, by its byte in the file."""
    path, _ = _shard(tmp_path, seed=5)
    rows = _rows(path, {"a", "c"})
    victim = rows[9][1][0]
    victim[3] ^= 1
    monkeypatch.setattr(local, "GATHER", local.GATHER if compiled else None)
    files = LocalFiles()
    slot = Slot()
    sizes = [m[1] for _k, ms in rows for m in ms]
    view = slot.region("all", 0, sum(sizes))
    at = np.cumsum([0, *sizes])

    def read_all() -> None:
        """Every member of the reply, by the reader under test."""
        read = local_read(files, path, rows)
        payload = read._source()
        if compiled:
            used: dict[str, int] = {}
            exts: list[str] = []
            plan = local.laid_out(read.rows, used, {}, [], exts, checked=True)
            payload.read_planned(plan, [slot.region(x, 0, used[x]) for x in exts])
        else:
            payload.read_many(0, [view[at[i] : at[i + 1]] for i in range(len(sizes))])

    with pytest.raises(
        LocalUnavailable, match=f"member at byte {victim[2]} fails its checksum"
    ) as e:
        read_all()
    assert not e.value.lasting
    victim[3] ^= 1
    # The file is shorter than the reply says (the member's bytes are not all there).
    last = rows[-1][1][0]
    last[2] = path.stat().st_size - last[1] // 2
    with pytest.raises(LocalUnavailable, match="short read at") as e:
        read_all()
    assert not e.value.lasting
    files.close()


def test_a_plan_that_does_not_fit_its_buffers_is_refused(tmp_path: Path) -> None:
    """The compiled reader writes only inside the buffers it is given."""
    assert local.GATHER is not None
    path, _ = _shard(tmp_path, seed=9)
    frame, names = packed(_rows(path, {"a", "c"}))
    used: dict[str, int] = {}
    exts: list[str] = []
    plan = local.laid_out(PackedRows(frame, names, 0, 60), used, {}, [], exts, checked=True)
    small = [bytearray(used[x] - 1) for x in exts]
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match="outside its buffer"):
            local.GATHER.read(fd, plan, small, 0, len(plan) // local.GATHER.PLACE_SIZE)
        with pytest.raises(IndexError, match="outside the plan"):
            local.GATHER.read(fd, plan, small, 1, len(plan) // local.GATHER.PLACE_SIZE)
    finally:
        os.close(fd)


def test_a_packed_layout_that_does_not_hold_together_is_refused(tmp_path: Path) -> None:
    assert local.GATHER is not None
    path, _ = _shard(tmp_path, seed=13)
    frame, exts = packed(_rows(path, {"a", "c"}))
    args = ({}, {}, [], [], True)
    with pytest.raises(ValueError, match="does not hold together"):
        local.GATHER.layout_packed(frame[:-2000], exts, 0, 3, *args)
    with pytest.raises(IndexError, match="outside the packed layout"):
        local.GATHER.layout_packed(frame, exts, 50, 11, *args)
    with pytest.raises(ValueError, match="extension not named"):
        local.GATHER.layout_packed(frame, exts[:1], 0, 60, *args)


def test_a_fast_loader_says_once_that_it_reads_in_python(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the compiled reader is not built, FastLoader says so (once per process) and
    nothing else does: `cached status`, which imports the client, prints JSON alone (its
    output is parsed: deploy/check/systemd.sh found the line in it)."""
    from cached_client import fast

    def missing(name: str) -> Any:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(local, "GATHER", None)
    fast._say_if_not_compiled.cache_clear()
    with caplog.at_level(logging.INFO):
        with monkeypatch.context() as m:  # what importing the client does without it
            m.setattr(local.importlib, "import_module", missing)
            assert local._compiled() is None
        fast.FastLoader(["s3://b/x.tar"], batch_size=4)
        fast.FastLoader(["s3://b/y.tar"], batch_size=4)
    said = [r for r in caplog.records if "compiled local reader is not installed" in r.getMessage()]
    assert len(said) == 1 and said[0].name == "cached_client.fast"
    fast._say_if_not_compiled.cache_clear()
