"""The ``cached`` command as a user runs it: serve, status, prefetch; the admin HTTP app."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon import ProcessDaemon, dataset_shards, serve_config
from tests.s3server import S3Server


def cached(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cached", *args],
        capture_output=True,
        check=False,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def served(s3_server: S3Server, bucket: str, tmp_path: Path) -> Iterator[tuple[ProcessDaemon, str]]:
    for i, body in enumerate(dataset_shards(3, 10, payload=1000)):
        s3_server.put(bucket, f"p-{i}.tar", body)
    daemon = ProcessDaemon(*serve_config(tmp_path, s3_server.endpoint_url)).start()
    try:
        yield daemon, bucket
    finally:
        assert daemon.stop() == 0, daemon.log.read_text()


def test_prefetch_status_and_http(served: tuple[ProcessDaemon, str]) -> None:
    daemon, bucket = served
    cfg = str(daemon.config)
    done = cached("prefetch", "--config", cfg, f"s3://{bucket}/p-{{0..2}}.tar")
    assert done.returncode == 0, done.stderr
    assert "3/3" in done.stderr  # the progress bar
    status = json.loads(cached("status", "--config", cfg, "--json").stdout)
    assert status["hot"]["shards"] == 3 and status["counters"]["misses"] == 3
    text = cached("status", "--config", cfg).stdout
    assert "3 shards" in text and "3 misses" in text
    assert "warm 3 fetches" in text and "cold 0 fetches" in text and "0 plans" in text

    http = status["http"]
    with urllib.request.urlopen(f"{http}/metrics") as r:
        metrics = r.read().decode()
    assert "cached_misses_total" in metrics and "cached_hot_bytes" in metrics
    assert 'cached_fetched_bytes_total{tier="warm"}' in metrics
    with urllib.request.urlopen(f"{http}/healthz") as r:
        assert json.load(r) == {"ok": True}
    with urllib.request.urlopen(f"{http}/readyz") as r:
        assert json.load(r) == {"ready": True}
    with urllib.request.urlopen(f"{http}/status") as r:
        assert json.load(r)["hot"]["shards"] == 3

    missing = cached(
        "prefetch", "--config", cfg, f"s3://{bucket}/p-0.tar", f"s3://{bucket}/gone.tar"
    )
    assert missing.returncode == 1
    assert f"s3://{bucket}/gone.tar" in missing.stderr


def test_second_daemon_on_the_same_socket_refuses(served: tuple[ProcessDaemon, str]) -> None:
    daemon, _ = served
    done = cached("serve", "--config", str(daemon.config), timeout=30)
    assert done.returncode == 2
    assert "already serving" in done.stderr
    assert cached("status", "--config", str(daemon.config)).returncode == 0  # still alive


def test_status_without_a_daemon(tmp_path: Path) -> None:
    done = cached("status", "--socket", f"ipc://{tmp_path}/none.sock")
    assert done.returncode == 2
    assert (
        f"cannot reach the cached daemon at ipc://{tmp_path}/none.sock; is `cached serve` running?"
    ) in done.stderr


def test_serve_with_a_bad_config_fails_naming_file_and_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[cache]\ncapacity = "a lot"\n')
    done = cached("serve", "--config", str(bad))
    assert done.returncode == 2
    assert str(bad) in done.stderr and "[cache] capacity" in done.stderr


def test_status_and_prefetch_honour_cached_socket(
    served: tuple[ProcessDaemon, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the client library does: no --socket and no config, but $CACHED_SOCKET."""
    daemon, bucket = served
    monkeypatch.setenv("CACHED_SOCKET", daemon.socket)
    monkeypatch.setenv("CACHED_CONFIG", "/nonexistent/config.toml")  # must not be needed
    assert cached("prefetch", f"s3://{bucket}/p-0.tar").returncode == 0
    done = cached("status", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["socket"] == daemon.socket


def test_status_into_a_closed_pipe_exits_quietly(served: tuple[ProcessDaemon, str]) -> None:
    """`cached status | head`: the reader is gone before the output; no traceback."""
    daemon, _ = served
    read, write = os.pipe()
    os.close(read)  # the reader went away first
    try:
        done = subprocess.run(
            [sys.executable, "-m", "cached", "status", "--socket", daemon.socket],
            stdout=write,
            stderr=subprocess.PIPE,
            check=False,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write)
    assert done.returncode == 141
    assert done.stderr == ""
