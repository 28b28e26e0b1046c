"""Small hot tiers (issue 35, point 5): a tier with room for fewer than two of a reader's
shards serves it one shard at a time; an open ahead that finds no room gives way rather
than fail; and what a reader killed mid-shard held comes back to the next one.

A real ``cached serve`` process, real reader processes (one killed with SIGKILL
mid-shard), a real S3 server, a tier with room for 1.8 of the largest shard,
``pin_wait_s`` 15 and ``lease_timeout_s`` 2 (the issue's).

Why the next reader failed: not the killed reader's pin (its lease went with its
connection). A reader on the daemon's node reads the files itself and gives its pin back
with its next request; at the end of a shard that next request was the wait for the next
shard's open, which on this tier waited for that very pin, until ``pin_wait_s`` and
``cache_full``. A fresh reader failed the same way about one run in three.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from cached.hot.tier import reservation_bytes
from tests.daemon import ProcessDaemon, dataset_shards, write_config
from tests.s3server import S3Server

pytestmark = pytest.mark.stores

# A reader that announces its plan, reads its shards in order, ``pause`` seconds a sample
# (so that it is mid-shard when killed, or slower than the daemon's waits), and says how
# many samples it read.
READER = r"""
import sys, time
from cached_client.reader import Span, announce, read_spans
from cached_client.transport import Connection
socket, stream, pause = sys.argv[1], sys.argv[2], float(sys.argv[3])
urls = sys.argv[4:]
conn = Connection(socket)
announce(conn, stream, urls, job=stream)
n = 0
for url, _ in read_spans(conn, [Span(u) for u in urls], stream, plan=stream):
    n += 1
    if n == 3:
        print("reading", url, flush=True)
    time.sleep(pause)
print("read", n, flush=True)
"""

SAMPLES = 24
PAYLOAD = 256 << 10  # about 6 MiB a shard


def reader(socket: str, stream: str, urls: list[str], pause: float) -> subprocess.Popen[str]:
    """A reader process (see READER)."""
    return subprocess.Popen(
        [sys.executable, "-c", READER, socket, stream, str(pause), *urls],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finished(proc: subprocess.Popen[str], daemon: ProcessDaemon) -> str:
    """The reader's last line, once it ended well (else its error and the daemon's log)."""
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, f"{err[-3000:]}\n{daemon.log_tail()}"
    return out.splitlines()[-1]


def small_tier(tmp: Path, s3: S3Server, largest: int, pin_wait_s: float) -> ProcessDaemon:
    """``cached serve`` with a hot tier of room for 1.8 of the largest shard and
    ``lease_timeout_s`` 2."""
    socket = f"ipc://{tmp}/cached.sock"
    cfg = {
        "server": {"socket": socket, "http": "127.0.0.1:0", "lease_timeout_s": 2.0},
        "cache": {
            "dir": str(tmp / "hot"),
            "capacity": int(1.8 * reservation_bytes(largest)),
            "min_free": "0",
            "pin_wait_s": pin_wait_s,
        },
        "s3": {
            "endpoint_url": s3.endpoint_url,
            "retry_attempts": 3,
            "retry_base_delay_s": 0.01,
            "retry_max_delay_s": 0.05,
        },
    }
    return ProcessDaemon(write_config(tmp / "config.toml", cfg), socket)


def requests(daemon: ProcessDaemon, op: str, result: str) -> float:
    """``cached_requests_total{op, result}`` from the daemon's /metrics."""
    with urllib.request.urlopen(f"{daemon.status()['http']}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.search(rf'cached_requests_total{{op="{op}",result="{result}"}} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def shards_in(s3: S3Server, bucket: str, n: int) -> tuple[list[str], int]:
    """``n`` shards of about 6 MiB uploaded as the issue's ``flarge-*``: their URLs, and
    the largest one's size."""
    shards = dataset_shards(n, SAMPLES, payload=PAYLOAD, prefix="f")
    for i, body in enumerate(shards):
        s3.put(bucket, f"flarge-{i:06d}.tar", body)
    return [f"s3://{bucket}/flarge-{i:06d}.tar" for i in range(n)], max(map(len, shards))


def test_a_reader_killed_mid_shard_leaves_the_tier_to_the_next(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """Killed with SIGKILL mid-shard, a reader's pin goes; the next reader reads every
    shard, one at a time, on a tier with room for 1.8 of them."""
    urls, largest = shards_in(s3_server, bucket, 4)
    with small_tier(tmp_path, s3_server, largest, pin_wait_s=15.0) as daemon:
        victim = reader(daemon.socket, "victim", urls, pause=0.2)
        assert victim.stdout is not None
        assert victim.stdout.readline().startswith("reading"), daemon.log_tail()
        victim.send_signal(signal.SIGKILL)
        victim.communicate()
        time.sleep(2.0 * 1.25 + 0.5)  # its lease lapses (at the sweep: 1-1.25 x 2 s)
        assert daemon.status()["hot"]["pinned_shards"] == 0
        started = time.monotonic()
        assert finished(reader(daemon.socket, "next", urls, pause=0.0), daemon) == (
            f"read {SAMPLES * len(urls)}"
        )
        # Well within pin_wait_s a shard: no open waited out its deadline.
        assert time.monotonic() - started < 15.0
        assert requests(daemon, "open", "cache_full") == 0


def test_an_open_ahead_gives_way_on_a_small_tier(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """A reader slower than ``pin_wait_s`` a shard: its opens ahead find no room beside
    the shard it reads, and give way (answered "not resident"; asked again in their
    turn) instead of coming back ``cache_full``."""
    urls, largest = shards_in(s3_server, bucket, 3)
    with small_tier(tmp_path, s3_server, largest, pin_wait_s=0.5) as daemon:
        # 24 samples at 0.1 s: 2.4 s a shard, past the ahead open's two waits (0.5 s each).
        slow = reader(daemon.socket, "slow", urls, pause=0.1)
        assert finished(slow, daemon) == f"read {SAMPLES * len(urls)}"
        assert requests(daemon, "open", "cache_full") == 0
