"""The ``cached`` command as a user runs it: serve, status, prefetch; the admin HTTP app."""

from __future__ import annotations

import json
import os
import re
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
    assert re.search(r"fds +\d+ open, limit \d+ \(hard \d+\), \d+ in reserve", text), text
    assert "connections (at most 2048, 512 a user)" in text, text

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
        anonymous = json.load(r)
    assert anonymous["hot"]["shards"] == 3
    # No user is known over HTTP: nobody's connections are listed by user there.
    assert anonymous["descriptors"]["connections_by_user"] == {}
    assert status["descriptors"]["connections_by_user"]  # root sees its own (and all)

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
        f"cannot reach the cached daemon at ipc://{tmp_path}/none.sock; no socket at "
        f"{tmp_path}/none.sock; is `cached serve` running?"
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


def no_dac_override() -> list[str]:
    """A command prefix under which file permissions apply even to root: root normally
    bypasses them (CAP_DAC_OVERRIDE), which would hide a permission error."""
    if os.geteuid() != 0:
        return []
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]


def test_a_user_without_permission_on_the_socket_is_told_so(
    served: tuple[ProcessDaemon, str],
) -> None:
    """Not "is `cached serve` running?": the daemon runs, the user may not connect."""
    daemon, _ = served
    path = daemon.socket[len("ipc://") :]
    os.chmod(path, 0o000)
    try:
        done = subprocess.run(
            [*no_dac_override(), sys.executable, "-m", "cached", "status"],
            env={**os.environ, "CACHED_SOCKET": daemon.socket},
            capture_output=True,
            check=False,
            text=True,
            timeout=60,
        )
    finally:
        os.chmod(path, 0o777)
    assert done.returncode == 2
    assert f"permission denied on {path} (s---------" in done.stderr, done.stderr
    assert "ask the administrator to add you to the socket's group" in done.stderr
    assert "is `cached serve` running" not in done.stderr
    assert cached("status", "--socket", daemon.socket).returncode == 0  # the daemon is fine


def one_line_failure(done: subprocess.CompletedProcess[str]) -> str:
    """The error line of a failed start, after checking it is the only one, not a traceback."""
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("cached: error:")]
    assert len(errors) == 1, done.stderr
    return errors[0]


def serve_args(tmp_path: Path, **flags: str) -> list[str]:
    values = {
        "socket": f"ipc://{tmp_path}/cached.sock",
        "http": "127.0.0.1:0",
        "cache-dir": str(tmp_path / "hot"),
        "capacity": "1GiB",
        # Nothing is fetched: these daemons fail before, or are stopped at once.
        "endpoint-url": "http://127.0.0.1:9",
    } | flags
    return ["serve", "--config", "/dev/null", *(f"--{k}={v}" for k, v in values.items())]


def test_startup_failures_are_one_line(tmp_path: Path) -> None:
    """An uncreatable hot tier, a socket directory that cannot be made, a busy HTTP port."""
    (tmp_path / "a-file").write_text("")
    line = one_line_failure(
        cached(*serve_args(tmp_path, **{"cache-dir": f"{tmp_path}/a-file/hot"}))
    )
    assert f"cannot use the hot tier directory {tmp_path}/a-file/hot ([cache] dir)" in line
    assert "Not a directory" in line

    socket = f"ipc://{tmp_path}/a-file/run/cached.sock"
    line = one_line_failure(cached(*serve_args(tmp_path, socket=socket)))
    assert f"cannot create the socket's directory {tmp_path}/a-file/run" in line

    import socket as sockets

    with sockets.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        line = one_line_failure(cached(*serve_args(tmp_path, http=address)))
    assert f"cannot listen for HTTP on {address} ([server] http)" in line
    assert "address already in use" in line.lower()


def test_a_capacity_above_the_disk_warns_at_start(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        f'[server]\nsocket = "ipc://{tmp_path}/cached.sock"\nhttp = "127.0.0.1:0"\n'
        f'[cache]\ndir = "{tmp_path}/hot"\ncapacity = "100000TiB"\n'
        '[s3]\nendpoint_url = "http://127.0.0.1:9"\n'
    )
    with ProcessDaemon(config, f"ipc://{tmp_path}/cached.sock") as daemon:
        log = daemon.log_tail()
    assert "WARNING" in log and "[cache] capacity 100000.0 TiB is more than the" in log, log
    assert f"file system holding {tmp_path}/hot" in log


def test_demo_without_the_demo_extra_says_what_to_install() -> None:
    """moto hidden from the import system, as in an install without the `demo` extra."""
    hide_moto = (
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'moto': raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "from cached.cli import main\n"
        "main(['demo'])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", hide_moto], capture_output=True, check=False, text=True, timeout=60
    )
    line = one_line_failure(done)
    assert "`cached demo` needs moto, which is not installed" in line
    assert "pip install 'cached-daemon[demo]'" in line
