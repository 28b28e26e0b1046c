"""One object's failure is that object's, and every retry is counted.

An object that fails for good (500, or its connection reset, on every try) fails reads of
it alone: other objects, cold ones included, are fetched meanwhile and after, and the
store is not called unreachable. The whole endpoint down is an outage, during which the
hot tier's shards are still served. Retries are counted by reason on every fetch path.

Real parts: moto's S3 server, the fault proxy in front of it, real daemons and readers.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
from cached_client.errors import RemoteError
from cached_client.transport import Connection

from tests.daemon import ThreadDaemon, daemon_config, thread_daemon
from tests.faultproxy import FaultProxy
from tests.s3server import S3Server
from tests.test_integrity import make_shards, metric, read_all, upload, wait_for

REASONS = ("connection", "timeout", "throttled", "server_error", "corrupt")


def open_error(d: ThreadDaemon, url: str) -> str:
    """The error the daemon answers an open of ``url`` with (the test fails if it opens)."""
    conn = Connection(d.socket)
    try:
        with pytest.raises(RemoteError) as failed:
            conn.request({"op": "open", "url": url, "stream": "t"})
    finally:
        conn.close()
    return str(failed.value)


def retries(d: ThreadDaemon) -> dict[str, float]:
    """``cached_fetch_retries_total`` by reason (the reasons with none left out)."""
    counts = {r: metric(d, "cached_fetch_retries_total", reason=r) for r in REASONS}
    return {r: n for r, n in counts.items() if n}


def outage_logged(caplog: pytest.LogCaptureFixture) -> bool:
    return any("is unreachable" in r.message for r in caplog.records)


# --- one bad object -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "said"),
    [
        pytest.param({"kind": "error", "status": 500}, "InternalError", id="500"),
        pytest.param({"kind": "reset"}, "Connection", id="reset"),
    ],
)
def test_one_object_failing_for_good_fails_alone(
    *,
    s3_server: S3Server,
    bucket: str,
    tmp_path: Path,
    proxy: FaultProxy,
    caplog: pytest.LogCaptureFixture,
    fault: dict[str, Any],
    said: str,
) -> None:
    tars, expected = make_shards(7)
    urls = upload(s3_server, bucket, tars)
    bad, good = urls[0], urls[1:]
    # Every request for the bad key fails, its HEADs too; every other one is answered.
    proxy.inject(**fault, method=None, path="/shard-000.tar", times=1_000_000)
    caplog.set_level(logging.WARNING, logger="cached.store_health")
    cfg = daemon_config(tmp_path, proxy.endpoint_url, **{"s3.revalidate_s": 0})
    with thread_daemon(cfg) as d:

        def expected_of(url: str) -> dict[str, str]:
            n = urls.index(url)
            return {k: v for k, v in expected.items() if k.startswith(f"s{n:03d}-")}

        # More failures of the bad object than it takes objects to make an outage.
        for _ in range(4):
            error = open_error(d, bad)
            assert "shard-000.tar" in error and "gave up after 3 attempt(s)" in error
            assert said in error
        assert d.call(d.daemon.fetcher.store_status)["reachable"] is True
        # Cold objects, each needing a GET, are fetched after it...
        assert read_all(d, good[:2]) == {**expected_of(good[0]), **expected_of(good[1])}

        # ... and while it fails again and again, in another thread.
        stop = threading.Event()
        errors: list[str] = []

        def keep_failing() -> None:
            while not stop.is_set():
                errors.append(open_error(d, bad))

        failing = threading.Thread(target=keep_failing)
        failing.start()
        try:
            for url in good[2:]:
                assert read_all(d, [url]) == expected_of(url)
        finally:
            stop.set()
            failing.join()
        assert errors and all("shard-000.tar" in e for e in errors)
        # Three attempts per failed open, no more: nothing retries behind the budget's back.
        assert len([r for r in proxy.requests(None) if r.fault]) == 3 * (4 + len(errors))
        # Resident shards are served too, their revalidating HEADs answered.
        assert read_all(d, good) == {k: v for k, v in expected.items() if not k.startswith("s000")}
        assert d.call(d.daemon.fetcher.store_status)["reachable"] is True
        assert metric(d, "cached_store_reachable") == 1
        reason = "server_error" if fault["kind"] == "error" else "connection"
        # Each failed open: three attempts, two retries.
        assert retries(d) == {reason: 2 * (4 + len(errors))}
    assert not outage_logged(caplog)


# --- the whole endpoint down ----------------------------------------------------------------


@pytest.mark.usefixtures("quick_probe")
def test_the_endpoint_down_is_an_outage_and_resident_shards_are_served(
    s3_server: S3Server,
    bucket: str,
    tmp_path: Path,
    proxy: FaultProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    tars, expected = make_shards(3)
    urls = upload(s3_server, bucket, tars)
    resident = {k: v for k, v in expected.items() if not k.startswith("s002")}
    caplog.set_level(logging.WARNING, logger="cached.store_health")
    cfg = daemon_config(tmp_path, proxy.endpoint_url, **{"s3.revalidate_s": 0})
    with thread_daemon(cfg) as d:
        assert read_all(d, urls[:2]) == resident
        proxy.refuse()
        # A cold shard cannot be fetched; the one failure (no connection at all) is
        # enough to call the store unreachable.
        error = open_error(d, urls[2])
        assert "shard-002.tar" in error and "could not connect" in error.lower()
        status = d.call(d.daemon.fetcher.store_status)
        assert status["reachable"] is False and "could not connect" in status["last_error"].lower()
        assert metric(d, "cached_store_reachable") == 0
        # The hot tier's shards are served as they are, though no revalidation answers.
        for _ in range(2):
            assert read_all(d, urls[:2]) == resident
        assert "unreachable" in open_error(d, urls[2])
        proxy.accept()
        wait_for(lambda: d.call(d.daemon.fetcher.store_status)["reachable"])
        assert read_all(d, urls) == expected
    messages = [r.message for r in caplog.records if r.name == "cached.store_health"]
    assert len(messages) == 2
    assert "(no connection to the endpoint)" in messages[0] and "answers again" in messages[1]


@pytest.mark.usefixtures("quick_probe")
def test_every_object_failing_is_an_outage(
    s3_server: S3Server,
    bucket: str,
    tmp_path: Path,
    proxy: FaultProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The endpoint answers, but 500 to everything: three objects failing in a row, with no
    answer between them, make an outage. It ends when the store answers again, though the
    object that started it still fails."""
    tars, expected = make_shards(5)
    urls = upload(s3_server, bucket, tars)
    caplog.set_level(logging.WARNING, logger="cached.store_health")
    cfg = daemon_config(tmp_path, proxy.endpoint_url, **{"s3.revalidate_s": 0})
    with thread_daemon(cfg) as d:
        first = {k: v for k, v in expected.items() if k < "s001"}
        assert read_all(d, urls[:1]) == first
        proxy.inject("error", status=500, method=None, times=1_000_000)
        # Its revalidating HEAD fails: the resident copy is served as it is.
        assert read_all(d, urls[:1]) == first
        assert "gave up after" in open_error(d, urls[1])
        assert d.call(d.daemon.fetcher.store_status)["reachable"] is True
        assert "gave up after" in open_error(d, urls[2])  # the third object
        assert d.call(d.daemon.fetcher.store_status)["reachable"] is False
        gets = len(proxy.requests("GET"))
        assert "unreachable" in open_error(d, urls[3])  # at once, asking nobody
        assert len(proxy.requests("GET")) == gets
        assert read_all(d, urls[:1]) == first
        proxy.clear()
        proxy.inject("error", status=500, method=None, path="/shard-002.tar", times=1_000_000)
        wait_for(lambda: d.call(d.daemon.fetcher.store_status)["reachable"])
        assert read_all(d, urls[3:]) == {k: v for k, v in expected.items() if k >= "s003"}
        assert "InternalError" in open_error(d, urls[2])
    messages = [r.message for r in caplog.records if r.name == "cached.store_health"]
    assert len(messages) == 2
    assert "(requests for 3 different objects gave up)" in messages[0]


# --- every retry counted --------------------------------------------------------------------


def test_ranged_fetch_counts_every_retry_by_reason(
    s3_server: S3Server, bucket: str, tmp_path: Path, proxy: FaultProxy
) -> None:
    tars, expected = make_shards(2)
    urls = upload(s3_server, bucket, tars)
    part = 16 << 10
    assert len(tars[0]) > 4 * part  # five parts or more
    # Enough attempts for the first part to be cut three times in a row.
    cfg = daemon_config(
        tmp_path, proxy.endpoint_url, **{"s3.part_size": "16KiB", "s3.retry_attempts": 6}
    )
    with thread_daemon(cfg) as d:
        # The opening GET's body is cut mid-body (its first part), then ranged parts
        # are: twice reset mid-body, once reset before any answer. The other shard's
        # opening GET gets a 500, then a 503.
        proxy.inject("cut", after_bytes=5000, path="/shard-000.tar")
        proxy.inject("cut", after_bytes=5000, path="/shard-000.tar", times=2, hard=True)
        proxy.inject("reset", path="/shard-000.tar")
        proxy.inject("error", status=500, path="/shard-001.tar")
        proxy.inject("slowdown", path="/shard-001.tar")
        assert read_all(d, urls) == expected
        assert proxy.faults_left == 0
        gets = proxy.requests("GET")
        assert sum(g.range is not None for g in gets) > 2 * 4
        faults = sorted(g.fault for g in gets if g.fault)
        assert faults == ["cut"] * 3 + ["error", "reset", "slowdown"]
        assert sum(g.range is not None for g in gets if g.fault) >= 3
        assert retries(d) == {"connection": 4, "server_error": 1, "throttled": 1}
        assert metric(d, "cached_fetches_total", tier="warm", result="ok") == 2


@pytest.mark.parametrize("native", [False, True], ids=["botocore", "native"])
@pytest.mark.parametrize("hard", [False, True], ids=["cut", "reset"])
def test_a_single_get_cut_mid_body_is_counted(  # noqa: PLR0917 - fixtures and parameters
    s3_server: S3Server, bucket: str, tmp_path: Path, proxy: FaultProxy, hard: bool, native: bool
) -> None:
    tars, expected = make_shards(1)
    urls = upload(s3_server, bucket, tars)
    cfg = daemon_config(tmp_path, proxy.endpoint_url, **{"s3.native_fetch": native})
    with thread_daemon(cfg) as d:
        proxy.inject("cut", after_bytes=20_000, hard=hard)
        assert read_all(d, urls) == expected
        gets = [(g.range, g.fault) for g in proxy.requests("GET")]
        if native:
            # The CRT's GETs are ranged (its first part covers this shard), and a failed
            # one is asked again whole: a file with a hole cannot resume from its length.
            assert [(r is not None and r.startswith("bytes=0-"), f) for r, f in gets] == [
                (True, "cut"),
                (True, None),
            ]
        else:
            # botocore resumes at the first byte the writer has not seen.
            assert [(r is None, f) for r, f in gets] == [(True, "cut"), (False, None)]
        assert retries(d) == {"connection": 1}


def test_a_revalidating_head_retried_is_counted(
    s3_server: S3Server, bucket: str, tmp_path: Path, proxy: FaultProxy
) -> None:
    tars, expected = make_shards(1)
    urls = upload(s3_server, bucket, tars)
    cfg = daemon_config(tmp_path, proxy.endpoint_url, **{"s3.revalidate_s": 0})
    with thread_daemon(cfg) as d:
        assert read_all(d, urls) == expected
        proxy.inject("slowdown", method="HEAD")
        proxy.inject("reset", method="HEAD")
        assert read_all(d, urls) == expected
        assert proxy.faults_left == 0
        assert retries(d) == {"throttled": 1, "connection": 1}


def test_cold_tier_retries_are_counted(
    s3_server: S3Server, bucket: str, tmp_path: Path, proxy: FaultProxy
) -> None:
    """The cold tier on an endpoint of its own (the proxy): its client counts too."""
    tars, expected = make_shards(1)
    s3_server.put(bucket, "archive/shard-000.tar", tars[0])
    cfg = daemon_config(
        tmp_path,
        s3_server.endpoint_url,
        **{
            "cold.warm_prefix": f"s3://{bucket}/train/",
            "cold.cold_prefix": f"s3://{bucket}/archive/",
            "cold.endpoint_url": proxy.endpoint_url,
        },
    )
    with thread_daemon(cfg) as d:
        proxy.inject("cut", after_bytes=20_000)
        proxy.inject("reset")
        assert read_all(d, [f"s3://{bucket}/train/shard-000.tar"]) == expected
        assert proxy.faults_left == 0
        assert retries(d) == {"connection": 2}
        assert metric(d, "cached_fetches_total", tier="cold", result="ok") == 1
