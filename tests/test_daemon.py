"""The daemon end to end over real sockets: hot tier bound, pins, restart, protocol errors."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from cached_client import CachedDataset
from cached_client.errors import RemoteError, VersionMismatch
from cached_client.reader import read_shard
from cached_client.transport import Connection
from cached_wire.protocol import ErrorCode, decode, encode

from cached.config import Config
from tests.daemon import (
    ProcessDaemon,
    daemon_config,
    dataset_shards,
    make_tar,
    serve_config,
    thread_daemon,
)
from tests.s3server import S3Server


def upload(s3: S3Server, bucket: str, shards: list[bytes]) -> list[str]:
    for i, body in enumerate(shards):
        s3.put(bucket, f"shard-{i:04d}.tar", body)
    return [f"s3://{bucket}/shard-{i:04d}.tar" for i in range(len(shards))]


def dir_bytes(path: Path) -> int:
    total = 0
    for p in path.iterdir():
        with contextlib.suppress(FileNotFoundError):  # removed between listing and stat
            total += p.stat().st_size
    return total


class DirWatcher:
    """Samples the hot tier's bytes on disk while a test runs; keeps the maximum."""

    def __init__(self, path: Path) -> None:
        self.path, self.max_bytes, self.samples = path, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.path.exists():
                self.max_bytes = max(self.max_bytes, dir_bytes(self.path))
                self.samples += 1
            time.sleep(0.005)

    def __enter__(self) -> DirWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.mark.stores
def test_open_and_read_round_trip(s3_server: S3Server, bucket: str, tmp_path: Path) -> None:
    samples = [
        (f"k{i}", {"txt": f"hello {i}".encode(), "bin": bytes([i]) * (i * 37)}) for i in range(50)
    ]
    s3_server.put(bucket, "a.tar", make_tar(samples))
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        conn = Connection(d.socket)
        got = [
            (key, {ext: f.bytes for ext, f in members})
            for key, members in read_shard(conn, f"s3://{bucket}/a.tar", "t", inflight=3)
        ]
    assert got == samples


@pytest.mark.stores
def test_two_clients_share_one_download(s3_server: S3Server, bucket: str, tmp_path: Path) -> None:
    s3_server.put(bucket, "a.tar", make_tar([("k", {"bin": b"x" * 300_000})]))
    url = f"s3://{bucket}/a.tar"
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        conns = [Connection(d.socket) for _ in range(4)]
        ids = [c.send({"op": "open", "url": url, "stream": f"s{i}"}) for i, c in enumerate(conns)]
        replies = [c.wait(rid)[0] for c, rid in zip(conns, ids, strict=True)]
        assert all(r["samples"] == 1 for r in replies)
        # The reply says whether the shard was resident when the open came.
        again = conns[0].request({"op": "open", "url": url, "stream": "again"})[0]
        assert replies[0]["hit"] is False and again["hit"] is True
    assert s3_server.count("GET", f"/{bucket}/a.tar") == 1


def test_capacity_is_never_exceeded_over_two_epochs(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    shards = dataset_shards(20, 30, payload=2000)
    urls = upload(s3_server, bucket, shards)
    total = sum(len(s) for s in shards)
    capacity = int(total * 0.4)
    cfg = daemon_config(tmp_path, s3_server.endpoint_url, **{"cache.capacity": str(capacity)})
    expected = sorted(f"s{s:04d}-{i:05d}" for s in range(20) for i in range(30))
    with thread_daemon(cfg) as d, DirWatcher(cfg.cache.dir) as watch:
        for epoch in range(2):
            ds = CachedDataset(urls, socket=d.socket, shuffle=True, seed=1)
            ds.set_epoch(epoch)
            assert sorted(s["__key__"] for s in ds) == expected
            stats = d.call(d.daemon.hot.stats)
            assert stats.used_bytes <= capacity
    assert watch.samples > 10
    assert 0 < watch.max_bytes <= capacity
    # Fits 40%: the second epoch had to fetch again, so eviction really ran.
    assert s3_server.count("GET", bucket) > 20


def test_a_download_waits_for_the_evicted_files_to_leave_the_disk(
    s3_server: S3Server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An evicted file is unlinked by a worker thread; until that is done its bytes are on
    the disk, and a download that needs them does not start writing (a loaded machine's
    slow unlink made the directory pass the bound in a CI run)."""
    shards = dataset_shards(6, 4, payload=30_000)
    urls = upload(s3_server, bucket, shards)
    size = max(len(b) for b in shards)
    capacity = size * 2 + size // 2 + 2 * 65536  # two shards, with their margins
    unlink = Path.unlink
    slow: list[str] = []

    def slow_unlink(self: Path, missing_ok: bool = False) -> None:
        if self.name.endswith(".evicted"):
            slow.append(self.name)
            time.sleep(0.3)
        unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", slow_unlink)
    cfg = daemon_config(tmp_path, s3_server.endpoint_url, **{"cache.capacity": str(capacity)})
    with thread_daemon(cfg) as d, DirWatcher(cfg.cache.dir) as watch:
        conn = Connection(d.socket)
        for url in urls:  # six shards through room for two: each evicts one
            conn.request({"op": "open", "url": url, "stream": "s", "pin": False})
        conn.close()
    assert len(slow) >= 3
    assert 0 < watch.max_bytes <= capacity


def two_shard_tier(
    s3: S3Server, bucket: str, tmp_path: Path, shards: int, pin_wait_s: float
) -> tuple[list[str], Config]:
    """``shards`` shards of 10 samples uploaded, and a daemon config whose hot tier holds
    two of them (not three)."""
    bodies = dataset_shards(shards, 10, payload=20_000)
    urls = upload(s3, bucket, bodies)
    capacity = int(max(len(b) for b in bodies) * 2.5)
    cfg = daemon_config(
        tmp_path,
        s3.endpoint_url,
        **{
            "cache.capacity": str(capacity),
            "cache.pin_wait_s": pin_wait_s,
            # One user (this test) may pin the whole of so small a tier.
            "server.max_pinned_share_per_user": 1.0,
        },
    )
    return urls, cfg


def test_a_pinned_shard_is_not_evicted(s3_server: S3Server, bucket: str, tmp_path: Path) -> None:
    urls, cfg = two_shard_tier(s3_server, bucket, tmp_path, shards=4, pin_wait_s=0.5)
    with thread_daemon(cfg) as d:
        holder = Connection(d.socket)
        holder.request({"op": "open", "url": urls[0], "stream": "holder"})  # pins shard 0
        other = Connection(d.socket)
        for url in urls[1:]:
            other.request({"op": "open", "url": url, "stream": "other", "pin": False})
        # Shard 0 survived every eviction: reading it makes no new GET.
        gets = s3_server.count("GET", f"{bucket}/shard-0000")
        keys = [k for k, _ in read_shard(holder, urls[0], "holder")]
        assert len(keys) == 10
        assert s3_server.count("GET", f"{bucket}/shard-0000") == gets == 1


def test_cache_full_when_every_shard_is_pinned(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    urls, cfg = two_shard_tier(s3_server, bucket, tmp_path, shards=3, pin_wait_s=0.3)
    with thread_daemon(cfg) as d:
        conn = Connection(d.socket)
        conn.request({"op": "open", "url": urls[0], "stream": "a"})
        conn.request({"op": "open", "url": urls[1], "stream": "b"})
        with pytest.raises(RemoteError, match="no room for") as info:
            conn.request({"op": "open", "url": urls[2], "stream": "c"})
        assert info.value.code == ErrorCode.CACHE_FULL
        # Released pins make room again: the daemon recovers without a restart.
        conn.request({"op": "close", "url": urls[0], "stream": "a"})
        assert conn.request({"op": "open", "url": urls[2], "stream": "c"})[0]["samples"] == 10


def test_leases_of_silent_streams_lapse(
    s3_server: S3Server,
    bucket: str,
    tmp_path: Path,
    raw_dealer: tuple[zmq.Context[zmq.Socket[bytes]], list[zmq.Socket[bytes]]],
) -> None:
    """A stream that sends nothing, no heartbeat either (a client without one, a process
    stopped with its socket open), loses its leases after ``lease_timeout_s``. (A live
    client's heartbeat renews them: tests/test_shard_handles.py.)"""
    urls = upload(s3_server, bucket, dataset_shards(2, 5, payload=20_000))
    cfg = daemon_config(tmp_path, s3_server.endpoint_url, **{"server.lease_timeout_s": 0.2})
    with thread_daemon(cfg) as d:
        ctx, socks = raw_dealer
        # Kept open: a connection that closes takes its leases at once (test_fairness.py).
        sock = ctx.socket(zmq.DEALER)
        socks.append(sock)
        sock.connect(d.socket)
        sock.send(encode({"op": "open", "url": urls[0], "stream": "killed", "id": 1}))
        assert decode(sock.recv_multipart()[0])["ok"]
        assert d.call(lambda: d.daemon.hot.stats().pinned) == 1
        deadline = time.monotonic() + 5
        while d.call(lambda: d.daemon.hot.stats().pinned) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert d.call(lambda: d.daemon.hot.stats().pinned) == 0


@pytest.fixture
def raw_dealer() -> Iterator[tuple[zmq.Context[zmq.Socket[bytes]], list[zmq.Socket[bytes]]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socks: list[zmq.Socket[bytes]] = []
    yield ctx, socks
    for s in socks:
        s.close(linger=0)
    ctx.term()


def test_protocol_errors_are_structured_and_the_daemon_keeps_serving(
    s3_server: S3Server,
    bucket: str,
    tmp_path: Path,
    raw_dealer: tuple[zmq.Context[zmq.Socket[bytes]], list[zmq.Socket[bytes]]],
) -> None:
    s3_server.put(bucket, "a.tar", make_tar([("k", {"txt": b"ok"})]))
    ctx, socks = raw_dealer
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        sock = ctx.socket(zmq.DEALER)
        socks.append(sock)
        sock.connect(d.socket)

        def ask(*frames: bytes) -> dict[str, object]:
            sock.send_multipart(list(frames))
            assert sock.poll(5000), "the daemon did not answer"
            return decode(sock.recv_multipart()[0])

        assert ask(b"not json")["code"] == ErrorCode.BAD_REQUEST
        assert ask(encode({"op": "dance", "id": 1}))["code"] == ErrorCode.BAD_REQUEST
        reply = ask(
            encode(
                {
                    "op": "read",
                    "id": 2,
                    "url": f"s3://{bucket}/a.tar",
                    "stream": "s",
                    "start": -1,
                    "count": 1,
                }
            )
        )
        assert reply["code"] == ErrorCode.BAD_REQUEST and reply["id"] == 2
        reply = ask(
            encode(
                {
                    "op": "read",
                    "id": 3,
                    "url": f"s3://{bucket}/a.tar",
                    "stream": "s",
                    "start": 5,
                    "count": 1,
                }
            )
        )
        assert reply["code"] == ErrorCode.OUT_OF_RANGE
        reply = ask(encode({"op": "open", "id": 4, "url": "http://x/y.tar", "stream": "s"}))
        assert reply["code"] == ErrorCode.BAD_REQUEST
        assert "scheme" in str(reply["message"])
        with pytest.raises(VersionMismatch, match="protocol v99"):
            conn = Connection(d.socket)
            conn.open()
            conn.request({"op": "hello", "v": 99})
        keys = [k for k, _ in read_shard(Connection(d.socket), f"s3://{bucket}/a.tar", "s")]
        assert keys == ["k"]


@pytest.mark.stores
def test_restart_serves_warm_cache_without_fetching(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    urls = upload(s3_server, bucket, dataset_shards(4, 20, payload=5000))
    hot = tmp_path / "hot"
    config, socket = serve_config(tmp_path, s3_server.endpoint_url)
    daemon = ProcessDaemon(config, socket).start()
    try:
        first = [s["__key__"] for s in CachedDataset(urls, socket=socket)]
    finally:
        assert daemon.stop() == 0
    gets = s3_server.count("GET", bucket)
    assert gets == 4
    # Leave debris as a crash would: a partial download and a data file without its index.
    (hot / "0123.tar.partial").write_bytes(b"half a shard")
    (hot / "4567.tar").write_bytes(b"no index")
    daemon = ProcessDaemon(config, socket).start()
    try:
        assert not (hot / "0123.tar.partial").exists()
        assert not (hot / "4567.tar").exists()
        second = [s["__key__"] for s in CachedDataset(urls, socket=socket)]
        status = daemon.status()
    finally:
        assert daemon.stop() == 0
    assert second == first
    assert s3_server.count("GET", bucket) == gets  # not one byte fetched again
    assert status["counters"]["misses"] == 0 and status["hot"]["shards"] == 4


@pytest.mark.stores
def test_a_partial_shard_is_never_served(s3_server: S3Server, bucket: str, tmp_path: Path) -> None:
    """A shard that fails mid-download (truncated tar) is reported, not served in part."""
    good = make_tar([(f"k{i}", {"bin": b"y" * 4000}) for i in range(10)])
    s3_server.put(bucket, "cut.tar", good[: len(good) // 2])
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        conn = Connection(d.socket)
        with pytest.raises(RemoteError) as info:
            list(read_shard(conn, f"s3://{bucket}/cut.tar", "s"))
        assert info.value.code == ErrorCode.NOT_A_TAR
        assert f"s3://{bucket}/cut.tar" in str(info.value)
        assert not list((tmp_path / "hot").glob("*.tar"))
        assert not list((tmp_path / "hot").glob("*.partial"))


def test_a_demand_miss_outranks_queued_prefetches(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    from tests.faultproxy import FaultProxy

    urls = upload(s3_server, bucket, dataset_shards(6, 5, payload=1000))
    with FaultProxy.start(s3_server.endpoint_url) as proxy:
        cfg = daemon_config(tmp_path, proxy.endpoint_url, **{"prefetch.concurrency": 1})
        proxy.inject("delay", delay_s=1.0)  # the first download holds the only slot a while
        with thread_daemon(cfg) as d:
            conn = Connection(d.socket)
            queued = [
                conn.send({"op": "open", "url": u, "stream": "p", "pin": False, "prefetch": True})
                for u in urls[:5]
            ]
            time.sleep(0.5)  # the prefetches are queued behind the slow one
            demand = Connection(d.socket).request({"op": "open", "url": urls[5], "stream": "t"})
            assert demand[0]["samples"] == 5
            for rid in queued:
                conn.wait(rid)
        order = [s.path.rsplit("/", 1)[-1] for s in proxy.requests("GET")]
    # One prefetch was already downloading (whichever HEAD finished first); the demand
    # miss (shard 5) went next, before the four prefetches still queued.
    assert order[1] == "shard-0005.tar", order
    assert sorted(order) == [f"shard-000{i}.tar" for i in range(6)]


def test_client_resumes_at_the_next_sample_after_a_daemon_crash(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """kill -9 the daemon while a read waits on a download; a new daemon comes up on the
    same socket; the client re-sends what was lost and the epoch completes exactly once."""
    import signal

    from tests.faultproxy import FaultProxy

    urls = upload(s3_server, bucket, dataset_shards(3, 20, payload=2000))
    expected = [f"s{s:04d}-{i:05d}" for s in range(3) for i in range(20)]
    with FaultProxy.start(s3_server.endpoint_url) as proxy:
        config, socket = serve_config(tmp_path, proxy.endpoint_url)
        # Demand only: the prefetcher would otherwise fetch shard 2 before the fault.
        with config.open("a") as toml:
            toml.write("\n[prefetch]\nlookahead = 0\n")
        first = ProcessDaemon(config, socket).start()
        second = ProcessDaemon(config, socket)
        try:
            proxy.inject("delay", delay_s=3.0, path="shard-0002")  # its download hangs a while
            it = iter(CachedDataset(urls, socket=socket))
            keys = [next(it)["__key__"] for _ in range(25)]  # into shard 1
            # Consume the rest of shard 1 while the open of shard 2 waits, then crash.
            keys += [next(it)["__key__"] for _ in range(15)]
            killer = threading.Timer(1.0, lambda: first.stop(signal.SIGKILL))
            killer.start()
            restarter = threading.Timer(2.0, second.start)
            restarter.start()
            started = time.monotonic()
            keys += [next(it)["__key__"] for _ in range(19)]
            # Seen the new daemon's instance in a ping reply and re-sent at once, well
            # before the 15 s after which a silent daemon is given up on and redialled.
            assert time.monotonic() - started < 10
            killer.join()
            restarter.join()
            # The reader's plan (this epoch and the next) was told to the new daemon too
            # (asked before the last sample: a reader done with its pass closes its
            # connection, and its plan goes with it).
            assert [p["shards"] for p in second.status()["plans"]] == [6]
            keys += [s["__key__"] for s in it]
        finally:
            first.stop()
            if second.proc is not None:
                assert second.stop() == 0
    assert keys == expected


def test_serves_over_tcp_too(s3_server: S3Server, bucket: str, tmp_path: Path) -> None:
    urls = upload(s3_server, bucket, dataset_shards(2, 10, payload=3000))
    cfg = daemon_config(tmp_path, s3_server.endpoint_url, **{"server.socket": "tcp://127.0.0.1:*"})
    with thread_daemon(cfg) as d:
        assert d.socket.startswith("tcp://127.0.0.1:") and not d.socket.endswith("*")
        keys = [s["__key__"] for s in CachedDataset(urls, socket=d.socket)]
    assert keys == [f"s{s:04d}-{i:05d}" for s in range(2) for i in range(10)]


def test_the_free_space_floor_refuses_downloads(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """`[cache] min_free` beyond what the disk has: nothing is written, the reader gets a
    cache_full error naming the shard, and the daemon keeps answering."""
    urls = upload(s3_server, bucket, dataset_shards(1, 3, payload=1000))
    cfg = daemon_config(
        tmp_path,
        s3_server.endpoint_url,
        **{"cache.min_free": "1000TiB", "cache.pin_wait_s": 0.2},
    )
    with thread_daemon(cfg) as d:
        conn = Connection(d.socket)
        with pytest.raises(RemoteError, match="no room for") as info:
            conn.request({"op": "open", "url": urls[0], "stream": "s"})
        assert info.value.code == ErrorCode.CACHE_FULL and urls[0] in str(info.value)
        assert conn.request({"op": "status"})[0]["status"]["hot"]["shards"] == 0
    # One request: the GET whose headers gave the size; its body was closed unread, and
    # no second GET came after the wait for room (nor a HEAD before).
    assert s3_server.count("GET", bucket) == 1
    assert s3_server.count("HEAD", bucket) == 0
    # Nothing but the daemon's lock file (cached/lock.py).
    assert [p.name for p in (tmp_path / "hot").iterdir()] == [".lock"]
