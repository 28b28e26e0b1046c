"""Clairvoyant tiering end to end: plans, prefetch, Belady eviction, sharing between jobs.

Real parts only: the moto S3 server (requests counted at the server), a real daemon, real
ZeroMQ, and for the slow store a real TCP proxy that shapes the link's rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cached_client import CachedDataset
from cached_client.device import StallMeter
from cached_client.errors import RemoteError
from cached_client.partition import shard_order
from cached_client.transport import Connection
from torch.utils.data import DataLoader

from bench.cache_sim import offline_min
from cached.errors import CacheFull
from cached.fetcher import DEMAND, PREFETCH, PrioritySlots
from cached.hot.tier import HotTier, reservation_bytes
from cached.policy import LRUPolicy
from cached.slots import Held
from cached.stores.base import ObjectInfo
from cached_demo.tars import make_tar
from tests.daemon import (
    ProcessDaemon,
    daemon_config,
    dataset_shards,
    serve_config,
    thread_daemon,
)
from tests.faultproxy import FaultProxy
from tests.s3server import S3Server
from tests.test_daemon import DirWatcher, upload
from tests.test_integrity import wait_for


def keys(ds: CachedDataset) -> list[str]:
    return [s["__key__"] for s in ds]


def read_together(jobs: list[CachedDataset]) -> list[list[str]]:
    """Iterate the datasets at the same time, one thread each (jobs sharing a daemon)."""
    got: list[list[str]] = [[] for _ in jobs]

    def run(i: int) -> None:
        got[i] = keys(jobs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


def settle(status: Any, timeout_s: float = 20.0) -> dict[str, Any]:
    """Wait until the daemon has nothing in flight; returns its status."""
    deadline = time.monotonic() + timeout_s
    while True:
        st: dict[str, Any] = status()
        if st["hot"]["fetching_shards"] == 0 or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def test_a_dataset_that_fits_makes_no_get_after_the_first_epoch(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    urls = upload(s3_server, bucket, dataset_shards(12, 20, payload=3000))
    config, socket = serve_config(tmp_path, s3_server.endpoint_url)
    with ProcessDaemon(config, socket) as daemon:
        ds = CachedDataset(urls, socket=socket, shuffle=True, seed=3)
        loader = DataLoader(ds, batch_size=None, num_workers=2, timeout=60)
        ds.set_epoch(0)
        assert len(list(loader)) == 12 * 20
        settle(daemon.status)
        gets = s3_server.count("GET", bucket)
        assert gets >= 12
        for epoch in (1, 2):
            ds.set_epoch(epoch)
            assert len(list(loader)) == 12 * 20
        # Counted at the S3 server: not one GET since the first epoch.
        assert s3_server.count("GET", bucket) == gets
        st = daemon.status()
    # Each worker announced its plan (this epoch, then the next).
    assert len(st["plans"]) == 2
    assert all(p["shards"] == 12 for p in st["plans"])  # 6 this epoch + 6 the next


def equal_shards(s3: S3Server, bucket: str, n: int) -> tuple[list[str], int]:
    """``n`` shards of identical size; returns their URLs and that size."""
    bodies = dataset_shards(n, 8, payload=10_000)
    assert len({len(b) for b in bodies}) == 1
    return upload(s3, bucket, bodies), len(bodies[0])


def capacity_for(shards: int, size: int) -> int:
    """A hot tier that holds ``shards`` shards of ``size`` bytes (one of them being
    fetched), and not one more: a download reserves ``reservation_bytes`` (the size and
    a margin for the index), a resident shard holds its size plus its index (< 8 KiB here)."""
    return (shards - 1) * (size + 8192) + reservation_bytes(size) + 4096


def epoch_gets(
    s3: S3Server,
    bucket: str,
    tmp: Path,
    urls: list[str],
    *,
    capacity: int,
    policy: str,
    epochs: int,
) -> list[int]:
    """GETs per epoch (at the server) for one reader over shuffled epochs, demand only."""
    cfg = daemon_config(
        tmp / policy,
        s3.endpoint_url,
        **{"cache.capacity": str(capacity), "cache.policy": policy, "prefetch.lookahead": "0"},
    )
    per_epoch = []
    with thread_daemon(cfg) as d:
        ds = CachedDataset(urls, socket=d.socket, shuffle=True, seed=7)
        for epoch in range(epochs):
            before = s3.count("GET", bucket)
            ds.set_epoch(epoch)
            assert len(keys(ds)) == len(urls) * 8
            per_epoch.append(s3.count("GET", bucket) - before)
            d.call(d.daemon.hot.check)
            assert d.call(d.daemon.hot.stats).used_bytes <= capacity
    return per_epoch


def test_twice_the_hot_tier_fetches_near_the_optimum_and_far_less_than_lru(
    s3_server: S3Server, tmp_path: Path
) -> None:
    shards, epochs = 64, 5
    results = {}
    for policy in ("belady", "lru"):
        bucket = s3_server.new_bucket(policy)
        urls, size = equal_shards(s3_server, bucket, shards)
        capacity = capacity_for(shards // 2, size)
        results[policy] = epoch_gets(
            s3_server, bucket, tmp_path, urls, capacity=capacity, policy=policy, epochs=epochs
        )
    # The same accesses, replayed through Belady's offline MIN (it knows every epoch).
    sequence = [
        (s, 1) for e in range(epochs) for s in shard_order(shards, shuffle=True, seed=7, epoch=e)
    ]
    optimum = offline_min(sequence, shards // 2)
    belady, lru = sum(results["belady"][1:]), sum(results["lru"][1:])
    optimal = optimum - shards  # epochs 1.. (epoch 0 is cold for everyone)
    assert results["belady"][0] == results["lru"][0] == shards
    assert belady <= optimal * 1.05, (results, optimum)
    assert belady <= 0.7 * lru, results


def test_two_jobs_on_one_dataset_fetch_each_shard_once(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    urls = upload(s3_server, bucket, dataset_shards(10, 20, payload=5000))
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        jobs = [CachedDataset(urls, socket=d.socket, shuffle=True, seed=seed) for seed in (1, 2)]
        got = read_together(jobs)
    assert sorted(got[0]) == sorted(got[1]) and len(got[0]) == 200
    for i in range(10):
        assert s3_server.count("GET", f"/{bucket}/shard-{i:04d}.tar") == 1


@pytest.fixture
def slow_link(s3_server: S3Server) -> Iterator[FaultProxy]:
    """The S3 server behind a slow link: 300 ms to the first byte of every answer (a
    far-away store), then 4 MB/s shared by all transfers."""
    with FaultProxy.start(s3_server.endpoint_url) as proxy:
        proxy.rate_bps = 4_000_000
        proxy.latency_s = 0.3
        yield proxy


def test_a_small_jobs_demand_misses_stay_fast_while_a_big_job_prefetches(
    s3_server: S3Server, slow_link: FaultProxy, tmp_path: Path
) -> None:
    big = upload(s3_server, s3_server.new_bucket("big"), dataset_shards(12, 10, payload=80_000))
    small = [
        upload(s3_server, s3_server.new_bucket(f"small{i}"), dataset_shards(3, 10, payload=2000))
        for i in range(2)
    ]
    cfg = daemon_config(
        tmp_path,
        slow_link.endpoint_url,
        **{"prefetch.concurrency": 3, "prefetch.lookahead": "1GiB"},
    )

    def small_job(urls: list[str]) -> float:
        started = time.monotonic()
        assert len(keys(CachedDataset(urls, socket=d.socket))) == 30
        return time.monotonic() - started

    with thread_daemon(cfg) as d:
        alone_s = small_job(small[0])  # three demand misses on an idle link
        big_read: list[int] = []
        started = time.monotonic()
        reader = threading.Thread(
            target=lambda: big_read.append(len(keys(CachedDataset(big, socket=d.socket))))
        )
        reader.start()
        # Wait until the big job's prefetches fill their download slots.
        deadline = time.monotonic() + 10
        d.call(d.daemon.hot.check)
        while d.call(d.daemon.hot.stats).fetching < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        shared_s = small_job(small[1])  # the same, while the big job prefetches 9.6 MB
        reader.join(60)
        big_s = time.monotonic() - started
    assert big_read == [120]
    assert big_s > 2 * shared_s  # the big job really was prefetching all along
    # Each of the small job's demand misses takes the download slot kept for demand and
    # a share of the link at once, instead of a place behind the big job's prefetches
    # (each of which holds a slot for over half a second on this link).
    # Measured: 1.06 s shared against 1.24 s alone; without the kept slot, 1.57 against 0.92.
    assert shared_s < 1.25 * alone_s + 0.1, (alone_s, shared_s, big_s)


def test_prefetches_wait_until_the_readers_first_shard_is_in(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """A reader at its first shard has nothing to read until that shard is in: the
    prefetcher starts nothing else meanwhile, so the shard has the link to itself (with
    the other readers' first shards) and the first batch comes one download's time in."""
    urls = upload(s3_server, s3_server.new_bucket("first"), dataset_shards(6, 10, payload=5000))
    with FaultProxy.start(s3_server.endpoint_url) as link:
        # The first shard's lookup answers last (after its next shard's, which the reader
        # asks for early), then its GET takes a second: long enough to see what starts.
        link.inject("delay", method="HEAD", delay_s=0.4, path="shard-0000.tar")
        link.inject("delay", delay_s=1.0, path="shard-0000.tar")
        cfg = daemon_config(tmp_path, link.endpoint_url, **{"prefetch.lookahead": "1GiB"})
        with thread_daemon(cfg) as d:
            ds = CachedDataset(urls, socket=d.socket)
            it = iter(ds)
            got: list[str] = []
            reader = threading.Thread(target=lambda: got.append(next(it)["__key__"]))
            reader.start()
            # While the first shard's GET is held (1 s from its arrival), half-way through:
            # from the reader's start that is a client and an S3 client starting, which a
            # loaded machine has taken over a second for.
            first = "/shard-0000.tar"
            wait_for(lambda: any(r.path.endswith(first) for r in link.requests("GET")))
            time.sleep(0.5)
            during = [r.path for r in link.requests("GET")]
            reader.join(10)
            # The first shard is in: now the prefetcher brings the others, while the
            # reader is still at its first shard (it asks for its next one only).
            brought = wait_prefetched(d, set(urls), prefetches=len(urls[2:]))
            rest = [s["__key__"] for s in it]
    assert got == ["s0000-00000"] and len(rest) == 59
    assert brought == set(urls)
    # Before: the first shard's GET and two prefetches (of shards 1 and 2) at once; with
    # the hold but not its grace, the next shard's GET while the first was looked up.
    assert [p.rsplit("/", 1)[1] for p in during] == ["shard-0000.tar"], during


def test_prefetch_brings_only_what_can_stay_until_it_is_read(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """A plan of 12 shards over a hot tier of 6: the prefetcher brings the soonest that fit
    together and asks for nothing beyond them. Before, its window ran to the lookahead (1
    GiB here), so every shard past the tier's room was tried again and again, and brought
    in whenever room came free: as the furthest-needed shard resident, the first to go
    when the shards needed before it arrived, before its read (a dataset twice the tier
    fetched 1.03-1.09x itself in its cold epoch)."""
    urls, size = equal_shards(s3_server, s3_server.new_bucket("cap"), 12)
    cfg = daemon_config(
        tmp_path,
        s3_server.endpoint_url,
        **{"cache.capacity": str(capacity_for(6, size)), "prefetch.lookahead": "1GiB"},
    )
    with thread_daemon(cfg) as d:
        ds = CachedDataset(urls, socket=d.socket)
        it = iter(ds)
        next(it)  # the plan is announced; the reader stays at its first shard
        # The prefetcher brings the shards after the reader's next one (which the reader
        # asks for itself): it counts a download's reservation for each shard in its
        # window, so the four soonest, not the six the tier holds once they are in.
        brought = wait_prefetched(d, set(urls[:4]), prefetches=len(urls[2:4]))
        time.sleep(2.5)  # two rescans at least: time to ask for more, were it to
        refused = d.daemon.metrics.prefetches.labels("not_admitted")._value.get()
        resident = resident_urls(d)
        beyond = sum(s3_server.count("GET", url.removeprefix("s3:/")) for url in urls[6:])
        assert len([s for s in it]) == 12 * 8 - 1
    assert set(urls[:4]) <= brought <= set(urls[:6]), brought
    assert set(urls[:4]) <= resident <= set(urls[:6]), resident
    assert beyond == 0  # nothing past them was fetched (and evicted again) meanwhile
    assert refused == 0


def resident_urls(d: Any) -> set[str]:
    """The URLs of the shards resident in the hot tier of the thread daemon ``d``."""
    return {s.url for s in d.call(lambda: list(d.daemon.hot.resident()))}


def wait_prefetched(d: Any, urls: set[str], prefetches: int, timeout_s: float = 20.0) -> set[str]:
    """Wait until ``urls`` are resident in the hot tier of the thread daemon ``d`` and its
    prefetcher has brought at least ``prefetches`` shards. (A reader's open ahead fetches
    by itself only after ``[cache] pin_wait_s``, 30 s here.) Returns what is resident."""
    done = d.daemon.metrics.prefetches.labels("ok")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        resident = resident_urls(d)
        if urls <= resident and d.call(done._value.get) >= prefetches:
            break
        time.sleep(0.05)
    assert d.call(done._value.get) >= prefetches, "the prefetcher did not bring them"
    return resident


def wait_fraction(socket: str, urls: list[str], compute_s: float) -> float:
    """One epoch of a training loop that computes ``compute_s`` per sample; returns the
    share of loop time spent waiting for the next sample (the client's StallMeter)."""
    ds = CachedDataset(urls, socket=socket)
    meter = StallMeter()
    for _ in meter.wrap(ds):
        time.sleep(compute_s)
    return meter.fraction


def test_lookahead_cuts_the_first_epochs_wait_on_a_slow_store(
    s3_server: S3Server, slow_link: FaultProxy, tmp_path: Path
) -> None:
    fractions = {}
    for lookahead in ("0", "64MiB"):
        bucket = s3_server.new_bucket(f"slow-{lookahead}")
        urls = upload(s3_server, bucket, dataset_shards(32, 10, payload=25_000))  # 8.8 MB
        cfg = daemon_config(
            tmp_path / lookahead,
            slow_link.endpoint_url,
            **{"prefetch.lookahead": lookahead, "prefetch.concurrency": 8},
        )
        with thread_daemon(cfg) as d:
            # 320 samples x 15 ms = 4.8 s of compute. One shard at a time (0.3 s before
            # the first byte of each GET) cannot keep up with the loop's 0.15 s per shard;
            # the prefetcher's seven downloads at once can, after the first shard. With
            # three (concurrency 4) it fell just short (0.3 s and a share of the link per
            # shard, three at a time: 6 shards/s against 6.7), and the gap swung with the
            # machine's load: 0.37-0.60x here under two busy loops, 0.76x once in CI.
            fractions[lookahead] = wait_fraction(d.socket, urls, 0.015)
    # Measured on a 2-core VM: about 0.47 against 0.21-0.25 (0.45-0.51x, under two busy
    # loops too).
    assert fractions["64MiB"] < 0.75 * fractions["0"], fractions


def test_eviction_spares_shards_in_use_and_the_bound_holds_under_prefetch(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    urls, size = equal_shards(s3_server, bucket, 18)
    capacity = capacity_for(6, size)
    cfg = daemon_config(
        tmp_path,
        s3_server.endpoint_url,
        **{"cache.capacity": str(capacity), "prefetch.lookahead": "64MiB"},
    )
    evicted_in_use: list[str] = []
    with thread_daemon(cfg) as d, DirWatcher(cfg.cache.dir) as watch:
        hot = d.daemon.hot
        count = hot._on_evict

        def check(shard: Any) -> None:
            if shard.pins:
                evicted_in_use.append(shard.url)
            # The readers (threads of this process) read the files themselves (local
            # reads): none may hold open a file being evicted, or its bytes would stay on
            # disk beyond the capacity that DirWatcher sees.
            path = str(hot.path(shard))
            for fd in os.listdir("/proc/self/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/self/fd/{fd}") == path:
                        evicted_in_use.append(f"{shard.url} (open)")
            assert count is not None
            count(shard)

        d.call(lambda: setattr(hot, "_on_evict", check))
        jobs = [CachedDataset(urls, socket=d.socket, shuffle=True, seed=s) for s in (1, 2)]
        for epoch in range(2):
            for ds in jobs:
                ds.set_epoch(epoch)
            assert [len(k) for k in read_together(jobs)] == [18 * 8, 18 * 8]
        evictions = d.call(lambda: d.daemon.status()["counters"]["evictions"])
        # The bytes read from the files: the local replies, less those whose reader could
        # not use them and asked again through the socket.
        served, local = d.served()
    assert evictions > 0  # the tier was under pressure
    assert local == served > 0  # every byte read from the files, none through the socket
    assert evicted_in_use == []
    assert 0 < watch.max_bytes <= capacity


async def test_a_shard_a_reader_waits_for_is_spared_until_it_is_pinned(tmp_path: Path) -> None:
    """A download publishes the shard a reader waits for; before the reader's turn comes
    to pin it, a reservation woken by that publication needs room. It must take another
    shard's, never this one: under pressure the reader would fetch it again, and again
    (with two readers on a tier of six shards this once fetched 70x the dataset and hung).
    """
    body = make_tar([(f"s{i}", {"bin": bytes([i]) * 1000}) for i in range(4)])

    def info(name: str) -> ObjectInfo:
        return ObjectInfo(f"s3://b/{name}.tar", "e", len(body), "v1")

    async def publish(name: str) -> None:
        writer = await hot.reserve(name, info(name))
        hot.check()
        await writer.write((body,))
        hot.check()
        await writer.publish()
        hot.check()

    # Room for one reservation and one resident shard (its tar and a sidecar of some
    # 600 bytes), not two: each new reservation has to evict.
    need = len(body) + len(body) // 16 + 65536
    hot = HotTier(tmp_path, need + len(body) * 3 // 2, 0, LRUPolicy(), pin_wait_s=0.3)
    await publish("waited")  # the oldest: LRU's first victim
    await publish("other")
    with hot.wanted("waited"):
        writer = await hot.reserve("next", info("next"))
        hot.check()
        assert hot.get("waited", access=False) is not None
        assert hot.get("other", access=False) is None  # the room came from this one
        await writer.write((body,))
        hot.check()
        await writer.publish()
        hot.check()
        # Only the waited-for shard is left to evict: a reservation waits rather than
        # take it, and then says the tier is full.
        hot.pin(hot.get("next"))
        hot.check()
        with pytest.raises(CacheFull):
            await hot.reserve("last", info("last"))
        hot.check()
        assert hot.get("waited", access=False) is not None
    # The reader gave up without pinning it: it is evictable again.
    writer = await hot.reserve("last", info("last"))
    hot.check()
    assert hot.get("waited", access=False) is None
    writer.abort()
    hot.check()


def test_a_killed_readers_plan_is_dropped_after_the_timeout(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    urls = upload(s3_server, bucket, dataset_shards(3, 5))
    cfg = daemon_config(
        tmp_path,
        s3_server.endpoint_url,
        **{"prefetch.plan_timeout_s": 0.5, "prefetch.lookahead": "0"},
    )
    with thread_daemon(cfg) as d:
        conn = Connection(d.socket)
        conn.request({"op": "plan", "plan": "gone", "urls": urls, "job": "j"})
        assert [p["stream"] for p in d.call(d.daemon.status)["plans"]] == ["gone"]
        conn.close()  # the reader vanishes without a word
        deadline = time.monotonic() + 5
        while d.call(d.daemon.status)["plans"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert d.call(d.daemon.status)["plans"] == []


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"urls": "s3://b/a.tar"}, "'urls' must be a list"),
        ({"urls": ["http://b/a.tar"]}, "http"),
        ({"urls": ["s3://b/a.tar"], "plan": ""}, "'plan'"),
    ],
)
def test_a_bad_plan_is_a_bad_request(tmp_path: Path, fields: dict[str, Any], message: str) -> None:
    with thread_daemon(daemon_config(tmp_path, None)) as d:
        conn = Connection(d.socket)
        with pytest.raises(RemoteError, match=message) as err:
            conn.request({"op": "plan", "plan": "p", **fields})
        assert err.value.code == "bad_request"
        # The daemon keeps serving.
        assert conn.request({"op": "status"})[0]["ok"]


def test_a_shard_only_in_the_cold_tier_is_served_and_promoted_to_the_warm_tier(
    s3_server: S3Server, tmp_path: Path
) -> None:
    warm, cold = s3_server.new_bucket("warm"), s3_server.new_bucket("cold")
    bodies = dataset_shards(2, 10, payload=1000)
    s3_server.put(warm, "shard-0000.tar", bodies[0])
    s3_server.put(cold, "shard-0001.tar", bodies[1])  # archived: not in the warm bucket
    urls = [f"s3://{warm}/shard-{i:04d}.tar" for i in range(2)]
    tiering = {"cold.warm_prefix": f"s3://{warm}/", "cold.cold_prefix": f"s3://{cold}/"}
    cfg = daemon_config(tmp_path / "a", s3_server.endpoint_url, **tiering, **{"cold.promote": True})
    with thread_daemon(cfg) as d:
        assert len(keys(CachedDataset(urls, socket=d.socket))) == 20
        deadline = time.monotonic() + 10
        while d.call(d.daemon.status)["tiers"]["promotions"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        tiers = d.call(d.daemon.status)["tiers"]
    # Status says which tier served each fetch.
    assert tiers["warm"]["fetches"] == tiers["cold"]["fetches"] == 1
    assert tiers["cold"]["fetched_bytes"] == len(bodies[1])
    assert tiers["promotions"] == 1
    promoted = s3_server.client.get_object(Bucket=warm, Key="shard-0001.tar")["Body"].read()
    assert promoted == bodies[1]
    # The next node (a fresh hot tier) finds it in the warm tier.
    before = s3_server.count("GET", f"/{cold}/")
    with thread_daemon(daemon_config(tmp_path / "b", s3_server.endpoint_url, **tiering)) as d:
        assert len(keys(CachedDataset(urls[1:], socket=d.socket))) == 10
        assert d.call(d.daemon.status)["tiers"]["cold"]["fetches"] == 0
    assert s3_server.count("GET", f"/{cold}/") == before


def test_without_promotion_the_warm_tier_is_left_alone(s3_server: S3Server, tmp_path: Path) -> None:
    warm, cold = s3_server.new_bucket("warm"), s3_server.new_bucket("cold")
    s3_server.put(cold, "only.tar", dataset_shards(1, 5)[0])
    cfg = daemon_config(
        tmp_path,
        s3_server.endpoint_url,
        **{"cold.warm_prefix": f"s3://{warm}/", "cold.cold_prefix": f"s3://{cold}/"},
    )
    with thread_daemon(cfg) as d:
        assert len(keys(CachedDataset(f"s3://{warm}/only.tar", socket=d.socket))) == 5
        assert d.call(d.daemon.status)["tiers"]["cold"]["fetches"] == 1
    assert s3_server.client.list_objects_v2(Bucket=warm).get("KeyCount", 0) == 0


async def test_download_slots_keep_one_for_demand_and_order_prefetches_by_need() -> None:
    need = {"soon": 1.0, "late": 9.0, "later": 20.0}
    slots = PrioritySlots(3, keep=1, urgency=lambda key: need.get(key, 0.0))
    order: list[str] = []

    async def take(priority: int, key: str) -> None:
        await slots.acquire(priority, key)
        order.append(key)

    await slots.acquire(PREFETCH, "running")  # one prefetch downloading: 2 slots free
    tasks = [asyncio.create_task(take(PREFETCH, k)) for k in ("later", "late", "soon")]
    await asyncio.sleep(0)
    # Prefetches took free slots down to the one kept for demand: "later" came first.
    assert order == ["later"]
    demand = asyncio.create_task(take(DEMAND, "reader"))
    await asyncio.sleep(0)
    assert order == ["later", "reader"]  # at once, though prefetches were queued before it
    slots.release()
    await asyncio.sleep(0)
    assert order == ["later", "reader"]  # one slot free: it stays kept for demand
    slots.release()
    await asyncio.sleep(0)
    assert order[-1] == "soon"  # of the queued prefetches, the one needed soonest
    slots.promote("late", DEMAND)  # a reader now waits for it: it may take the kept slot
    await asyncio.sleep(0)
    assert order[-1] == "late"
    await asyncio.gather(*tasks, demand)


async def test_a_held_slot_goes_back_once_and_is_taken_again_for_another_get() -> None:
    """A download gives its slot back when its bytes are in, and again when it ends: the
    slot is freed once. A new GET after that (a full disk's retry) waits for a slot."""
    slots = PrioritySlots(1)
    await slots.acquire(DEMAND, "a")
    held = Held(slots)
    held.give_back()
    held.give_back()  # the download ends: nothing more to free
    await slots.acquire(DEMAND, "b")  # the one slot, to another download
    again = asyncio.create_task(held.take(DEMAND, "a"))
    await asyncio.sleep(0.05)
    assert not again.done()  # one slot, and it is taken: freed twice, it would be free
    slots.release()
    await asyncio.wait_for(again, 1)
    held.give_back()
    await asyncio.wait_for(slots.acquire(DEMAND, "c"), 1)


def test_an_open_ahead_waits_for_the_prefetcher_and_never_fetches_by_itself(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    urls = upload(s3_server, bucket, dataset_shards(2, 5))
    cfg = daemon_config(tmp_path, s3_server.endpoint_url, **{"prefetch.lookahead": "0"})
    with thread_daemon(cfg) as d:
        conn = Connection(d.socket)
        ahead = conn.send(
            {"op": "open", "url": urls[1], "stream": "s", "pin": False, "ahead": True}
        )
        time.sleep(0.5)
        # Demand only (lookahead 0): nobody fetched it, and the open ahead still waits.
        assert s3_server.count("GET", f"/{bucket}/") == 0
        assert not conn.has_reply(ahead)
        # The reader gets there and asks as a demand: one download answers both.
        assert conn.request({"op": "open", "url": urls[1], "stream": "s", "pin": False})[0]["ok"]
        assert conn.wait(ahead)[0]["samples"] == 5
    assert s3_server.count("GET", f"/{bucket}/") == 1
