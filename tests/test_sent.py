"""Replies handed to ZeroMQ count in bytes until it has written them (issue 35, item 3;
cached/sent.py): connections that take no replies hold at most
``SENT_BYTES_PER_CLIENT`` each, and their user at most ``max_reply_bytes_per_user``,
in ZeroMQ's queues, besides the backlog's own cap; before, ZeroMQ queued 16 replies per
connection whatever their size.

Real parts: the moto S3 server, a ``cached serve`` process every local user may reach,
the other user forked children of this test as uid ``nobody`` (tests/hostile.py), the
daemon's VmRSS from /proc.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from tests.daemon import ProcessDaemon, dataset_shards
from tests.hostile import as_other_user
from tests.s3server import S3Server
from tests.test_daemon import upload
from tests.test_ownership import shared_daemon
from tests.test_socket_access import NOBODY, needs_root

MiB = 1 << 20
SAMPLE = MiB  # a read of 16 samples carries 16 MiB
CONNECTIONS, READS = 4, 24


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@needs_root
def test_connections_that_take_no_replies_hold_little_in_zeromqs_queues(
    s3_server: S3Server, bucket: str, public_dir: Path
) -> None:
    """Another user's 4 connections each send 24 reads of 16 MiB and take nothing for 4 s:
    the daemon grows by about its caps (64 MiB in ZeroMQ for the user, 64 MiB of backlog),
    not by 16 replies a connection (1 GiB), and a reader of its own is served meanwhile."""
    shards = dataset_shards(1, 32, payload=SAMPLE)
    url = upload(s3_server, bucket, shards)[0]
    config, socket = shared_daemon(
        public_dir,
        s3_server.endpoint_url,
        prefetch={"lookahead": "0"},
        local_reads=False,
        max_reply_bytes_per_user="64MiB",
        max_reply_bytes="256MiB",
    )
    read: dict[str, Any] = {"op": "read", "url": url, "stream": "s", "start": 0, "count": 16}
    with ProcessDaemon(config, socket) as d:
        assert d.proc is not None
        assert as_other_user(socket, [read], uid=NOBODY - 1)[0]["ok"]  # resident now
        time.sleep(0.5)
        before = rss(d.proc.pid)
        peak = [before]
        results: list[list[dict[str, Any]]] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], rss(d.proc.pid))  # type: ignore[union-attr]
                time.sleep(0.02)

        def deaf() -> None:
            results.append(as_other_user(socket, [read] * READS, deaf_s=4.0, timeout_s=60))

        watcher = threading.Thread(target=watch)
        watcher.start()
        clients = [threading.Thread(target=deaf) for _ in range(CONNECTIONS)]
        for c in clients:
            c.start()
        time.sleep(2.0)
        # Another user's reader is served while they wait.
        mine = as_other_user(socket, [read], uid=NOBODY - 1)[0]
        for c in clients:
            c.join()
        stop.set()
        watcher.join()
    assert mine["ok"] and mine["payload_bytes"] >= 16 * SAMPLE
    assert len(results) == CONNECTIONS
    replies = [r for rs in results for r in rs]
    assert sum(r["ok"] for r in replies) > 0
    grown = peak[0] - before
    # 64 MiB in ZeroMQ for the user, one reply more per connection with nothing in it, the
    # backlog's 64 MiB, and slack for the frames being read: under 320 MiB. Without the
    # count in bytes, ZeroMQ took 16 replies a connection: over 1 GiB.
    assert grown < 320 * MiB, f"the daemon grew by {grown / MiB:.0f} MiB"
