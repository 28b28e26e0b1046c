"""What the daemon asks the store: one GET per cold shard, whose headers stand in for the
HEAD that used to come first (docs/decisions.md, D27), and a HEAD only to revalidate a
shard the hot tier holds.

Real parts: moto's S3 server (it counts requests by method), the fault proxy in front of
it where a request must be delayed, failed or looked at, real daemons and readers.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from cached_client import CachedDataset
from cached_client.reader import read_shard
from cached_client.transport import Connection
from torch.utils.data import DataLoader

from cached.fetcher import Fetcher
from cached.hot.tier import HotTier, Shard, ShardWriter
from cached.metrics import Metrics
from cached.policy import LRUPolicy
from cached.stores import s3_native as s3_module
from cached.stores.chain import TierChain
from cached_demo.tars import make_tar
from tests.daemon import daemon_config, dataset_shards, thread_daemon
from tests.faultproxy import FaultProxy
from tests.s3server import S3Server
from tests.test_daemon import DirWatcher, upload
from tests.test_integrity import metric, wait_for
from tests.test_sources import s3cfg

# What a real engine is asked matters most: every test here runs on moto and on RGW.
pytestmark = pytest.mark.stores


def asked(s3: S3Server, bucket: str) -> dict[str, int]:
    """The store's count of GETs and HEADs of the bucket's objects."""
    return {method: s3.count(method, f"^/{bucket}/.") for method in ("GET", "HEAD")}


@pytest.mark.parametrize("native", [False, True], ids=["botocore", "native"])
def test_a_cold_epoch_asks_one_get_per_shard_and_no_head(
    s3_server: S3Server, bucket: str, tmp_path: Path, native: bool
) -> None:
    """32 shards through two DataLoader workers, with their plans, opens ahead and the
    prefetcher: 32 requests to the store where a HEAD and a GET per shard made 64; the
    warm epoch after it asks nothing. On both paths: the native GET holds its body at
    the headers until the tier has room (D42)."""
    urls = upload(s3_server, bucket, dataset_shards(32, 10, payload=2000))
    cfg = daemon_config(tmp_path, s3_server.endpoint_url, **{"s3.native_fetch": native})
    with thread_daemon(cfg) as d:
        ds = CachedDataset(urls, socket=d.socket, shuffle=True, seed=3)
        loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
        per_epoch = []
        for epoch in range(2):
            ds.set_epoch(epoch)
            assert len(list(loader)) == 320
            per_epoch.append(asked(s3_server, bucket))
        prefetched = metric(d, "cached_prefetches_total", result="ok")
    assert per_epoch == [{"GET": 32, "HEAD": 0}] * 2  # cumulative: epoch 1 asked nothing
    assert all(s3_server.count("GET", f"^/{bucket}/shard-{i:04d}.tar$") == 1 for i in range(32))
    assert prefetched > 0  # the prefetcher's window took part, without asking for sizes


def test_a_resident_shard_is_revalidated_with_a_head_and_not_fetched_again(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    urls = upload(s3_server, bucket, dataset_shards(3, 5, payload=2000))
    cfg = daemon_config(tmp_path, s3_server.endpoint_url, **{"s3.revalidate_s": 0})
    with thread_daemon(cfg) as d:
        conn = Connection(d.socket)
        for url in urls:
            assert (
                conn.request({"op": "open", "url": url, "stream": "a", "pin": False})[0]["hit"]
                is False
            )
        assert asked(s3_server, bucket) == {"GET": 3, "HEAD": 0}
        for url in urls:  # every answer is stale now (revalidate_s = 0)
            assert (
                conn.request({"op": "open", "url": url, "stream": "b", "pin": False})[0]["hit"]
                is True
            )
        conn.close()
    assert asked(s3_server, bucket) == {"GET": 3, "HEAD": 3}


@asynccontextmanager
async def running_fetcher(
    chain: TierChain, tmp_path: Path, concurrency: int = 4
) -> AsyncIterator[Fetcher]:
    hot = HotTier(tmp_path / "hot", 1 << 30, 0, LRUPolicy())
    hot.load()
    hot.check()
    fetcher = Fetcher(chain, hot, concurrency, Metrics())
    try:
        yield fetcher
    finally:
        await fetcher.stop()


@pytest.mark.parametrize("native", [False, True], ids=["botocore", "native"])
async def test_a_read_joins_the_get_of_an_open_under_way_instead_of_a_second_get(
    s3_server: S3Server, bucket: str, tmp_path: Path, proxy: FaultProxy, native: bool
) -> None:
    """An open whose answer is stale asks with a GET; while its headers are on the way
    (delayed 1 s), a read that keeps to the version known waits for them rather than
    sending a GET of its own beside it: the open's GET brings that version and becomes the
    one download both get (a double GET of one shard was seen under load, CI 2026-12-02)."""
    body = make_tar([(f"k{i}", {"bin": bytes([i]) * 1_000_000}) for i in range(8)])
    s3_server.put(bucket, "r.tar", body)
    url = f"s3://{bucket}/r.tar"
    # Parts larger than the object: one GET each; the answer is stale at once.
    cfg = s3cfg(proxy.endpoint_url, part_size_bytes=64 << 20, revalidate_s=0.0, native_fetch=native)
    async with TierChain(cfg) as chain, running_fetcher(chain, tmp_path) as fetcher:
        fetcher.lookups.remember(await chain.head(url))
        proxy.inject("delay", delay_s=1.0)  # the open's GET
        opening = asyncio.create_task(fetcher.ensure(url))
        await asyncio.to_thread(wait_for, lambda: bool(proxy.requests("GET")))
        read, read_hit = await fetcher.ensure(url, revalidate=False)
        assert read_hit is False
        shard, hit = await opening
        assert shard is read and hit is False
        m = fetcher.metrics.registry.get_sample_value
        assert m("cached_fetched_bytes_total", {"tier": "warm"}) == len(body)
        assert m("cached_fetches_total", {"tier": "warm", "result": "ok"}) == 1
    gets = [(s.range, s.if_match is not None) for s in proxy.requests("GET")]
    # The open's GET alone: whole through botocore; through the CRT, its first part, which
    # at 8 MiB covers this object.
    assert gets == [("bytes=0-8388607" if native else None, False)]


@pytest.mark.parametrize("native", [False, True], ids=["botocore", "native"])
def test_no_room_at_once_closes_the_gets_body_until_there_is_room(
    s3_server: S3Server, bucket: str, tmp_path: Path, proxy: FaultProxy, native: bool
) -> None:
    """The hot tier is full of pinned shards when a cold shard's GET answers: its body is
    closed at once (the connection does not sit waiting for room), the open waits for a
    pin to go, and the bytes then come with a GET that names the version. The hard bound
    holds throughout."""
    bodies = dataset_shards(3, 6, payload=2_000_000)  # 12 MB: more than a socket buffers
    urls = upload(s3_server, bucket, bodies)
    capacity = int(max(len(b) for b in bodies) * 2.5)
    cfg = daemon_config(
        tmp_path,
        proxy.endpoint_url,
        **{
            "cache.capacity": str(capacity),
            "cache.pin_wait_s": 20,
            "prefetch.lookahead": "0",
            # One user pins most of this tier on purpose (past the default 0.75 share).
            "server.max_pinned_share_per_user": 1.0,
            "s3.native_fetch": native,
        },
    )
    with thread_daemon(cfg) as d, DirWatcher(cfg.cache.dir) as watch:
        holder = Connection(d.socket)
        for url in urls[:2]:
            holder.request({"op": "open", "url": url, "stream": "holder"})  # pinned
        got: list[int] = []
        waiting = threading.Thread(target=lambda: got.extend(open_and_read(d.socket, urls[2])))
        waiting.start()
        wait_for(lambda: any("0002" in s.path for s in proxy.requests("GET")))
        wait_for(lambda: proxy.in_flight == 0, 5.0)  # the GET's connection was dropped
        # Its body left no file (the native GET's ends with its request, just after).
        wait_for(lambda: not list(cfg.cache.dir.glob("*.partial")), 5.0)
        assert waiting.is_alive()
        holder.request({"op": "close", "url": urls[0], "stream": "holder"})
        waiting.join(30)
        holder.close()
        assert got == [6]
        assert d.call(d.daemon.hot.stats).used_bytes <= capacity
    assert 0 < watch.max_bytes <= capacity
    third = [(s.range, s.if_match is not None) for s in proxy.requests("GET") if "0002" in s.path]
    # The second GET names the version. Each is whole; on the native path the open's GET
    # got as far as its first part of 8 MiB (held, then dropped), and the second came in
    # two such parts.
    if native:
        rest = f"bytes=8388608-{len(bodies[2]) - 1}"
        assert third == [("bytes=0-8388607", False), ("bytes=0-8388607", True), (rest, True)]
    else:
        assert third == [(None, False), (None, True)]
    assert proxy.requests("HEAD") == []


def open_and_read(socket: str, url: str) -> list[int]:
    conn = Connection(socket)
    try:
        return [len(list(read_shard(conn, url, "waiting")))]
    finally:
        conn.close()


@pytest.mark.usefixtures("quick_probe")
def test_a_get_that_finds_the_store_down_starts_an_outage_and_residents_are_served(
    s3_server: S3Server, bucket: str, tmp_path: Path, proxy: FaultProxy
) -> None:
    urls = upload(s3_server, bucket, dataset_shards(2, 5, payload=2000))
    cfg = daemon_config(
        tmp_path, proxy.endpoint_url, **{"s3.revalidate_s": 0, "s3.retry_attempts": 2}
    )
    with thread_daemon(cfg) as d:
        conn = Connection(d.socket)
        assert len(list(read_shard(conn, urls[0], "a"))) == 5
        # The endpoint goes down: one GET that cannot connect is an outage (500s for one
        # object would not be: tests/test_fault_isolation.py).
        proxy.refuse()
        with pytest.raises(Exception, match="shard-0001"):
            conn.request({"op": "open", "url": urls[1], "stream": "b"})
        assert d.call(d.daemon.fetcher.store_status)["reachable"] is False
        assert metric(d, "cached_fetches_total", tier="warm", result="StoreUnavailable") == 1
        gets = len(proxy.requests("GET"))
        # The resident shard is served as it is, though every answer is stale: no GET,
        # and no HEAD but the probe's.
        assert len(list(read_shard(conn, urls[0], "c"))) == 5
        assert len(proxy.requests("GET")) == gets
        # A shard the hot tier lacks fails at once, naming the outage, asking nobody.
        with pytest.raises(Exception, match="unreachable"):
            conn.request({"op": "open", "url": urls[1], "stream": "b"})
        assert len(proxy.requests("GET")) == gets
        proxy.accept()
        wait_for(lambda: d.call(d.daemon.fetcher.store_status)["reachable"])
        assert len(list(read_shard(conn, urls[1], "d"))) == 5
        conn.close()


async def until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait (without blocking the event loop) until ``check()`` holds."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("native", [False, True], ids=["botocore", "native"])
async def test_a_download_gives_its_slot_back_once_its_bytes_are_in(
    s3_server: S3Server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """One slot for prefetches (two, one kept for demand): while the first shard's
    publication (its index, its rename) is held back, the second shard's GET runs and
    its bytes come in. The slots bound the GETs in flight, not the local work after them
    (D48); both shards are then published whole."""
    urls = upload(s3_server, bucket, dataset_shards(2, 5, payload=2000))
    go_on = asyncio.Event()
    publishing: list[str] = []
    publish = ShardWriter.publish

    async def held_back(writer: ShardWriter, written: int | None = None) -> Shard:
        publishing.append(writer.shard.url)
        await go_on.wait()
        return await publish(writer, written)

    monkeypatch.setattr(ShardWriter, "publish", held_back)
    cfg = s3cfg(s3_server.endpoint_url, native_fetch=native)
    async with TierChain(cfg) as chain, running_fetcher(chain, tmp_path, 2) as fetcher:
        first = asyncio.create_task(fetcher.prefetch(urls[0]))
        await until(lambda: publishing == urls[:1])
        second = asyncio.create_task(fetcher.prefetch(urls[1]))
        await until(lambda: publishing == urls)  # its GET came while the first was held
        go_on.set()
        assert await first and await second
        for url in urls:
            shard = fetcher.resident(await chain.head(url))
            assert shard is not None and shard.index is not None
            assert len(shard.index.samples) == 5 and shard.index.checksummed
    assert asked(s3_server, bucket)["GET"] == 2


def first_md5_fails(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, list[Path]]:
    """The native path's MD5 over a file: the first held until the event is set, then
    found wrong (damaged in transit, as far as the check can tell); the files hashed."""
    go_on = threading.Event()
    hashed: list[Path] = []
    md5_of_file = s3_module._md5_of_file

    def held_back(path: Path) -> str:
        hashed.append(path)
        if len(hashed) == 1:
            go_on.wait(20)
            return "0" * 32
        return md5_of_file(path)

    monkeypatch.setattr(s3_module, "_md5_of_file", held_back)
    return go_on, hashed


async def test_the_md5_over_the_file_runs_without_a_download_slot(
    s3_server: S3Server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The native path checks an MD5 ETag over the file once the GET is in: that reads
    the disk, not the link, so the slot goes back first and the next GET runs meanwhile
    (D48). A hash that does not match fetches the shard again, under a slot again; in
    the end every slot is free."""
    urls = upload(s3_server, bucket, dataset_shards(2, 5, payload=2000))
    go_on, hashed = first_md5_fails(monkeypatch)
    cfg = s3cfg(s3_server.endpoint_url, native_fetch=True)
    async with TierChain(cfg) as chain, running_fetcher(chain, tmp_path, 2) as fetcher:
        first = asyncio.create_task(fetcher.prefetch(urls[0]))
        await until(lambda: len(hashed) == 1)
        second = asyncio.create_task(fetcher.prefetch(urls[1]))
        await until(lambda: len(hashed) == 2)  # its GET came while the first was hashed
        go_on.set()
        assert await first and await second
        assert len(hashed) == 3  # the first, fetched again
        for url in urls:
            shard = fetcher.resident(await chain.head(url))
            assert shard is not None and shard.index is not None and shard.index.checksummed
        await until(lambda: fetcher._slots.free == 2)
    assert asked(s3_server, bucket)["GET"] == 3


async def test_a_get_again_after_a_failed_check_waits_for_a_slot(
    s3_server: S3Server,
    bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    proxy: FaultProxy,
) -> None:
    """The slots bound the GETs in flight at the store, a GET again included: the first
    shard's MD5 over its file fails while the second shard's GET (1 s to answer) holds the
    one slot prefetches may use, and the first's new GET waits for that one to land
    instead of going beside it."""
    urls = upload(s3_server, bucket, dataset_shards(2, 5, payload=2000))
    go_on, hashed = first_md5_fails(monkeypatch)
    cfg = s3cfg(proxy.endpoint_url, native_fetch=True)
    async with TierChain(cfg) as chain, running_fetcher(chain, tmp_path, 2) as fetcher:
        first = asyncio.create_task(fetcher.prefetch(urls[0]))
        await until(lambda: len(hashed) == 1)  # its slot is back; its check is held
        await until(lambda: proxy.in_flight == 0)
        proxy.latency_s = 1.0
        proxy.max_in_flight = 0
        second = asyncio.create_task(fetcher.prefetch(urls[1]))
        await until(lambda: proxy.in_flight == 1)  # the second's GET, waiting 1 s
        go_on.set()  # the first's check fails now: its GET again needs the slot
        assert await first and await second
    gets = [r.path.rsplit("/", 1)[-1] for r in proxy.requests("GET")]
    assert gets == ["shard-0000.tar", "shard-0001.tar", "shard-0000.tar"]
    assert proxy.max_in_flight == 1
