"""The daemon under a service manager: what it tells systemd (sd_notify) and the process
metrics an operator reads. ``cached serve`` runs as a real subprocess; the notify socket is a
real unix datagram socket, as systemd's is. (The unit itself, under a real systemd, is
``make deploy-check``.)"""

from __future__ import annotations

import os
import signal
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from cached.systemd import Notifier
from tests.daemon import ProcessDaemon, serve_config
from tests.s3server import S3Server


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    sock.settimeout(0.2)
    try:
        yield sock
    finally:
        sock.close()


def messages_until(sock: socket.socket, deadline_s: float, until: str) -> list[str]:
    """Datagrams received (each split into its lines) until one line equals ``until``."""
    lines: list[str] = []
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            lines += sock.recv(4096).decode().splitlines()
        except TimeoutError:
            continue
        if until in lines:
            return lines
    pytest.fail(f"no {until} within {deadline_s}s; got {lines}")


def test_ready_status_watchdog_and_stopping(
    s3_server: S3Server, tmp_path: Path, notify_socket: socket.socket
) -> None:
    config, endpoint = serve_config(tmp_path, s3_server.endpoint_url)
    env = {
        "NOTIFY_SOCKET": notify_socket.getsockname(),
        # WatchdogSec=0.4s: a ping every 0.2 s, as systemd's sd_watchdog_enabled advises.
        "WATCHDOG_USEC": "400000",
    }
    daemon = ProcessDaemon(config, endpoint, env=env).start()
    try:
        lines = messages_until(notify_socket, 30, "READY=1")
        assert lines[0].startswith("STATUS=loading the hot tier from "), lines
        status = [line for line in lines if line.startswith("STATUS=serving: ")]
        assert status == ["STATUS=serving: 0 shards, 0 B of 1.0 GiB, 0 streams, 0 fetching"]

        start = time.monotonic()
        pings = 0
        while pings < 5:
            pings += messages_until(notify_socket, 2, "WATCHDOG=1").count("WATCHDOG=1")
        per_ping = (time.monotonic() - start) / pings
        assert 0.05 < per_ping < 0.4, per_ping  # ~0.2 s; a loaded machine is slower

        http = daemon.status()["http"]
        with urllib.request.urlopen(f"{http}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        for name in ("process_start_time_seconds", "process_open_fds", "process_max_fds"):
            assert f"\n{name} " in metrics, name
        assert "python_info{" in metrics
    finally:
        assert daemon.stop(signal.SIGTERM) == 0, daemon.log_tail()
    assert "STOPPING=1" in messages_until(notify_socket, 10, "STOPPING=1")


def test_notifier_outside_systemd_and_for_another_process(tmp_path: Path) -> None:
    assert not Notifier({}).enabled
    Notifier({}).notify("READY=1")  # a no-op, no error
    # systemd names the process that must ping; a child the daemon started must not.
    other = Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"})
    assert other.watchdog_interval_s is None
    own = {"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())}
    assert Notifier(own).watchdog_interval_s == 0.5
    # A notify socket that went away loses the message, never the daemon.
    Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")}).notify("STATUS=x")


def test_notifier_reaches_an_abstract_socket() -> None:
    """systemd may pass ``@name``: an abstract unix socket."""
    name = f"cached-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        Notifier({"NOTIFY_SOCKET": "@" + name}).notify("READY=1", "STATUS=serving")
        assert sock.recv(100) == b"READY=1\nSTATUS=serving"
