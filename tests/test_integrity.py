"""Integrity end to end: bit rot in the hot tier, bodies corrupted in transit, objects
replaced in the store, and restarts while the store is down. Real daemons, moto's S3
server, the fault proxy; every outcome is checked with content hashes of what a reader
got (nothing lost, duplicated, corrupt or stale)."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cached_client import CachedDataset
from cached_client.reader import read_shard
from cached_client.transport import Connection

from cached.errors import VerifyError
from cached.hot import tier as hot_module
from cached.hot.index import ShardIndex, TarIndexer
from cached.hot.sidecar import Sidecar
from cached.hot.tier import HotTier, ShardCorrupt
from cached.hot.verify import ALGORITHM, StreamSums
from cached.hot.verify import digest as member_sum
from cached.policy.lru import LRUPolicy
from cached.stores.base import ObjectInfo
from cached.stores.s3 import S3Source
from tests.daemon import ThreadDaemon, daemon_config, make_tar, thread_daemon
from tests.faultproxy import FaultProxy
from tests.s3server import S3Server
from tests.test_sources import Collect, s3cfg

PER_SHARD = 20
PAYLOAD = 3000

Digests = dict[str, str]


def digest(members: dict[str, Any]) -> str:
    """A sample's content hash: its members' extensions and bytes."""
    h = hashlib.sha256()
    for ext in sorted(k for k in members if not k.startswith("__")):
        h.update(ext.encode() + b"\0" + members[ext] + b"\0")
    return h.hexdigest()


def make_shards(n: int, seed: int = 0) -> tuple[list[bytes], Digests]:
    """``n`` shards of ``PER_SHARD`` samples with random payloads, and their digests."""
    rng = random.Random(seed)
    tars, expected = [], {}
    for s in range(n):
        samples = []
        for i in range(PER_SHARD):
            key = f"s{s:03d}-{i:04d}"
            members = {"bin": rng.randbytes(PAYLOAD), "cls": str(i).encode()}
            samples.append((key, members))
            expected[key] = digest(members)
        tars.append(make_tar(samples))
    return tars, expected


def upload(s3: S3Server, bucket: str, tars: list[bytes]) -> list[str]:
    for i, body in enumerate(tars):
        s3.put(bucket, f"shard-{i:03d}.tar", body)
    return [f"s3://{bucket}/shard-{i:03d}.tar" for i in range(len(tars))]


def read_all(d: ThreadDaemon, urls: list[str]) -> Digests:
    """Every sample a reader gets, by key; a duplicate fails the test."""
    got: Digests = {}
    for sample in CachedDataset(urls, socket=d.socket):
        key = sample["__key__"]
        assert key not in got, f"{key} read twice"
        got[key] = digest(sample)
    return got


def metric(d: ThreadDaemon, name: str, **labels: str) -> float:
    value = d.daemon.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def tar_path(d: ThreadDaemon, url: str) -> Path:
    shard = d.call(lambda: d.daemon.hot.latest(url))
    assert shard is not None, f"{url} is not resident"
    return Path(d.daemon.hot.path(shard))


def member_offset(d: ThreadDaemon, url: str, sample: int = 3) -> int:
    shard = d.call(lambda: d.daemon.hot.latest(url))
    return int(shard.index.samples[sample].members[0].offset) + 17


def flip(path: Path, offset: int) -> None:
    """Flip every bit of one byte in place (the daemon's mapping sees it at once)."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))


def gets(s3: S3Server, bucket: str, key: str) -> int:
    return s3.count("GET", f"/{bucket}/{key}$")


def wait_for(check: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# --- bit rot in the hot tier -----------------------------------------------------------


def test_bit_rot_while_running_is_never_served(
    s3_server: S3Server, bucket: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tars, expected = make_shards(3)
    urls = upload(s3_server, bucket, tars)
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        assert read_all(d, urls) == expected
        flip(tar_path(d, urls[1]), member_offset(d, urls[1]))
        with caplog.at_level(logging.ERROR, logger="cached.hot.tier"):
            assert read_all(d, urls) == expected
        assert metric(d, "cached_corrupt_shards_total", found="read") == 1
        assert sum("corrupt shard in the hot tier" in r.message for r in caplog.records) == 1
        # The rotten shard was fetched again, once; the others were hits.
        assert gets(s3_server, bucket, "shard-001.tar") == 2
        assert gets(s3_server, bucket, "shard-000.tar") == 1
        # A third pass reads the good copy without fetching again.
        assert read_all(d, urls) == expected
        assert gets(s3_server, bucket, "shard-001.tar") == 2


def test_bit_rot_at_rest_is_found_after_a_restart(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    tars, expected = make_shards(4)
    urls = upload(s3_server, bucket, tars)
    cfg = daemon_config(tmp_path, s3_server.endpoint_url)
    with thread_daemon(cfg) as d:
        assert read_all(d, urls) == expected
        served = (tar_path(d, urls[0]), member_offset(d, urls[0]))
        header = tar_path(d, urls[2])  # its first tar header: never served, only checked
    flip(*served)
    flip(header, 100)
    with thread_daemon(cfg) as d:
        assert read_all(d, urls) == expected
        # The background check reads every reloaded shard back; the header flip is
        # found only there. The served flip is found by whichever comes first.
        wait_for(lambda: d.call(d.daemon.hot.stats).unverified == 0)
        found = [metric(d, "cached_corrupt_shards_total", found=f) for f in ("read", "check")]
        assert sum(found) == 2 and found[1] >= 1
        assert read_all(d, urls) == expected
    for i, fetches in enumerate([2, 1, 2, 1]):
        assert gets(s3_server, bucket, f"shard-{i:03d}.tar") == fetches


def test_shards_torn_by_a_crash_are_dropped_at_the_restart_and_fetched_again(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """Publication does not fsync (D43): after a crash a published shard may be torn in
    any way the page cache allows. Each is found before it is served: a data file cut
    short or zeroed past a point, a sidecar empty or cut short."""
    tars, expected = make_shards(5)
    urls = upload(s3_server, bucket, tars)
    # Reads unchecked: the reload's own checks must find them (a served member's check
    # would find some of them too).
    cfg = daemon_config(tmp_path, s3_server.endpoint_url, **{"cache.verify_reads": False})
    with thread_daemon(cfg) as d:
        assert read_all(d, urls) == expected
        paths = [tar_path(d, url) for url in urls]
    size = paths[0].stat().st_size
    with open(paths[0], "r+b") as fh:  # the data cut short: its last pages never written
        fh.truncate(size // 2)
    with open(paths[1], "r+b") as fh:  # the right length, zeros past the middle
        fh.seek(size // 2)
        fh.write(bytes(size - size // 2))
    paths[2].with_suffix(".idx").write_bytes(b"")  # the sidecar's data never written
    idx = paths[3].with_suffix(".idx")
    idx.write_bytes(idx.read_bytes()[:40])  # the sidecar cut short
    with thread_daemon(cfg) as d:
        assert read_all(d, urls) == expected
    for i, fetches in enumerate([2, 2, 2, 2, 1]):
        assert gets(s3_server, bucket, f"shard-{i:03d}.tar") == fetches


def _old_sidecar(path: Path) -> None:
    """Rewrite a sidecar as daemons before checksums wrote it: url and version only, an
    index without checksums."""
    car = Sidecar.from_bytes(path.read_bytes())
    head = json.dumps({"url": car.url, "version": car.version}).encode()
    path.write_bytes(head + b"\n" + car.index.without_checksums().to_bytes())


@pytest.mark.stores
def test_old_sidecars_are_checked_against_the_etag_before_serving(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    tars, expected = make_shards(2)
    urls = upload(s3_server, bucket, tars)
    cfg = daemon_config(tmp_path, s3_server.endpoint_url)
    with thread_daemon(cfg) as d:
        assert read_all(d, urls) == expected
        rotten = (tar_path(d, urls[1]), member_offset(d, urls[1]))
    for idx in (tmp_path / "hot").glob("*.idx"):
        _old_sidecar(idx)
    flip(*rotten)
    with thread_daemon(cfg) as d:
        assert read_all(d, urls) == expected
        wait_for(lambda: d.call(d.daemon.hot.stats).unverified == 0)
        # shard 0 matched its ETag (an MD5): kept, and its sidecar now has checksums and
        # origin; shard 1 did not: fetched again.
        assert metric(d, "cached_corrupt_shards_total", found="check") == 1
        kept = d.call(lambda: d.daemon.hot.latest(urls[0]))
        assert kept.checksum is not None and kept.index.checksummed and kept.info is not None
    assert gets(s3_server, bucket, "shard-000.tar") == 1
    assert gets(s3_server, bucket, "shard-001.tar") == 2
    cars = [Sidecar.from_bytes(p.read_bytes()) for p in (tmp_path / "hot").glob("*.idx")]
    assert len(cars) == 2 and all(c.checksum is not None and c.info is not None for c in cars)


@pytest.mark.parametrize("in_thread", [False, True], ids=["on-loop", "in-thread"])
async def test_a_read_never_returns_rotten_bytes_and_pins_carry_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_thread: bool
) -> None:
    if in_thread:  # every read's check goes to a worker thread
        monkeypatch.setattr(hot_module, "THREAD_CHECK_BYTES", 1)
    hot = HotTier(tmp_path, 1 << 20, 0, LRUPolicy())
    found: list[str] = []
    hot.on_corrupt(lambda _shard, where: found.append(where))
    body = make_tar([("a", {"bin": b"x" * 100}), ("b", {"bin": b"y" * 100})])
    info = ObjectInfo("s3://b/k.tar", "e", len(body), "v1")
    writer = await hot.reserve("sid", info)
    hot.check()
    await writer.write((body,))
    hot.check()
    shard = await writer.publish()
    hot.check()
    assert shard.index is not None
    members = [m for s in shard.index.samples for m in s.members]
    assert [bytes(v) for v in await hot.read(shard, members)] == [b"x" * 100, b"y" * 100]
    hot.pin(shard)  # a reader holds it
    hot.check()
    flip(hot.path(shard), members[1].offset + 50)
    assert bytes((await hot.read(shard, members[:1]))[0]) == b"x" * 100  # not the rotten one
    with pytest.raises(ShardCorrupt, match="fails its checksum"):
        await hot.read(shard, members)
    hot.check()  # dropped as corrupt: an orphan while the reader pins it
    assert found == ["read"] and hot.get("sid") is None and not hot.path(shard).exists()
    again = await hot.reserve("sid", info)
    hot.check()
    assert again.shard is shard and shard.pins == 1  # the reader's pin carries over
    await again.write((body,))
    assert await again.publish() is shard
    hot.check()
    assert [bytes(v) for v in await hot.read(shard, members)] == [b"x" * 100, b"y" * 100]
    hot.unpin(shard)
    hot.check()
    assert shard.pins == 0 and hot.stats().pinned == 0


# --- checksums -------------------------------------------------------------------------


def test_stream_sums_match_whatever_the_chunking() -> None:
    rng = random.Random(1)
    samples = [(f"k{i}", {"a": rng.randbytes(rng.randrange(0, 3000)), "b": b""}) for i in range(40)]
    body = make_tar(samples)
    whole = TarIndexer("u")
    whole.feed(body)
    members = [m for s in whole.finish().samples for m in s.members]
    expected = [member_sum(body[m.offset : m.offset + m.size]) for m in members]
    for trial in range(20):
        indexer, sums, pos = TarIndexer("u"), StreamSums(), 0
        while pos < len(body):
            step = rng.choice([1, 7, 511, 512, 513, 4096, 100_000]) if trial else 1 << 20
            chunk = body[pos : pos + step]
            indexer.feed(chunk)
            sums.update(chunk, indexer.found)
            pos += len(chunk)
        index = indexer.finish().with_checksums(sums.member_sums, ALGORITHM)
        assert sums.member_sums == expected and sums.whole == member_sum(body)
        assert ShardIndex.from_bytes(index.to_bytes()) == index and index.checksummed


# --- bodies corrupted in transit --------------------------------------------------------


@pytest.mark.stores
@pytest.mark.parametrize("part_size", ["1MiB", "16KiB"], ids=["single-get", "ranged"])
def test_a_body_corrupted_in_transit_is_fetched_again(
    s3_server: S3Server, bucket: str, tmp_path: Path, proxy: FaultProxy, part_size: str
) -> None:
    tars, expected = make_shards(2)
    urls = upload(s3_server, bucket, tars)
    cfg = daemon_config(tmp_path, proxy.endpoint_url, **{"s3.part_size": part_size})
    proxy.inject("corrupt", offset=5000, path="shard-001.tar")
    with thread_daemon(cfg) as d:
        assert read_all(d, urls) == expected
        assert metric(d, "cached_fetch_retries_total", reason="corrupt") == 1
        assert metric(d, "cached_fetches_total", tier="warm", result="ok") == 2
    assert proxy.faults_left == 0


@pytest.mark.stores
async def test_the_source_gives_up_on_a_body_corrupted_every_time(
    s3_server: S3Server, bucket: str, proxy: FaultProxy
) -> None:
    body = make_tar([("k", {"bin": random.Random(2).randbytes(50_000)})])
    s3_server.put(bucket, "k.tar", body)
    rewinds: list[int] = []
    async with S3Source(s3cfg(proxy.endpoint_url, retry_attempts=3)) as src:
        info = await src.head(f"s3://{bucket}/k.tar")
        proxy.inject("corrupt", offset=100, times=3)
        sink = Collect()

        async def rewind() -> None:
            rewinds.append(len(sink.data))
            sink.chunks.clear()

        with pytest.raises(VerifyError, match="mismatch"):
            await src.stream_to_sink(info, sink, rewind=rewind)
        assert rewinds == [len(body), len(body)]  # two more whole attempts, then no more
        proxy.inject("corrupt", offset=100, times=1)
        sink.chunks.clear()
        await src.stream_to_sink(info, sink, rewind=rewind)
        assert sink.data == body


# --- objects replaced in the store ------------------------------------------------------


@pytest.mark.stores
def test_a_replaced_object_is_served_new_after_revalidate_s(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    old_tars, old = make_shards(3, seed=1)
    new_tars, new = make_shards(3, seed=2)  # same keys, other bytes
    urls = upload(s3_server, bucket, old_tars)
    # A window the upload and a read fit in on a loaded machine (a CI run once took
    # more than 0.5 s for them, and the second read already saw the new version).
    cfg = daemon_config(tmp_path, s3_server.endpoint_url, **{"s3.revalidate_s": 2.0})
    with thread_daemon(cfg) as d:
        assert read_all(d, urls) == old
        upload(s3_server, bucket, new_tars)
        assert read_all(d, urls) == old  # within revalidate_s: the version known
        time.sleep(2.1)
        assert read_all(d, urls) == new  # every sample new: no stale one, no mix
        assert read_all(d, urls) == new
        # The old versions left the hot tier: one shard per URL.
        assert d.call(d.daemon.hot.stats).shards == 3
    assert len(list((tmp_path / "hot").glob("*.tar"))) == 3


@pytest.mark.stores
@pytest.mark.parametrize("native", [False, True], ids=["botocore", "native"])
def test_an_object_replaced_mid_download_is_fetched_again_as_the_new_version(
    s3_server: S3Server, bucket: str, tmp_path: Path, proxy: FaultProxy, native: bool
) -> None:
    (old_tar,), _ = make_shards(1, seed=1)
    (new_tar,), new = make_shards(1, seed=2)
    (url,) = upload(s3_server, bucket, [old_tar])
    cfg = daemon_config(
        tmp_path,
        proxy.endpoint_url,
        **{"s3.part_size": "8KiB", "s3.part_concurrency": 1, "s3.native_fetch": native},
    )
    proxy.latency_s = 0.05  # ~8 parts: the download takes a while
    with thread_daemon(cfg) as d:
        replaced = threading.Event()

        def replace_after_first_part() -> None:
            # A part after the first, which names the version the first part brought.
            wait_for(lambda: any(s.if_match for s in proxy.requests("GET")))
            s3_server.put(bucket, "shard-000.tar", new_tar)
            replaced.set()

        replacer = threading.Thread(target=replace_after_first_part)
        replacer.start()
        got = {key: digest(dict(members)) for key, members in _read(d, url)}
        replacer.join()
        assert replaced.is_set()
        assert got == new
        assert metric(d, "cached_fetches_total", tier="warm", result="ObjectChanged") == 1
        if native:
            # Every GET of the CRT is a ranged part; those after the first carry its ETag
            # and met the 412. No HEAD either.
            assert proxy.requests("HEAD") == []
            assert all(s.range for s in proxy.requests("GET"))
            return
        # The first download stopped at a 412 (its ranged GETs carry the first GET's
        # ETag); a second whole-object GET, its headers the new version's, brought that
        # version. Neither needed a HEAD.
        assert proxy.requests("HEAD") == []
        whole = [s for s in proxy.requests("GET") if s.range is None]
        assert len(whole) == 2 and all(s.if_match is None for s in whole)
        assert all(s.if_match for s in proxy.requests("GET") if s.range is not None)
        assert metric(d, "cached_fetches_total", tier="warm", result="ObjectChanged") == 1


def _read(d: ThreadDaemon, url: str) -> Iterator[tuple[str, list[tuple[str, bytes]]]]:
    conn = Connection(d.socket)
    try:
        for key, members in read_shard(conn, url, "t"):
            yield key, [(ext, bytes(f.bytes)) for ext, f in members]
    finally:
        conn.close()


# --- the store unreachable --------------------------------------------------------------


def test_a_restarted_daemon_serves_its_hot_tier_while_the_store_is_down(
    s3_server: S3Server, bucket: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tars, expected = make_shards(4)
    urls = upload(s3_server, bucket, tars)
    s3_server.put(bucket, "never-read.tar", tars[0])
    with FaultProxy.start(s3_server.endpoint_url) as proxy:
        cfg = daemon_config(tmp_path, proxy.endpoint_url, **{"s3.revalidate_s": 0})
        with thread_daemon(cfg) as d:
            assert read_all(d, urls) == expected
    # The proxy is gone: connections to the store's address are refused.
    caplog.set_level(logging.WARNING, logger="cached.store_health")
    with thread_daemon(cfg) as d:
        assert read_all(d, urls) == expected
        assert read_all(d, urls) == expected
        status = d.call(d.daemon.fetcher.store_status)
        assert status["reachable"] is False and "could not connect" in status["last_error"].lower()
        assert metric(d, "cached_store_reachable") == 0
        with pytest.raises(Exception, match=r"never-read\.tar"):
            read_all(d, [f"s3://{bucket}/never-read.tar"])
    outages = [r for r in caplog.records if r.name == "cached.store_health"]
    assert len(outages) == 1 and "the object store is unreachable" in outages[0].message


@pytest.mark.usefixtures("quick_probe")
def test_an_outage_is_logged_once_and_its_end_too(
    s3_server: S3Server,
    bucket: str,
    tmp_path: Path,
    proxy: FaultProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    tars, expected = make_shards(3)
    urls = upload(s3_server, bucket, tars)
    cfg = daemon_config(
        tmp_path,
        proxy.endpoint_url,
        **{"s3.revalidate_s": 0, "s3.read_timeout_s": 0.2, "s3.retry_attempts": 2},
    )
    caplog.set_level(logging.WARNING, logger="cached.store_health")
    with thread_daemon(cfg) as d:
        assert read_all(d, urls) == expected
        # Every request times out now: the store is there but does not answer.
        proxy.inject("delay", method=None, times=10_000, delay_s=1.0)
        heads = len(proxy.requests("HEAD"))
        for _ in range(3):
            assert read_all(d, urls) == expected
        assert d.call(d.daemon.fetcher.store_status)["reachable"] is False
        # The first open found the outage (2 attempts); later opens asked nobody, only
        # the probe did (a few times in the meantime).
        assert len(proxy.requests("HEAD")) - heads <= 2 + 10
        proxy.clear()
        wait_for(lambda: d.call(d.daemon.fetcher.store_status)["reachable"])
        assert read_all(d, urls) == expected
    messages = [r.message for r in caplog.records if r.name == "cached.store_health"]
    assert len(messages) == 2
    assert "is unreachable:" in messages[0] and "answers again after" in messages[1]


@pytest.mark.stores
def test_a_404_is_not_an_outage(s3_server: S3Server, bucket: str, tmp_path: Path) -> None:
    tars, expected = make_shards(1)
    urls = upload(s3_server, bucket, tars)
    cfg = daemon_config(tmp_path, s3_server.endpoint_url, **{"s3.revalidate_s": 0})
    with thread_daemon(cfg) as d:
        assert read_all(d, urls) == expected
        s3_server.client.delete_object(Bucket=bucket, Key="shard-000.tar")
        with pytest.raises(Exception, match="not found"):
            read_all(d, urls)
        assert d.call(d.daemon.fetcher.store_status)["reachable"] is True


def test_sidecars_load_old_new_and_of_another_algorithm() -> None:
    body = make_tar([("k", {"bin": b"abc", "cls": b"1"})])
    indexer = TarIndexer("u")
    indexer.feed(body)
    bare = indexer.finish()
    sums = [member_sum(body[m.offset : m.offset + m.size]) for m in bare.samples[0].members]
    index = bare.with_checksums(sums, ALGORITHM)
    info = ObjectInfo("s3://b/k", "http://e", len(body), "v", "v", "warm", None)
    new = Sidecar("s3://b/k", "v", index, info, member_sum(body), 5.0)
    assert Sidecar.from_bytes(new.to_bytes()) == new
    # With the store's checksum of the object (and without: sidecars written before it).
    checked = ObjectInfo("s3://b/k", "http://e", len(body), "v", "v", checksum="crc32:AAAA")
    with_sum = Sidecar("s3://b/k", "v", index, checked, member_sum(body), 5.0)
    assert Sidecar.from_bytes(with_sum.to_bytes()) == with_sum
    # Before checksums: url and version, an index without a checksums column.
    old = Sidecar.from_bytes(b'{"url": "s3://b/k", "version": "v"}\n' + bare.to_bytes())
    assert (old.info, old.checksum, old.published, old.index) == (None, None, 0.0, bare)
    # Checksums of an algorithm this daemon does not use: loaded as none, to be re-hashed.
    doc = json.loads(index.to_bytes())
    doc["checksum"] = "crc32"
    head = b'{"url": "s3://b/k", "version": "v", "checksum": "crc32:00ff"}\n'
    other = Sidecar.from_bytes(head + json.dumps(doc).encode())
    assert other.checksum is None and not other.index.checksummed and other.index == bare
