"""One daemon per hot tier directory (cached/lock.py): a second daemon on the same directory
is refused before it touches anything in it; a killed daemon's successor starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cached_client import CachedDataset

from cached.errors import CachedError
from cached.lock import LOCK_NAME, DirectoryInUse, DirLock
from tests.daemon import ProcessDaemon, dataset_shards, serve_config, write_config
from tests.s3server import S3Server


def test_the_lock_is_exclusive_within_one_process_too(tmp_path: Path) -> None:
    first = DirLock(tmp_path / "hot")
    with first:
        assert (tmp_path / "hot" / LOCK_NAME).read_text() == f"{os.getpid()}\n"
        with pytest.raises(DirectoryInUse, match=f"PID {os.getpid()}"):
            DirLock(tmp_path / "hot").acquire()
    with DirLock(tmp_path / "hot"):  # released on exit
        pass


def test_a_directory_that_cannot_hold_the_lock_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(CachedError, match=r"cannot use the hot tier directory .*a-file/hot"):
        DirLock(tmp_path / "a-file" / "hot").acquire()


def second_serve(directory: Path, endpoint_url: str, hot: Path) -> tuple[Path, str]:
    """Another daemon's config: its own socket and a smaller capacity, ``hot`` as its dir."""
    socket = f"ipc://{directory}/second.sock"
    config = write_config(
        directory / "second.toml",
        {
            "server": {"socket": socket, "http": "127.0.0.1:0"},
            "cache": {"dir": str(hot), "capacity": "1KiB", "min_free": "0"},
            "s3": {"endpoint_url": endpoint_url},
        },
    )
    return config, socket


def test_a_second_daemon_on_the_same_directory_is_refused_and_touches_nothing(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    for i, body in enumerate(dataset_shards(3, 10, payload=1000)):
        s3_server.put(bucket, f"s-{i}.tar", body)
    urls = [f"s3://{bucket}/s-{i}.tar" for i in range(3)]
    hot = tmp_path / "hot"
    first = ProcessDaemon(*serve_config(tmp_path, s3_server.endpoint_url)).start()
    try:
        assert len(list(CachedDataset(urls, socket=first.socket))) == 30
        partial = hot / "0000download.tar.partial"  # a download under way, as it would be
        partial.write_bytes(b"half a shard")
        before = sorted(p.name for p in hot.iterdir())
        assert len([n for n in before if n.endswith(".tar")]) == 3

        # Another socket and a capacity that fits none of the first daemon's shards: before
        # the lock it deleted the partial file at start and evicted the shards to fit.
        config, _ = second_serve(tmp_path, s3_server.endpoint_url, hot)
        done = subprocess.run(
            [sys.executable, "-m", "cached", "serve", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        assert done.stderr.count("cached: error:") == 1 and done.stderr.endswith("\n")
        line = done.stderr.strip().splitlines()[-1]
        assert line.startswith("cached: error: another cached daemon"), line
        assert first.proc is not None and f"PID {first.proc.pid}" in line
        assert str(hot) in line and "[cache] dir" in line

        assert sorted(p.name for p in hot.iterdir()) == before
        assert partial.read_bytes() == b"half a shard"
        assert first.status()["hot"]["shards"] == 3  # and it still serves
    finally:
        first.stop(signal.SIGKILL)

    # The kernel dropped the dead daemon's lock: its successor starts on the directory.
    config, socket = second_serve(tmp_path, s3_server.endpoint_url, hot)
    with ProcessDaemon(config, socket) as successor:
        assert successor.status()["ready"]
        assert successor.proc is not None
        assert (hot / LOCK_NAME).read_text() == f"{successor.proc.pid}\n"
    assert not partial.exists()  # now it may clean up: nobody else uses the directory
