"""The disk as it is, and a disk that fails: a hot tier on a file system smaller than its
``[cache] capacity``, filled and freed by another program, full in the middle of a write;
shard files cut short under their readers, and reads that fail with EIO.

Real parts: a real small file system (a tmpfs of a few MiB, mounted for the test; root
only), the moto S3 server, the fault proxy, a real daemon and real ZeroMQ. EIO itself has
no real source here (no device-mapper in this kernel, no libfuse): the daemon's file cut
short is real (a short read, and SIGBUS under the mmap this replaced); the reader's EIO is
injected at its read call.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import cached_client.local as local_module
import pytest
from cached_client import CachedDataset
from cached_client.transport import Connection

from cached import cli
from cached.hot.tier import reservation_bytes
from tests.daemon import ProcessDaemon, daemon_config, dataset_shards, serve_config, thread_daemon
from tests.faultproxy import FaultProxy
from tests.s3server import S3Server
from tests.test_daemon import upload
from tests.test_local_reads import _bins, expected

MiB = 1 << 20
FILL_CHUNK = 64 << 10  # what fill() writes at a time: the free space it may leave


@contextmanager
def small_disk(path: Path, size_mib: int) -> Iterator[Path]:
    """A real file system of ``size_mib`` MiB at ``path`` (a tmpfs), unmounted afterwards."""
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(
            f"cannot mount a small file system here (mount -t tmpfs needs root): "
            f"{done.stderr.strip() or done.returncode}"
        )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> int:
    """Write ``path`` until its file system is full, as another program would; its size."""
    chunk = bytes(FILL_CHUNK)
    n = 0
    with open(path, "wb", buffering=0) as fh:
        while True:
            try:
                n += fh.write(chunk) or 0
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                return n


def keys_and_bins(urls: list[str], socket: str, **kw: Any) -> dict[str, bytes]:
    return {s["__key__"]: s["bin"] for s in CachedDataset(urls, socket=socket, **kw)}


def effective(d: Any) -> tuple[int, int, float]:
    """The capacity and the effective capacity in the daemon's status, and the effective
    capacity's metric once the daemon refreshed it (every second). Read once no shard is
    being fetched: a prefetch still under way after a read holds disk its shard's bytes
    will take (about a shard less)."""
    gauge = d.daemon.metrics.hot_capacity_effective_bytes
    deadline = time.monotonic() + 10
    d.call(d.daemon.hot.check)
    while d.call(lambda: d.daemon.hot.stats().fetching) and time.monotonic() < deadline:
        time.sleep(0.05)
    deadline = time.monotonic() + 5
    while True:
        d.call(d.daemon.hot.look_at_disk)  # the status may be a second old
        hot = d.call(d.daemon.status)["hot"]
        metric = gauge._value.get()
        if metric == hot["capacity_effective_bytes"] or time.monotonic() > deadline:
            return hot["capacity_bytes"], hot["capacity_effective_bytes"], metric
        time.sleep(0.1)


def test_a_dataset_larger_than_the_disk_is_read_whole_and_status_shows_the_disk(
    s3_server: S3Server, bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """[cache] capacity 1 GiB on a 16 MiB disk, 24 MiB of shards (1 MiB each: a reader may
    pin half the bound, [server] max_pinned_share_per_user): every sample is read in
    each of two epochs, the tier evicting to fit the disk (never "no room"), and the
    bound it keeps (the effective capacity) is in the status, the metric and ``cached
    status``."""
    shards = dataset_shards(24, 10, payload=100_000)
    urls, want = upload(s3_server, bucket, shards), expected(shards, 10, 100_000)
    with small_disk(tmp_path / "disk", 16) as disk:
        cfg = daemon_config(
            tmp_path, s3_server.endpoint_url, **{"cache.dir": str(disk), "cache.min_free": "1MiB"}
        )
        with thread_daemon(cfg) as d:
            for _epoch in range(2):
                assert keys_and_bins(urls, d.socket, shuffle=False) == want
            capacity, bound, metric = effective(d)
            d.call(d.daemon.hot.check)
            used = d.call(d.daemon.hot.stats).used_bytes
            cli._status(d.socket, as_json=False)
    assert capacity == 1 << 30
    assert 12 * MiB < bound <= 15 * MiB and metric <= 15 * MiB
    assert used <= bound
    assert "the disk has room for" in capsys.readouterr().out


def test_a_disk_filled_by_another_program_and_freed_needs_no_restart(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """Another program fills the disk after the first epoch: the next epoch is read whole
    (the tier evicts to what the disk has), and once that program frees its file the
    bound comes back and the epoch after reads whole too."""
    shards = dataset_shards(10, 20, payload=100_000)
    urls, want = upload(s3_server, bucket, shards), expected(shards, 20, 100_000)
    with small_disk(tmp_path / "disk", 16) as disk:
        cfg = daemon_config(tmp_path, s3_server.endpoint_url, **{"cache.dir": str(disk)})
        with thread_daemon(cfg) as d:
            assert keys_and_bins(urls, d.socket) == want
            _, before, _ = effective(d)
            filler = disk / "other-program"
            fill(filler)
            _, full, _ = effective(d)
            assert full < before
            assert keys_and_bins(urls, d.socket) == want  # evicts to what the disk has
            filler.unlink()
            _, after, metric = effective(d)
            # As before, give or take the blocks of the tier's files that changed since.
            assert abs(after - before) < 64 << 10 and metric == after
            assert keys_and_bins(urls, d.socket) == want
            assert d.call(d.daemon.status)["counters"]["corrupt_shards"] == 0


@pytest.mark.parametrize("native", [False, True], ids=["botocore", "native"])
def test_a_disk_that_fills_mid_write_drops_the_partial_file_evicts_and_fetches_again(
    *,
    s3_server: S3Server,
    bucket: str,
    tmp_path: Path,
    proxy: FaultProxy,
    caplog: pytest.LogCaptureFixture,
    native: bool,
) -> None:
    """The disk fills up (another program) while a shard streams in: the write fails with
    ENOSPC, the partial file is removed, the tier evicts and the shard is fetched again
    with a new GET; the reader gets its bytes, and nothing partial is left. On the native
    path the CRT's write fails so (D42)."""
    shards = dataset_shards(4, 30, payload=100_000)  # 3 MiB each
    urls, want = upload(s3_server, bucket, shards), expected(shards, 30, 100_000)
    with small_disk(tmp_path / "disk", 16) as disk:
        # Native: parts of 512 KiB, so that the CRT's writes of the later parts meet the
        # full disk (it gives the headers once the first part is in).
        native_cfg = {"s3.native_fetch": True, "s3.part_size": "512KiB"} if native else {}
        cfg = daemon_config(tmp_path, proxy.endpoint_url, **{"cache.dir": str(disk), **native_cfg})
        with thread_daemon(cfg) as d:
            assert keys_and_bins(urls[:3], d.socket) == {
                k: v for k, v in want.items() if not k.startswith("s0003-")
            }
            # The last one takes 6 s to arrive: the watcher below fills the disk mid-write
            # even when it gets its turn late (a long test session holds many threads).
            proxy.rate_bps = MiB // 2

            filled = threading.Event()

            def fill_once_it_writes() -> None:
                # The partial file is there once the room is reserved, before the body
                # comes (6 s): the disk fills between the tier's look and its write.
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    if any(disk.glob("*.tar.partial")):
                        fill(disk / "other-program")
                        filled.set()
                        return
                    time.sleep(0.002)

            watcher = threading.Thread(target=fill_once_it_writes, daemon=True)
            watcher.start()
            with caplog.at_level(logging.WARNING, logger="cached.fetcher"):
                got = keys_and_bins(urls[3:], d.socket)
            watcher.join()
            fetches = d.daemon.metrics.fetches
            disk_full = fetches.labels("warm", "disk_full")._value.get()
            gets = [
                r
                for r in proxy.requests("GET")
                if r.path.endswith("shard-0003.tar")
                and (r.range or "bytes=0-").startswith("bytes=0-")
            ]  # whole GETs (the CRT's first parts)
            # The prefetcher may be fetching a shard evicted to make room: its partial file
            # is its own, and goes when it is published.
            deadline = time.monotonic() + 10
            d.call(d.daemon.hot.check)
            while d.call(lambda: d.daemon.hot.stats().fetching) and time.monotonic() < deadline:
                time.sleep(0.05)
            left = sorted(p.name for p in disk.iterdir() if p.name.endswith(".partial"))
    assert filled.is_set()
    assert got == {k: v for k, v in want.items() if k.startswith("s0003-")}
    assert disk_full == 1
    assert len(gets) == 2
    assert left == []
    (full,) = [r for r in caplog.records if "was full while" in r.getMessage()]
    # The tier evicts so that the shard fits twice over (the second for what its accounting
    # did not see); the free space it counts on besides is what the partial file held (at
    # most the shard) and what the filler left (less than a chunk, and a page's rounding).
    # Evicting half as much leaves room for the shard once: here one shard, not two.
    assert isinstance(full.args, tuple)
    evicted, size = full.args[-1], len(shards[3])
    assert isinstance(evicted, int)
    assert evicted >= 2 * reservation_bytes(size) - size - 2 * FILL_CHUNK


def test_a_shard_file_cut_short_under_its_reader_is_fetched_again_and_the_daemon_lives(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """The hot tier's file of a shard being read loses its second half (under mmap, a
    SIGBUS that killed the daemon): the daemon's read comes back short, it drops the shard
    and fetches it again, and the reader, through the socket, gets the right bytes."""
    shards = dataset_shards(1, 20, payload=100_000)
    urls, want = upload(s3_server, bucket, shards), expected(shards, 20, 100_000)
    config, socket = serve_config(tmp_path, s3_server.endpoint_url)
    with ProcessDaemon(config, socket) as daemon:
        conn = Connection(socket, local_reads=False)
        read = {"op": "read", "url": urls[0], "stream": "t", "count": 10}
        _, first = conn.request({**read, "start": 0})  # the daemon has the file open
        (path,) = (tmp_path / "hot").glob("*.tar")
        os.truncate(path, path.stat().st_size // 2)
        _, rest = conn.request({**read, "start": 10})
        got = [bytes(f.bytes) for f in first + rest]
        conn.close()
        status = daemon.status()
    keys = [f"s0000-{i:05d}" for i in range(20)]
    assert got[0::2] == [want[k] for k in keys]  # bin, cls, bin, cls...
    assert status["counters"]["corrupt_shards"] == 1
    assert status["tiers"]["warm"]["fetches"] == 2


class _FailingGather:
    """The compiled reader, whose reads fail as a disk's unreadable sector makes them."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def read(self, *args: Any) -> Any:
        raise OSError(errno.EIO, os.strerror(errno.EIO))


@pytest.mark.parametrize("loader", ["dataset", "fast", "fast-python"])
def test_a_local_read_that_fails_with_eio_or_short_goes_through_the_socket(
    s3_server: S3Server,
    bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    *,
    loader: str,
) -> None:
    """A local reader's read of the shard file fails with EIO (the Python reader's pread
    and preadv, the compiled reader's read): as for a failed checksum, that read goes
    through the socket, and the bytes are right. EIO is injected at the read call (only
    in this test's thread: the daemon, in its own, reads its file as it is)."""
    shards = dataset_shards(2, 20, payload=5000)
    urls, want = upload(s3_server, bucket, shards), expected(shards, 20, 5000)
    if loader == "fast":
        if local_module.GATHER is None:
            pytest.skip("the compiled local reader is not built")
        monkeypatch.setattr(local_module, "GATHER", _FailingGather(local_module.GATHER))
    else:
        if loader == "fast-python":
            monkeypatch.setattr(local_module, "GATHER", None)
        me = threading.current_thread()
        pread, preadv = os.pread, os.preadv

        def failing(real: Any) -> Any:
            def call(*args: Any) -> Any:
                if threading.current_thread() is me:
                    raise OSError(errno.EIO, os.strerror(errno.EIO))
                return real(*args)

            return call

        monkeypatch.setattr(os, "pread", failing(pread))
        monkeypatch.setattr(os, "preadv", failing(preadv))
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        with caplog.at_level(logging.INFO, logger="cached_client.local"):
            got = _bins(loader, urls, d.socket)
        served, local = d.served()
    assert got == want
    assert local == 0 and served > 0  # every byte came through the socket in the end
    assert any("reading it failed" in r.getMessage() for r in caplog.records)


def test_a_local_read_cut_short_goes_through_the_socket(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """The shard file a local reader holds open is cut short: its next read is short, it
    asks through the socket, where the daemon finds the file short too, drops the shard
    and fetches it again: the bytes are right."""
    shards = dataset_shards(1, 20, payload=100_000)
    urls, want = upload(s3_server, bucket, shards), expected(shards, 20, 100_000)
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        conn = Connection(d.socket)
        read = {"op": "read", "url": urls[0], "stream": "t", "count": 10}
        header, first = conn.request({**read, "start": 0})
        assert "local" in header
        got = [bytes(f.bytes) for f in first]  # the reader has the file open now
        path = Path(header["local"]["path"])
        os.truncate(path, path.stat().st_size // 2)
        header, rest = conn.request({**read, "start": 10})
        got += [bytes(f.bytes) for f in rest]
        conn.close()
        counters = d.call(d.daemon.status)["counters"]
    keys = [f"s0000-{i:05d}" for i in range(20)]
    assert got[0::2] == [want[k] for k in keys]
    assert counters["corrupt_shards"] == 1
    assert counters["local_fallback_bytes"] > 0
