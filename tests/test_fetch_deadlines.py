"""No internal error from the fetch path (issue 35, point 4): a native GET held at its
headers past its hold (``native.HOLD_S``) is fetched again, counted; the hot tier's waits
each have a deadline and a metric; and the client asks again after a transient error.

Real daemons (a ``cached serve`` process, or one in a thread where the test must reach
its worker pool), real S3 servers, real causes: the request budget holding the body back,
a worker pool busy as MD5 and index jobs keep it, a reader's pin.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from cached_client.transport import Connection

from cached.hot.tier import reservation_bytes
from cached.stores import native
from tests.daemon import (
    ProcessDaemon,
    ThreadDaemon,
    daemon_config,
    dataset_shards,
    serve_config,
    thread_daemon,
)
from tests.s3server import S3Server

pytestmark = pytest.mark.stores


def scrape(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return r.read().decode()


def sample(text: str, name: str, **labels: str) -> float:
    """One sample of a scrape (0 where it is absent)."""
    selector = ",".join(f'{k}="{v}"' for k, v in labels.items())
    found = re.search(rf"^{name}{{{re.escape(selector)}}} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def internal_errors(text: str) -> float:
    return sum(
        float(v)
        for v in re.findall(r'cached_requests_total{op="\w+",result="internal"} (\S+)', text)
    )


def put(s3: S3Server, bucket: str, shards: list[bytes]) -> list[str]:
    for i, body in enumerate(shards):
        s3.put(bucket, f"shard-{i:04d}.tar", body)
    return [f"s3://{bucket}/shard-{i:04d}.tar" for i in range(len(shards))]


def read_all(conn: Connection, url: str, stream: str) -> int:
    """Open ``url``, read every sample (socket or local reads) and close it (its pin goes);
    the samples read."""
    header, _ = conn.request({"op": "open", "url": url, "stream": stream})
    n = int(header["samples"])
    conn.request({"op": "read", "url": url, "stream": stream, "start": 0, "count": n})
    conn.request({"op": "close", "url": url, "stream": stream})
    return n


@pytest.mark.skipif(not native.available(), reason="awscrt's S3 client is not importable")
def test_a_body_held_past_its_hold_is_fetched_again(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """The request budget ([s3] max_requests_per_s 0.15: a request every 6.7 s) holds the
    rest of a 3-part GET back past the 5 s the CRT holds its body: the reader still gets
    its shard, the GET is retried as ``hold_expired``, and no request fails ``internal``
    (it did: "the body was not wanted")."""
    assert native.HOLD_S < 1 / 0.15 - 1
    url = put(s3_server, bucket, dataset_shards(1, 12, payload=1 << 20))[0]
    config, socket = serve_config(
        tmp_path, s3_server.endpoint_url, max_requests_per_s=0.15, part_size="5MiB"
    )
    with ProcessDaemon(config, socket) as daemon:
        conn = Connection(socket)
        try:
            assert read_all(conn, url, "s") == 12
        finally:
            conn.close()
        text = scrape(daemon.status()["http"])
        assert sample(text, "cached_fetch_retries_total", reason="hold_expired") >= 1
        assert internal_errors(text) == 0


def busy_pool(loop: asyncio.AbstractEventLoop, backlog_s: float) -> threading.Event:
    """Keep the daemon's worker pool (the default executor, where MD5, index, publication
    and unlink jobs run) ``backlog_s`` seconds behind, as a fill's MD5 and index jobs do,
    until the event returned is set."""
    stop = threading.Event()
    job_s = 0.25

    async def feed() -> None:
        workers = loop._default_executor._max_workers if loop._default_executor else 6  # type: ignore[attr-defined]
        queued: set[asyncio.Future[None]] = set()
        while not stop.is_set():
            while len(queued) < workers * backlog_s / job_s:
                job = loop.run_in_executor(None, time.sleep, job_s)
                queued.add(job)
                job.add_done_callback(queued.discard)
            await asyncio.sleep(0.05)

    def start() -> None:
        # The pool exists once the daemon has used it (its start does).
        assert loop._default_executor is not None  # type: ignore[attr-defined]
        loop.create_task(feed())

    loop.call_soon_threadsafe(start)
    return stop


def test_an_unlink_behind_a_busy_pool_does_not_cost_the_reader_its_shard(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """A tier with room for two shards; the third evicts the first, whose unlink waits
    6 s behind a busy worker pool. The GET that answered waits 1 s for it, not past its
    5 s hold: its body is dropped, and the bytes come with a new GET once the unlink is
    done. The reader gets its shard; the wait is counted (``cached_hot_wait_seconds``,
    ``cached_hot_wait_timeouts_total{wait="unlink"}``); no hold expired, nothing failed
    ``internal`` (it did: the reservation waited for the unlink with no limit)."""
    shards = dataset_shards(3, 8, payload=256 << 10)
    urls = put(s3_server, bucket, shards)
    capacity = int(2.5 * reservation_bytes(max(map(len, shards))))
    cfg = daemon_config(tmp_path, s3_server.endpoint_url, **{"cache.capacity": capacity})
    with thread_daemon(cfg) as d:
        conn = Connection(d.socket)
        try:
            for url in urls[:2]:
                assert read_all(conn, url, "s") == 8
            stop = busy_pool(d.loop, backlog_s=6.0)
            try:
                time.sleep(1.0)  # the backlog builds up
                started = time.monotonic()
                assert read_all(conn, urls[2], "s") == 8
                took = time.monotonic() - started
            finally:
                stop.set()
        finally:
            conn.close()
        text = scrape(d.daemon.http.url)
        assert took > native.HOLD_S  # the pool was that busy
        assert sample(text, "cached_hot_wait_timeouts_total", wait="unlink") >= 1
        assert sample(text, "cached_hot_wait_seconds_count", wait="unlink") >= 1
        assert sample(text, "cached_fetch_retries_total", reason="hold_expired") == 0
        assert internal_errors(text) == 0


def pins(d: ThreadDaemon) -> int:
    d.call(d.daemon.hot.check)
    count: int = d.call(lambda: d.daemon.hot.stats().pinned)
    return count


def test_the_client_asks_again_after_a_transient_error(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """A tier with room for one shard, held by another reader's pin past ``pin_wait_s``
    (0.3 s): the open is answered ``cache_full``. The pin goes 0.6 s later; the client
    asks again (after 0.5 s, then 1 s) and gets the shard, where it raised before."""
    shards = dataset_shards(2, 4, payload=64 << 10)
    urls = put(s3_server, bucket, shards)
    capacity = int(1.5 * reservation_bytes(max(map(len, shards))))
    cfg = daemon_config(
        tmp_path, s3_server.endpoint_url, **{"cache.capacity": capacity, "cache.pin_wait_s": 0.3}
    )
    with thread_daemon(cfg) as d:
        holder, waiter = Connection(d.socket), Connection(d.socket)
        try:
            holder.request({"op": "open", "url": urls[0], "stream": "holder"})
            assert pins(d) == 1
            result: dict[str, Any] = {}

            def open_second() -> None:
                try:
                    result["reply"] = waiter.request({"op": "open", "url": urls[1], "stream": "w"})[
                        0
                    ]
                except Exception as exc:  # reported by the assertion below
                    result["error"] = exc

            thread = threading.Thread(target=open_second)
            thread.start()
            time.sleep(0.6)
            holder.request({"op": "close", "url": urls[0], "stream": "holder"})
            thread.join(30)
        finally:
            holder.close()
            waiter.close()
        assert "error" not in result, result
        assert result["reply"]["samples"] == 4
        text = scrape(d.daemon.http.url)
        assert sample(text, "cached_requests_total", op="open", result="cache_full") >= 1
