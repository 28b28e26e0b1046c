"""Local shard handles (issue 21): a reader's descriptor of a hot-tier file never outlives
its lease, a lapsed lease or a refetched copy is a per-read event, and the tier's bound
holds on the disk itself, not only in the daemon's count.

Real parts: the moto S3 server, a real daemon, real ZeroMQ, a real small file system (a
tmpfs mounted for the test) for the hot tier, and the reader in this process, whose
descriptors ``/proc/self/fd`` lists.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from cached_client import CachedDataset, FastLoader
from cached_client.errors import ProtocolError
from cached_wire import layouts, protocol

from cached.layouts import MAX_KEPT_LAYOUTS
from tests.daemon import (
    ProcessDaemon,
    daemon_config,
    dataset_shards,
    held_files,
    serve_config,
    thread_daemon,
)
from tests.s3server import S3Server
from tests.test_daemon import upload
from tests.test_disk import small_disk
from tests.test_local_reads import expected

MiB = 1 << 20


def deleted_held(hot_dir: Path) -> list[str]:
    """The hot-tier files this process holds open that are no longer in the directory."""
    return [target for target in held_files(hot_dir) if target.endswith(" (deleted)")]


def used_bytes(path: Path) -> int:
    """What the file system at ``path`` has allocated, as ``df`` says (statvfs)."""
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def make(loader: str, urls: list[str], socket: str, **kw: Any) -> Any:
    if loader == "dataset":
        return CachedDataset(urls, socket=socket, shuffle=True, seed=3, **kw)
    return FastLoader(urls, socket=socket, batch_size=7, exts=["bin"], seed=3, **kw)


def samples(reader: Any) -> Iterator[str]:
    """Each sample's key as ``reader`` yields it, once its ``bin`` was found right."""
    if isinstance(reader, CachedDataset):
        for s in reader:
            check(s["__key__"], s["bin"])
            yield s["__key__"]
        return
    for batch in reader:
        data, offs = batch.data["bin"].numpy(), batch.offsets["bin"]
        for i, key in enumerate(batch.keys):
            check(key, data[offs[i] : offs[i + 1]].tobytes())
            yield key


WANT: dict[str, bytes] = {}


def check(key: str, got: bytes) -> None:
    assert got == WANT[key], f"wrong bytes for {key}"


@pytest.mark.parametrize("loader", ["dataset", "fast"])
def test_many_epochs_over_a_small_tier_hold_no_evicted_file_and_the_disk_stays_bounded(
    s3_server: S3Server, bucket: str, tmp_path: Path, loader: str
) -> None:
    """Four epochs over a tier a quarter of the dataset: after each one the reader holds
    no descriptor of a file the daemon evicted, and the file system under the tier never
    holds more than the capacity (and one shard being written) in the meantime."""
    shards = dataset_shards(16, 10, payload=50_000)  # ~0.5 MiB each, 8 MiB in all
    urls = upload(s3_server, bucket, shards)
    WANT.clear()
    WANT.update(expected(shards, 10, 50_000))
    capacity = 2 * MiB
    with small_disk(tmp_path / "disk", 64) as disk:
        base = used_bytes(disk)
        cfg = daemon_config(
            tmp_path,
            s3_server.endpoint_url,
            **{
                "cache.dir": str(disk / "hot"),
                "cache.capacity": capacity,
            },
        )
        with thread_daemon(cfg) as d:
            hot_dir = d.daemon.hot.dir
            peak = 0
            reader = make(loader, urls, d.socket, local_reads=True)  # one, for every epoch
            for epoch in range(4):
                reader.set_epoch(epoch)
                assert Counter(samples(reader)) == Counter(WANT.keys())
                peak = max(peak, used_bytes(disk) - base)
                assert deleted_held(hot_dir) == [], f"epoch {epoch}"
            served, local = d.served()
        assert local == served > 0  # every byte through the files
    assert peak <= capacity + max(map(len, shards)), peak


def six_shards(s3_server: S3Server, bucket: str) -> list[str]:
    """Six shards of ten 20 KB samples in the store (``WANT`` their bytes)."""
    shards = dataset_shards(6, 10, payload=20_000)
    WANT.clear()
    WANT.update(expected(shards, 10, 20_000))
    return upload(s3_server, bucket, shards)


@pytest.mark.parametrize("loader", ["dataset", "fast"])
@pytest.mark.parametrize("mode", [True, None])
def test_shards_evicted_and_fetched_again_under_a_reader_read_on_with_the_right_bytes(
    s3_server: S3Server, bucket: str, tmp_path: Path, mode: bool | None, loader: str
) -> None:
    """Mid-epoch, with replies for the next shards in, the daemon evicts every shard
    under the reader (forced, pins or not) and fetches some again for other readers (new
    files, new inodes). The reader goes on, local reads on or required, with every
    sample's right bytes, and still reads locally afterwards. (A lapsed lease leads here
    too: test_a_stopped_reader_whose_leases_lapsed_and_shards_went_reads_on.)"""
    urls = six_shards(s3_server, bucket)
    cfg = daemon_config(tmp_path, s3_server.endpoint_url, **{"server.lease_timeout_s": 0.3})
    with thread_daemon(cfg) as d:
        reader = make(loader, urls, d.socket, local_reads=mode)
        assert Counter(samples(reader)) == Counter(WANT.keys())  # epoch 0, cold
        reader.set_epoch(1)  # warm: whole reads, no opens (D33)
        it = samples(reader)
        seen: Counter[str] = Counter(next(it) for _ in range(15))  # replies ahead are in
        hot = d.daemon.hot

        def evict_all() -> int:
            shards_now = list(hot.resident())
            for shard in shards_now:
                hot._evict(shard)
            return len(shards_now)

        assert d.call(evict_all) > 0
        # Other readers bring some back: new copies under the same names.
        for _ in CachedDataset(urls[:3], socket=d.socket):
            pass
        seen.update(it)
        assert seen == Counter(WANT.keys())
        # Local reads went on afterwards: the next epoch reads from the files.
        before = d.served()
        reader.set_epoch(2)
        assert Counter(samples(reader)) == Counter(WANT.keys())
        after = d.served()
    assert after[1] - before[1] == after[0] - before[0] > 0


@pytest.mark.parametrize("loader", ["dataset", "fast"])
def test_a_daemon_restarted_under_a_paused_reader_gets_its_plan_back_within_a_heartbeat(
    s3_server: S3Server, bucket: str, tmp_path: Path, loader: str
) -> None:
    """The daemon restarts mid-epoch while the reader sends nothing (it reads from files it
    has, or its training step runs): the new daemon has the reader's plan within one
    heartbeat, and the reader then finishes the epoch with the right bytes. The reader
    used every read form before: opens and reads (cold), whole reads (warm)."""
    shards = dataset_shards(8, 10, payload=20_000)
    urls = upload(s3_server, bucket, shards)
    WANT.clear()
    WANT.update(expected(shards, 10, 20_000))
    config, socket = serve_config(tmp_path, s3_server.endpoint_url)
    first = ProcessDaemon(config, socket).start()
    try:
        reader = make(loader, urls, socket, local_reads=True)
        assert Counter(samples(reader)) == Counter(WANT.keys())  # cold: opens and reads
        reader.set_epoch(1)  # warm: whole reads
        it = samples(reader)
        seen: Counter[str] = Counter(next(it) for _ in range(15))
        assert [p["dataset"] for p in first.status()["plans"]] == [reader.catalog.id]
    finally:
        assert first.stop() == 0
    second = ProcessDaemon(config, socket).start()
    try:
        started = time.monotonic()
        while not second.status()["plans"]:
            assert time.monotonic() - started < 2.0 + 1.0, "no plan within a heartbeat (2 s)"
            time.sleep(0.05)
        # Told again as URLs, self-contained: the first daemon had it by positions.
        assert [p["dataset"] for p in second.status()["plans"]] == [None]
        seen.update(it)
        assert seen == Counter(WANT.keys())
    finally:
        assert second.stop() == 0


def held_leases(d: Any) -> int:
    return int(d.call(lambda: len(d.daemon.server.leases._held)))


def test_a_reader_that_pauses_keeps_its_leases_by_its_heartbeat(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """A reader that sends nothing for many lease timeouts (its training step runs) keeps
    its pins: its heartbeat renews them, so nothing is evicted under it or fetched again."""
    urls = six_shards(s3_server, bucket)
    cfg = daemon_config(tmp_path, s3_server.endpoint_url, **{"server.lease_timeout_s": 0.3})
    with thread_daemon(cfg) as d:
        reader = make("dataset", urls, d.socket, local_reads=True)
        it = samples(reader)
        seen: Counter[str] = Counter(next(it) for _ in range(15))
        # Requests sent before the pause (a release riding on a read) finish first: well
        # within a lease timeout, so a lapse is still seen below.
        time.sleep(0.1)
        held = held_leases(d)
        time.sleep(1.5)  # five lease timeouts without a request
        assert held > 0 and held_leases(d) == held
        seen.update(it)
        served, local = d.served()
    assert seen == Counter(WANT.keys())
    assert local == served  # no read went through the socket
    assert s3_server.count("GET", f"/{bucket}/") == 6  # nothing was fetched again


STALLED_READER = """
import sys
from collections import Counter
from cached_client import CachedDataset
urls, socket, mode = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
ds = CachedDataset(urls, socket=socket, local_reads={"on": True, "auto": None}[mode])
list(ds)  # epoch 0
ds.set_epoch(1)
it = iter(ds)
got = [next(it) for _ in range(15)]
print("paused", flush=True)
sys.stdin.readline()  # the test stops and continues this process meanwhile
got += list(it)
bad = [s["__key__"] for s in got if s["bin"] != (s["__key__"].encode() * 2000)[:20000]]
print("read", len(got), "bad", len(bad), flush=True)
"""


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_a_stopped_reader_whose_leases_lapsed_and_shards_went_reads_on(
    s3_server: S3Server, bucket: str, tmp_path: Path, mode: str
) -> None:
    """A reader process stopped (SIGSTOP: swapped out, a debugger) for longer than its
    lease has none left when it continues, and the daemon evicted and fetched again the
    shards it had replies for. It reads on, local reads required or not, with every
    sample's right bytes: a missing or replaced file is a per-read event."""
    shards = dataset_shards(6, 10, payload=20_000)
    urls = upload(s3_server, bucket, shards)
    cfg = daemon_config(tmp_path, s3_server.endpoint_url, **{"server.lease_timeout_s": 0.3})
    with (
        thread_daemon(cfg) as d,
        subprocess.Popen(
            [sys.executable, "-c", STALLED_READER, ",".join(urls), d.socket, mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as child,
    ):
        try:
            assert child.stdout is not None and child.stdin is not None
            assert child.stdout.readline().strip() == "paused"
            os.kill(child.pid, signal.SIGSTOP)
            deadline = time.monotonic() + 10
            while held_leases(d):
                assert time.monotonic() < deadline, "the stopped reader's leases never lapsed"
                time.sleep(0.05)
            hot = d.daemon.hot
            assert d.call(lambda: [hot._evict(s) for s in list(hot.resident())])
            for _ in CachedDataset(urls[:3], socket=d.socket):  # others bring some back
                pass
            os.kill(child.pid, signal.SIGCONT)
            child.stdin.write("go\n")
            child.stdin.flush()
            out = child.stdout.readline().split()
            assert child.wait(60) == 0
        finally:
            child.kill()
    assert out == ["read", "60", "bad", "0"]


def _layout(header: dict[str, Any], frame: Any) -> layouts.PackedRows:
    """A local reply's layout, as the reader takes it."""
    return layouts.PackedRows(frame, header["packed"]["exts"], 0, header["packed"]["samples"])


def test_a_read_through_the_socket_is_checked_against_the_local_reply_it_replaces(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """The daemon's own local reply and its reply through the socket to the same read
    describe the same samples; one that does not (another key, a size, a sample missing)
    is refused, naming the shard."""
    urls = upload(s3_server, bucket, dataset_shards(2, 12, payload=3000))
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(d.socket)
        try:
            read = {"op": "read", "url": urls[1], "stream": "t", "start": 2, "count": 7}

            def ask(**extra: Any) -> list[Any]:
                sock.send(protocol.encode({**read, "id": 1, **extra}))
                return sock.recv_multipart()

            local_frames = ask(local=True, packed=True, exts=["bin"])
            socket_frames = ask(refetch=True, exts=["bin"])
        finally:
            sock.close(linger=0)
    local = protocol.decode(local_frames[0])
    assert "local" in local and "packed" in local and "samples" not in local
    described = layouts.described(layouts.unpacked(_layout(local, local_frames[1])))
    assert [key for key, _ in described] == [f"s0001-{i:05d}" for i in range(2, 9)]
    assert all(members == [("bin", 3000)] for _, members in described)
    again = protocol.decode(socket_frames[0])
    layouts.check_refetch(urls[1], described, again)  # the same samples: no error
    for changed in (
        {**again, "samples": again["samples"][:-1]},
        {**again, "samples": [["other", again["samples"][0][1]], *again["samples"][1:]]},
        {**again, "samples": [[again["samples"][0][0], [["bin", 2999]]], *again["samples"][1:]]},
    ):
        with pytest.raises(ProtocolError, match=r"shard-0001\.tar: the read through the socket"):
            layouts.check_refetch(urls[1], described, changed)


def test_the_daemon_keeps_a_few_whole_shard_layouts_whatever_clients_ask_for(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """A client that asks for a whole shard's local layout with a hundred lists of
    extensions leaves the daemon keeping a few of them (one per list asked for, the last
    few), and each reply is still right."""
    urls = upload(s3_server, bucket, dataset_shards(1, 5, payload=100))
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(d.socket)
        read = {"op": "read", "url": urls[0], "stream": "t", "start": 0, "whole": True}
        try:
            for n in range(200):
                exts = ["bin", f"x{n}"]
                sock.send(
                    protocol.encode({**read, "id": n, "local": True, "packed": True, "exts": exts})
                )
                frames = sock.recv_multipart()
                header = protocol.decode(frames[0])
                assert header["ok"] and header["next"] == 5
                got = layouts.described(layouts.unpacked(_layout(header, frames[1])))
                assert [m for _, m in got] == [[("bin", 100)]] * 5
        finally:
            sock.close(linger=0)
        path = Path(header["local"]["path"])
        kept = d.call(lambda: len(d.daemon.hot.get(path.stem).index.memo))
    assert 0 < kept <= MAX_KEPT_LAYOUTS
