"""Whole reads (D33): a local reader reads a shard it has opened before with one request,
no open; asked only of a resident shard, and asked again as a demand where it is not.

Real parts: the moto S3 server, a real daemon, real ZeroMQ, the shard files read locally.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import zmq
from cached_client import FastLoader
from cached_client.errors import RemoteError
from cached_client.transport import Connection
from cached_wire.protocol import decode, encode

import cached.server.dispatch
from tests.daemon import ThreadDaemon, daemon_config, dataset_shards, thread_daemon
from tests.s3server import S3Server
from tests.test_daemon import upload
from tests.test_local_reads import expected


def _requests(d: ThreadDaemon) -> Counter[tuple[str, str]]:
    """The daemon's requests so far, by (op, result)."""
    metric = d.daemon.server.metrics.requests
    return Counter(
        {
            (s.labels["op"], s.labels["result"]): int(s.value)
            for family in metric.collect()
            for s in family.samples
            if s.name.endswith("_total")
        }
    )


def _counter(d: ThreadDaemon, name: str) -> float:
    return float(d.call(lambda: d.daemon.status()["counters"][name]))


def _epoch(loader: FastLoader, epoch: int) -> dict[str, bytes]:
    loader.set_epoch(epoch)
    got: dict[str, bytes] = {}
    for batch in loader:
        data, offs = batch.data["bin"].numpy(), batch.offsets["bin"]
        for i, key in enumerate(batch.keys):
            assert key not in got, f"{key} twice"
            got[key] = data[offs[i] : offs[i + 1]].tobytes()
    return got


@pytest.mark.parametrize("fits", [True, False], ids=["fits", "tier-of-3-shards"])
def test_a_later_epoch_reads_each_shard_with_one_request_and_no_open(
    s3_server: S3Server, bucket: str, tmp_path: Path, fits: bool
) -> None:
    """The second epoch sends no open: each shard is one whole read, counted as a hit
    where the shard is resident. Where the tier holds three shards of six, most are not
    resident when their read goes out: each is asked again as a demand, and every sample
    still comes once, with no pin left behind."""
    shards = dataset_shards(6, 20, payload=5000)
    urls = upload(s3_server, bucket, shards)
    want = expected(shards, 20, 5000)
    tar = max(map(len, shards))
    extra = {} if fits else {"cache.capacity": 3 * tar + 4096, "cache.min_free": 0}
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url, **extra)) as d:
        loader = FastLoader(urls, socket=d.socket, batch_size=16, exts=["bin"], shuffle=True)
        assert _epoch(loader, 0) == want
        before, hits = d.call(lambda: _requests(d)), _counter(d, "hits")
        assert _epoch(loader, 1) == want
        after, hits_after = d.call(lambda: _requests(d)), _counter(d, "hits")
        leases = d.leases_left()
        served, local = d.served()
    assert after[("open", "ok")] == before[("open", "ok")]  # no open in the second epoch
    reads = after[("read", "ok")] - before[("read", "ok")]
    if fits:
        assert reads == len(urls)  # one request per shard
        assert hits_after - hits == len(urls)
    else:
        assert len(urls) < reads <= 2 * len(urls)  # the ones not resident: asked twice
    assert leases == 0
    assert served == local == 2 * sum(map(len, want.values()))


def test_a_shard_that_grew_in_the_store_is_read_whole_in_its_new_version(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """A whole read takes the number of samples from the daemon's index, not from the
    open the reader remembers, and is revalidated as an open is: a shard replaced by one
    with more samples is read whole, new."""
    old = dataset_shards(2, 10, payload=3000)
    new = dataset_shards(2, 25, payload=3000, prefix="n")
    urls = upload(s3_server, bucket, old)
    cfg = daemon_config(tmp_path, s3_server.endpoint_url, **{"s3.revalidate_s": 0.2})
    with thread_daemon(cfg) as d:
        loader = FastLoader(urls, socket=d.socket, batch_size=8, exts=["bin"])
        assert _epoch(loader, 0) == expected(old, 10, 3000)
        upload(s3_server, bucket, new)
        time.sleep(0.3)
        before = d.call(lambda: _requests(d))
        got = _epoch(loader, 1)
        after = d.call(lambda: _requests(d))
    assert after[("open", "ok")] == before[("open", "ok")]
    keys = [f"n{s:04d}-{i:05d}" for s in range(2) for i in range(25)]
    assert got == {k: (k.encode() * (3000 // len(k) + 1))[:3000] for k in keys}


def _raw_read(endpoint: str, **fields: Any) -> dict[str, Any]:
    """One read on a socket of its own, its reply as the daemon sent it (a Connection
    would ask a not-resident whole read again)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(encode({"op": "read", "stream": "t", "id": 1, **fields}))
        assert sock.poll(10_000), "no reply"
        reply: dict[str, Any] = decode(sock.recv_multipart()[0])
        return reply
    finally:
        sock.close()


def _read(conn: Connection, **fields: Any) -> dict[str, Any]:
    header, _ = conn.request({"op": "read", "stream": "t", **fields})
    return header


def test_a_whole_read_asked_only_if_resident_fetches_nothing_and_is_refused_when_malformed(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    shards = dataset_shards(2, 10, payload=3000)
    urls = upload(s3_server, bucket, shards)
    cfg = daemon_config(tmp_path, s3_server.endpoint_url, **{"server.max_read_samples": 8})
    with thread_daemon(cfg) as d:
        # Not resident: said at once, nothing fetched, nothing pinned, no miss counted.
        reply = _raw_read(d.socket, url=urls[0], start=0, whole=True, if_resident=True)
        assert reply["ok"] is True and reply["resident"] is False and "samples" not in reply
        assert d.call(lambda: d.daemon.hot.stats().shards) == 0
        assert d.call(lambda: len(d.daemon.server.leases._held)) == 0
        assert _counter(d, "misses") == 0
        conn = Connection(d.socket, local_reads=False)
        # Through the socket a whole read may not carry more than max_read_samples.
        with pytest.raises(RemoteError, match="more than one read through the socket"):
            _read(conn, url=urls[0], start=0, whole=True)
        with pytest.raises(RemoteError, match="a whole read starts at sample 0"):
            _read(conn, url=urls[0], start=3, whole=True)
        conn.close()
        local = Connection(d.socket)
        reply = _read(local, url=urls[1], start=0, whole=True)  # a demand: fetched
        assert reply["end"] is True and len(reply["samples"]) == 10 and "local" in reply
        local.close()


def test_a_daemon_without_whole_reads_is_sent_opens(
    s3_server: S3Server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An older daemon (no "whole" in its hello's features) gets an open per shard, as
    before D33."""
    monkeypatch.setattr(cached.server.dispatch, "FEATURES", ("release",))
    shards = dataset_shards(3, 10, payload=3000)
    urls = upload(s3_server, bucket, shards)
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        loader = FastLoader(urls, socket=d.socket, batch_size=8, exts=["bin"])
        _epoch(loader, 0)
        before = d.call(lambda: _requests(d))
        assert _epoch(loader, 1) == expected(shards, 10, 3000)
        after = d.call(lambda: _requests(d))
    # One per shard at least (an open ahead not answered yet is asked again as a demand).
    assert after[("open", "ok")] - before[("open", "ok")] >= len(urls)
    assert after[("read", "ok")] - before[("read", "ok")] == len(urls)
