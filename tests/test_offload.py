"""Requests' work in worker threads is a budget per user (issue 35, items 3 and 6;
cached/offload.py): one user's burst of long plans neither queues another user's work
behind it nor the fetch path's, which keeps asyncio's default pool.

Real parts: a ``cached serve`` process every local user may reach, the other user a
forked child of this test as uid ``nobody`` on ZeroMQ sockets of its own, real threads.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from cached_wire.protocol import PROTOCOL_VERSION, decode, encode

from cached.offload import Offload
from tests.daemon import ProcessDaemon, write_config

NOBODY = 65534
# A plan this long is checked and indexed in a worker thread (server.PLAN_OFFLOAD_URLS).
LONG_PLAN = 12_000
HOSTILE_CONNECTIONS, PLANS_EACH = 4, 30


async def test_a_users_jobs_run_at_most_per_user_at_once_and_others_pass() -> None:
    """Ten jobs of one user run two at a time; another user's job starts meanwhile."""
    offload = Offload(threads=4, per_user=2)
    running: dict[str, int] = {"a": 0, "b": 0}
    most = {"a": 0, "b": 0}
    lock = threading.Lock()
    started: dict[str, float] = {}

    def job(user: str, seconds: float) -> None:
        with lock:
            running[user] += 1
            most[user] = max(most[user], running[user])
            started.setdefault(user, time.monotonic())
        time.sleep(seconds)
        with lock:
            running[user] -= 1

    try:
        t0 = time.monotonic()
        burst = [asyncio.ensure_future(offload.run("a", job, "a", 0.2)) for _ in range(10)]
        await asyncio.sleep(0.05)
        assert offload.jobs("a") == 10
        await offload.run("b", job, "b", 0.01)
        assert started["b"] - t0 < 0.15  # not behind a's queue (1 s of it)
        await asyncio.gather(*burst)
    finally:
        offload.close()
    assert most == {"a": 2, "b": 1}
    assert offload.jobs() == 0


def plan(key: str, n: int, i: int) -> dict[str, Any]:
    return {
        "op": "plan",
        "id": i,
        "plan": key,
        "urls": [f"s3://bucket/{key}/shard-{k:06d}.tar" for k in range(n)],
    }


def send_and_wait(sock: zmq.Socket[bytes], request: dict[str, Any], timeout_s: float) -> float:
    """Seconds from sending ``request`` to its answer (which must be ok)."""
    t = time.monotonic()
    sock.send(encode(request))
    while True:
        assert sock.poll(int(timeout_s * 1000)), f"no answer to {request['op']}"
        reply = decode(sock.recv())
        if reply.get("id") == request["id"]:
            assert reply.get("ok"), reply
            return time.monotonic() - t


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as another uid")
def test_another_users_burst_of_long_plans_leaves_a_plan_of_ones_own_fast(
    public_dir: Path,
) -> None:
    """nobody sends 120 plans of 12,000 URLs at once on 4 connections (each checked and
    indexed in a worker thread); meanwhile root's own long plan is answered within a few
    times what it takes alone, not behind nobody's queue."""
    sock_path = public_dir / "cached.sock"
    cfg = write_config(
        public_dir / "config.toml",
        {
            "server": {
                "socket": f"ipc://{sock_path}",
                "http": "127.0.0.1:0",
                "socket_mode": "0666",
            },
            "cache": {"dir": str(public_dir / "hot"), "capacity": "1GiB", "min_free": "0"},
            "s3": {"endpoint_url": "http://127.0.0.1:1"},
            # Plans of URLs that are never fetched: nothing to prefetch them from.
            "prefetch": {"lookahead": "1MiB"},
        },
    )
    endpoint = f"ipc://{sock_path}"
    with ProcessDaemon(cfg, endpoint):
        ctx: zmq.Context[Any] = zmq.Context()
        own = ctx.socket(zmq.DEALER)
        own.setsockopt(zmq.LINGER, 0)
        own.connect(endpoint)
        send_and_wait(own, {"op": "hello", "id": 0, "v": PROTOCOL_VERSION}, 10)
        alone = statistics.median(
            send_and_wait(own, plan("mine", LONG_PLAN, i), 30) for i in range(1, 4)
        )
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # nobody: never returns into pytest
            try:
                os.close(read)
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                c: zmq.Context[Any] = zmq.Context()
                socks = []
                for n in range(HOSTILE_CONNECTIONS):
                    s = c.socket(zmq.DEALER)
                    s.connect(endpoint)
                    for i in range(PLANS_EACH):
                        s.send(encode(plan(f"burst-{n}-{i}", LONG_PLAN, i)))
                    socks.append(s)
                time.sleep(0.5)  # in the daemon's queue
                os.write(write, b"!")
                answered = 0
                deadline = time.monotonic() + 120
                while answered < HOSTILE_CONNECTIONS * PLANS_EACH and time.monotonic() < deadline:
                    for s in socks:
                        while s.poll(0):
                            s.recv()
                            answered += 1
                    time.sleep(0.01)
            finally:
                os._exit(0)
        os.close(write)
        try:
            assert os.read(read, 1) == b"!"
            during = send_and_wait(own, plan("mine", LONG_PLAN, 10), 60)
        finally:
            os.close(read)
            os.waitpid(pid, 0)
            own.close(linger=0)
            ctx.term()
    # Alone about 0.05-0.1 s here; behind nobody's 120 (the default pool's 6 threads, all
    # on one GIL) it waited for most of them: about 120 x alone.
    assert during < 8 * alone + 0.3, (during, alone)
