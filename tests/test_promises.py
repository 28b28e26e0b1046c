"""What the docs promise and no other test checked: the RANK/WORLD_SIZE fallback, /readyz
before the hot tier's scan and while draining, DaemonUnavailable when a daemon stops with
no successor, ``[cache] verify_reads = false``, and a resume state of another ``shuffle``.

Real parts: the moto S3 server, real daemons (threads of this process), real ZeroMQ, and
for the slow store a real TCP proxy (tests/faultproxy.py).
"""

from __future__ import annotations

import socket as socketlib
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from cached_client import CachedDataset, DaemonUnavailable, FastLoader
from cached_client.errors import UsageError
from cached_client.partition import resolve_rank
from cached_client.transport import Connection

from cached.config import Config
from cached.daemon import Daemon
from cached.hot.checks import Checks
from cached.hot.tier import HotTier
from cached_demo.stack import daemon_in_thread
from tests.daemon import daemon_config, dataset_shards, thread_daemon
from tests.faultproxy import FaultProxy
from tests.s3server import S3Server
from tests.test_daemon import upload
from tests.test_integrity import (
    flip,
    gets,
    make_shards,
    member_offset,
    metric,
    read_all,
    tar_path,
)
from tests.test_integrity import upload as upload_tars

# -- RANK / WORLD_SIZE when torch.distributed is not initialised (docs: CachedDataset) ---------


def test_rank_and_world_size_come_from_the_environment_without_torch_distributed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Explicit values, else torch.distributed when initialised, else $RANK/$WORLD_SIZE,
    else 0 of 1: a launcher that sets only the environment still partitions the data."""
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized())
    urls = [f"s3://b/s{i}.tar" for i in range(8)]
    socket = "ipc:///nonexistent/cached.sock"  # nothing is asked of a daemon here
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert resolve_rank(None, None) == (0, 1)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert resolve_rank(None, None) == (2, 3)
    assert resolve_rank(0, None) == (0, 3)  # an explicit value wins, the other is found
    ds = CachedDataset(urls, socket=socket)
    assert (ds.rank, ds.world_size) == (2, 3)
    loader = FastLoader(urls, batch_size=2, socket=socket)
    assert (loader.rank, loader.world_size) == (2, 3)
    # A resume state says whose it is: rank 2 of 3.
    state = ds.state_dict()
    assert (state["rank"], state["world_size"]) == (2, 3)
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(UsageError, match=r"rank 3 is not in 0..2"):
        CachedDataset(urls, socket=socket)


def test_ranks_from_the_environment_read_disjoint_parts_that_cover_the_data(
    s3_server: S3Server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    urls = upload(s3_server, bucket, dataset_shards(6, 4))
    seen: list[list[str]] = []
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        monkeypatch.setenv("WORLD_SIZE", "2")
        for rank in ("0", "1"):
            monkeypatch.setenv("RANK", rank)
            seen.append([s["__key__"] for s in CachedDataset(urls, socket=d.socket)])
    assert seen[0] and seen[1] and not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == sorted(
        f"s{s:04d}-{i:05d}" for s in range(6) for i in range(4)
    )


# -- /readyz: not ready before the hot tier's scan, nor while draining (docs/operations.md) ----


def free_port() -> int:
    with socketlib.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def readyz(port: int) -> int | None:
    """/readyz's status code; None where nothing answers (not listening yet, or any more)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def asked(link: FaultProxy) -> bool:
    """Whether the daemon's GET of the shard has reached the store's proxy."""
    return any(r.path.endswith("/shard-0000.tar") for r in link.requests("GET"))


@contextmanager
def daemon_in_background(cfg: Config) -> Iterator[tuple[dict[str, Any], threading.Event]]:
    """Start a daemon without waiting for it to be up; set the event to stop it. Yields
    what it has (``daemon`` once started, ``error``) and that event; joins it at the end."""
    holder: dict[str, Any] = {}
    stop = threading.Event()

    def run() -> None:
        try:
            with daemon_in_thread(cfg, start_timeout_s=60) as (daemon, _loop):
                holder["daemon"] = daemon
                stop.wait()
        except BaseException as exc:
            holder["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield holder, stop
    finally:
        stop.set()
        thread.join(60)
        holder["stopped"] = not thread.is_alive()


def until(check: Any, timeout_s: float = 30.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what or check}"
        time.sleep(0.05)
    return got


def test_readyz_is_not_200_before_the_hot_tier_is_scanned_nor_while_draining(
    s3_server: S3Server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    urls = upload(s3_server, bucket, dataset_shards(1, 4))
    # The scan of the hot tier's directory waits until the test lets it go.
    scanning, scan = threading.Event(), threading.Event()
    load = HotTier.load

    def slow_load(self: HotTier) -> int:
        scanning.set()
        scan.wait(60)
        return load(self)

    monkeypatch.setattr(HotTier, "load", slow_load)
    port = free_port()
    with FaultProxy.start(s3_server.endpoint_url) as link:
        # The shard's GET answers after 30 s: a request under way when the stop comes.
        link.inject("delay", delay_s=30.0, path="shard-0000.tar")
        cfg = daemon_config(tmp_path, link.endpoint_url, **{"server.http": f"127.0.0.1:{port}"})
        with daemon_in_background(cfg) as (holder, stop):
            assert scanning.wait(30), "the daemon never began its scan"
            before = [readyz(port) for _ in range(5) if not time.sleep(0.1)]
            assert all(code != 200 for code in before), before  # None: not listening yet
            scan.set()
            until(lambda: readyz(port) == 200, what="/readyz 200 after the scan")
            until(lambda: "daemon" in holder or "error" in holder, what="the daemon")
            assert "error" not in holder, holder
            daemon: Daemon = holder["daemon"]
            conn = Connection(daemon.server.bound_endpoint)
            conn.send({"op": "open", "url": urls[0], "stream": "s", "pin": False})
            until(lambda: asked(link), what="the shard's GET")
            stop.set()  # SIGTERM's drain: the open waits up to its drain time
            codes: list[int | None] = []
            until(lambda: codes.append(readyz(port)) or codes[-1] != 200, what="/readyz")
            during = codes[-1]
            conn.close()
    assert during == 503  # still listening, and saying: not ready
    assert holder["stopped"]


# -- a daemon that stops with no successor (docs/operations.md, "Shutdown drains") ------------


def test_a_request_the_daemon_stopped_on_fails_with_daemon_unavailable_if_none_comes_back(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """A request answered ``shutting_down`` is kept for the daemon's successor; with none
    within ``dead_after_s`` (15 s for a reader; 2 s here), it raises DaemonUnavailable."""
    urls = upload(s3_server, bucket, dataset_shards(1, 4))
    outcome: dict[str, Any] = {}
    with FaultProxy.start(s3_server.endpoint_url) as link:
        link.inject("delay", delay_s=60.0, path="shard-0000.tar")
        cfg = daemon_config(tmp_path, link.endpoint_url)
        with thread_daemon(cfg) as d:
            conn = Connection(d.socket, dead_after_s=2.0)

            def ask() -> None:
                started = time.monotonic()
                try:
                    outcome["reply"] = conn.request(
                        {"op": "open", "url": urls[0], "stream": "s", "pin": False}
                    )
                except Exception as exc:
                    outcome["error"] = exc
                outcome["after_s"] = time.monotonic() - started

            asker = threading.Thread(target=ask, daemon=True)
            asker.start()
            until(lambda: asked(link), what="the shard's GET")
        # The daemon has stopped (drained, its socket gone) and nothing takes its place.
        asker.join(120)
    assert not asker.is_alive(), "the request still waits for a daemon that is gone"
    assert isinstance(outcome.get("error"), DaemonUnavailable), outcome
    conn.close()


# -- [cache] verify_reads = false (docs/operations.md, "Integrity") -------------------------


def test_verify_reads_off_serves_the_file_as_it_is_and_checks_only_reloaded_shards(
    s3_server: S3Server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off: members are not checked as they are served, so a byte that rots while the
    daemon runs is served (the cost the setting saves); a shard reloaded at start is
    still checked, once, before it is first served."""
    tars, expected = make_shards(2)
    urls = upload_tars(s3_server, bucket, tars)
    cfg = daemon_config(tmp_path, s3_server.endpoint_url, **{"cache.verify_reads": False})
    with thread_daemon(cfg) as d:
        assert read_all(d, urls) == expected
        flip(tar_path(d, urls[1]), member_offset(d, urls[1]))
        rotten = read_all(d, urls)
        assert metric(d, "cached_corrupt_shards_total", found="read") == 0
    assert [k for k in expected if rotten[k] != expected[k]] == ["s001-0003"]  # the flip's
    assert gets(s3_server, bucket, "shard-001.tar") == 1  # not fetched again
    # A restart reloads the shard: checked before it is first served, and fetched again.
    # (Without the check of every reloaded shard in the background, which could come first.)

    async def no_background_check(self: Checks) -> None:
        return None

    monkeypatch.setattr(Checks, "verify_all", no_background_check)
    with thread_daemon(cfg) as d:
        assert read_all(d, urls) == expected
    assert gets(s3_server, bucket, "shard-001.tar") == 2
    assert gets(s3_server, bucket, "shard-000.tar") == 1


# -- a resume state of another shuffle (docs/decisions.md, D20) ------------------------------


def test_a_state_saved_with_another_shuffle_is_refused(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    urls = upload(s3_server, bucket, dataset_shards(4, 5))
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        for loader in ("dataset", "fast"):

            def make(shuffle: bool, loader: str = loader) -> Any:
                if loader == "dataset":
                    return CachedDataset(urls, socket=d.socket, shuffle=shuffle, seed=5)
                return FastLoader(urls, batch_size=2, socket=d.socket, shuffle=shuffle, seed=5)

            for saved_with in (True, False):
                reader = make(saved_with)
                it = iter(reader)
                next(it)  # part-way through the epoch
                state = reader.state_dict()
                del it
                make(saved_with).load_state_dict(state)  # the same reader resumes
                with pytest.raises(
                    UsageError, match=f"shuffle: saved {saved_with}, here {not saved_with}"
                ):
                    make(not saved_with).load_state_dict(state)
