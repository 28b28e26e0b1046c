"""Descriptors as a budget (issue 35): a connection flood from another local user leaves
the daemon serving everyone else, connections are capped per user and in total, shard
files open for socket reads are a bounded LRU, and the limit is raised and shown.

Real parts: ``cached serve`` as a subprocess under ``prlimit``, the hostile client as
another uid (a forked child that drops to ``nobody``), real unix-socket and ZeroMQ
connections, the moto S3 server.
"""

from __future__ import annotations

import os
import resource
import socket
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import zmq
from cached_client import CachedDataset
from cached_client.transport import Connection

from cached.descriptors import Budget
from cached.errors import ConfigError
from tests.daemon import ProcessDaemon, dataset_shards, write_config
from tests.hostile import as_other_user, close_inherited
from tests.s3server import S3Server
from tests.test_daemon import upload

NOBODY = 65534
# The flood test's descriptor limit and connections. At 512 (a reserve of 83) a flood at
# 17,000 connections a second outran the accept thread in 2 of 6 runs on this loaded
# 2-core machine; at 4096 (a reserve of 980) none of 10 did, two busy loops beside it.
LIMIT, FLOOD = 4096, 8000

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as another uid")


class LimitedDaemon(ProcessDaemon):
    """``cached serve`` under ``prlimit --nofile=SOFT:HARD``."""

    def __init__(self, *args: Any, nofile: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.nofile = nofile

    def command(self) -> list[str]:
        return ["prlimit", f"--nofile={self.nofile}", *super().command()]

    def open_fds(self) -> int:
        assert self.proc is not None
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))


def config(directory: Path, endpoint_url: str = "http://127.0.0.1:1", **sections: Any) -> Path:
    directory.chmod(0o755)  # another uid reaches the socket
    server = {
        "socket": f"ipc://{directory}/cached.sock",
        "http": "127.0.0.1:0",
        "socket_mode": "0666",
        **sections.pop("server", {}),
    }
    cache = {"dir": str(directory / "hot"), "capacity": "1GiB", "min_free": "0"}
    cache.update(sections.pop("cache", {}))
    s3 = {"endpoint_url": endpoint_url, "retry_attempts": 2, "retry_base_delay_s": 0.01}
    return write_config(directory / "config.toml", {"server": server, "cache": cache, "s3": s3})


@pytest.fixture
def public(public_dir: Path) -> Path:
    return public_dir


def status(sock: str) -> dict[str, Any]:
    conn = Connection(sock, connect_timeout_s=5.0)
    conn.open()
    try:
        header, _ = conn.request({"op": "status"})
        result: dict[str, Any] = header["status"]
        return result
    finally:
        conn.close()


def by_user(sock: str) -> dict[str, int]:
    result: dict[str, int] = status(sock)["descriptors"]["connections_by_user"]
    return result


@contextmanager
def as_nobody(
    hold_s: float, connections: int, path: Path, zmq_sockets: bool = False
) -> Iterator[int]:
    """A child process as uid nobody that opens ``connections`` connections to the socket
    at ``path`` (or ``tcp:HOST:PORT``) as fast as it can and holds them for ``hold_s``;
    yields its pid once it has opened them all."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # never returns into pytest
        try:
            os.close(read)
            close_inherited(write)  # the limit below counts this child's own descriptors
            resource.setrlimit(resource.RLIMIT_NOFILE, (connections + 64, connections + 64))
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            held: list[Any] = []
            if zmq_sockets:
                ctx = zmq.Context()
                for _ in range(connections):
                    s = ctx.socket(zmq.DEALER)
                    s.connect(f"ipc://{path}")
                    held.append(s)
            else:
                tcp = str(path).startswith("tcp:")
                for _ in range(connections):
                    s = socket.socket(socket.AF_INET if tcp else socket.AF_UNIX)
                    try:
                        if tcp:
                            _, host, port = str(path).split(":")
                            s.connect((host, int(port)))
                        else:
                            s.connect(str(path))
                    except OSError:
                        s.close()
                        continue
                    held.append(s)
            os.write(write, b"!")  # all of them opened (or refused)
            time.sleep(hold_s)
        finally:
            os._exit(0)
    os.close(write)
    try:
        os.read(read, 1)  # the flood is on
        yield pid
    finally:
        os.close(read)
        os.waitpid(pid, 0)


def test_a_connection_flood_from_another_user_leaves_the_daemon_serving(
    public: Path,
) -> None:
    """8,000 connections from another uid, opened as fast as a process can, against a
    daemon whose descriptor limit is 4096: it shuts what passes the caps, so it neither
    aborts (libzmq's EMFILE assertion, as before) nor refuses its other users, and the
    descriptors come back once the flood ends."""
    cfg = config(public)
    sock = f"ipc://{public}/cached.sock"
    with LimitedDaemon(cfg, sock, nofile=f"{LIMIT}:{LIMIT}") as d:
        before = d.open_fds()
        good = Connection(sock, connect_timeout_s=5.0)
        good.open()
        with as_nobody(2.0, FLOOD, public / "cached.sock"):
            time.sleep(0.2)
            assert d.proc is not None and d.proc.poll() is None, d.log_tail()
            during = status(sock)["descriptors"]
        assert d.proc.poll() is None, d.log_tail()
        header, _ = good.request({"op": "status"})  # an old connection carries on
        assert header["status"]["ready"]
        good.close()
        after = status(sock)["descriptors"]
        deadline = time.monotonic() + 10
        while d.open_fds() > before + 8 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert d.open_fds() <= before + 8
    assert during["connections_refused"] > 0
    # nobody's kept connections never passed its cap (at this limit, a share of 512)
    assert during["max_connections_per_user"] < during["max_connections"] < LIMIT
    assert 0 < during["connections_by_user"]["uid 65534"] <= during["max_connections_per_user"]
    assert after["connections_refused"] >= during["connections_refused"]
    assert "Too many open files" not in d.log_tail()


def test_connections_past_a_users_cap_are_shut_and_other_users_connect(public: Path) -> None:
    """With max_connections_per_user = 4, another uid's fifth and later ZeroMQ connections
    are shut as they are accepted; the daemon's own user still connects and is served."""
    cfg = config(public, server={"max_connections_per_user": 4, "max_connections": 64})
    sock = f"ipc://{public}/cached.sock"
    with ProcessDaemon(cfg, sock) as d:
        with as_nobody(2.0, 12, public / "cached.sock", zmq_sockets=True):
            time.sleep(1.0)  # ZeroMQ connects in the background
            seen = status(sock)["descriptors"]
        assert seen["max_connections_per_user"] == 4
        assert seen["connections_by_user"]["uid 65534"] == 4, seen
        assert seen["connections_refused"] >= 8, seen
        assert "uid 65534 has 4 connections open" in d.log_tail()
        # Another user's status shows its own connections, not who else is connected.
        held = Connection(sock, connect_timeout_s=5.0)
        held.open()
        try:
            theirs = as_other_user(sock, [{"op": "status"}])[0]["status"]["descriptors"]
        finally:
            held.close()
        assert set(theirs["connections_by_user"]) <= {"uid 65534"}, theirs
        deadline = time.monotonic() + 5
        while "uid 65534" in by_user(sock) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "uid 65534" not in by_user(sock)  # nobody's are gone with its process


def test_the_soft_limit_is_raised_to_the_hard_one_and_shown(public: Path) -> None:
    cfg = config(public)
    sock = f"ipc://{public}/cached.sock"
    with LimitedDaemon(cfg, sock, nofile="1024:8192") as d:
        seen = status(sock)["descriptors"]
        with open(f"/proc/{d.proc.pid}/limits") as f:  # type: ignore[union-attr]
            line = next(x for x in f if x.startswith("Max open files"))
    assert seen["soft_limit"] == 8192 and seen["hard_limit"] == 8192
    assert line.split()[3:5] == ["8192", "8192"]
    assert seen["reserve"] >= 1024  # a quarter of what the holders leave


def test_a_limit_too_low_to_serve_is_one_line_at_start(public: Path) -> None:
    cfg = config(public)
    sock = f"ipc://{public}/cached.sock"
    d = LimitedDaemon(cfg, sock, nofile="128:128")
    with pytest.raises(RuntimeError) as exc:
        d.start(timeout_s=20)
    assert "raise it to at least" in str(exc.value)
    assert "LimitNOFILE=" in str(exc.value)


def plan_at(limit: int) -> Budget:
    """The budget of a limit, with 40 open, 160 for the pools and the default caps."""
    return Budget.plan(
        limit,
        40,
        fixed=160,
        max_connections=2048,
        max_connections_per_user=512,
        max_open_files=1024,
        max_http_connections=64,
    )


def test_the_budget_shares_a_short_limit_in_proportion() -> None:
    b = plan_at(512)
    used = 40 + 160 + b.connections + b.shard_files + b.http_connections
    assert used + b.reserve <= 512
    assert b.connections_per_user < b.connections
    assert b.refuse_from > used
    roomy = plan_at(65536)
    assert (roomy.connections, roomy.connections_per_user, roomy.shard_files) == (2048, 512, 1024)
    assert roomy.reserve > 10_000
    with pytest.raises(ConfigError, match="LimitNOFILE="):
        plan_at(100)


def test_many_resident_shards_read_through_the_socket_stay_under_a_low_limit(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """300 small shards, all resident, read through the socket (no local reads) by a
    daemon whose limit is 256: before, each resident shard kept its file open and the
    reads failed with EMFILE past about 200; now at most [cache] max_open_files stay
    open."""
    shards = dataset_shards(300, 2, payload=64)
    urls = upload(s3_server, bucket, shards)
    cfg = config(
        tmp_path,
        s3_server.endpoint_url,
        server={"local_reads": False},
        cache={"max_open_files": 32},
    )
    sock = f"ipc://{tmp_path}/cached.sock"
    with LimitedDaemon(cfg, sock, nofile="256:256") as d:
        ds = CachedDataset(urls, socket=sock, local_reads=False)
        keys = [s["__key__"] for s in ds]
        assert len(keys) == 600
        seen = status(sock)["descriptors"]
        assert seen["shard_files_open"] <= 32
        assert d.open_fds() < 200
        assert status(sock)["hot"]["shards"] == 300
        # and again, every shard resident: the LRU reopens what it closed
        assert len([s["__key__"] for s in ds]) == 600


def test_admin_http_connections_past_the_cap_are_closed_and_the_daemon_lives(
    public: Path,
) -> None:
    """Any local user reaches [server] http: 300 idle connections from another uid take
    at most max_http_connections descriptors; the rest are closed as they come, and once
    they go /healthz answers again."""
    cfg = config(public, server={"max_http_connections": 8})
    sock = f"ipc://{public}/cached.sock"
    with LimitedDaemon(cfg, sock, nofile="4096:4096") as d:
        url = status(sock)["http"]
        host, port = url.removeprefix("http://").rsplit(":", 1)
        before = d.open_fds()
        with as_nobody(1.5, 300, Path(f"tcp:{host}:{port}")):
            time.sleep(0.2)
            during = d.open_fds()
            seen = status(sock)["descriptors"]
        assert d.proc is not None and d.proc.poll() is None
        assert during - before <= 8 + 4, (before, during)  # + this test's status calls
        assert seen["http_refused"] >= 250
        with urllib.request.urlopen(f"{url}/healthz", timeout=5) as r:
            assert r.status == 200
