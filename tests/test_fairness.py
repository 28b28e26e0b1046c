"""Fairness and memory bounds on a shared node (docs/operations.md, "Fairness and bounds on a
shared node"): what one connection or one user may hold, what goes when a connection
closes, the largest request frame, and readiness that follows the request loop. Real
daemons, real sockets, a real S3 server (moto)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
from cached_client.errors import LimitExceeded, RequestTooLarge, remote_error
from cached_client.protocol import PROTOCOL_VERSION, decode, encode
from cached_client.transport import Connection

from cached import server as server_module
from tests.daemon import ProcessDaemon, daemon_config, dataset_shards, thread_daemon, write_config
from tests.faultproxy import FaultProxy
from tests.s3server import S3Server
from tests.test_daemon import upload

USER = f"uid {os.getuid()}"


def until(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Whether ``check()`` came true within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def raw_dealer(ctx: zmq.Context[Any], endpoint: str, **options: int) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(endpoint)
    return sock


def ask(sock: zmq.Socket[bytes], header: dict[str, Any], timeout_s: float = 10.0) -> Any:
    """Send ``header`` and wait for the reply with its id (others are skipped)."""
    sock.send(encode(header))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(100):
            reply = decode(sock.recv_multipart()[0])
            if reply.get("id") == header["id"]:
                return reply
    raise AssertionError(f"no reply to {header}")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_client_that_never_reads_holds_only_its_own_bound(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """The issue's wedge: a client that sends requests and never reads the replies. It
    holds at most [server] max_requests_per_client (its replies wait reply_timeout_s, then
    go); a good client is answered during and after; when it disconnects, its lease, plan,
    requests and waiting replies go, and the daemon is back to idle."""
    urls = upload(s3_server, bucket, dataset_shards(2, 3))
    most = 16
    cfg = daemon_config(
        tmp_path,
        s3_server.endpoint_url,
        **{
            "server.max_requests_per_client": most,
            "server.reply_timeout_s": 1.0,
            "prefetch.plan_grace_s": 0,
        },
    )
    with thread_daemon(cfg) as d:
        server = d.daemon.server
        ctx: zmq.Context[Any] = zmq.Context()
        deaf = raw_dealer(ctx, d.socket, RCVHWM=1)
        good = Connection(d.socket)
        try:
            # It holds state first (a pin and a plan), then stops reading.
            assert ask(deaf, {"op": "open", "id": 1, "url": urls[0], "stream": "deaf"})["ok"]
            assert ask(deaf, {"op": "plan", "id": 2, "plan": "deaf", "urls": urls})["ok"]
            assert d.call(lambda: server.leases.quota.total_held) == 1
            sent = 0
            for i in range(3000):  # ~3 KB replies: far past what the queues hold
                try:
                    deaf.send(encode({"op": "status", "id": 10 + i}), zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    break
            assert sent > 500

            busiest: list[bytes] = []

            def deaf_requests() -> int:
                most, ident = d.call(
                    lambda: max(
                        ((p.requests, p.ident) for p in server.peers.by_ident.values()),
                        default=(0, b""),
                    )
                )
                if most:
                    busiest.append(ident)
                return int(most)

            # Its replies wait in its backlog.
            assert until(lambda: d.call(lambda: server._queued) > 0)
            held = []
            for _ in range(20):  # the good client, while the deaf one is flooding
                started = time.monotonic()
                good.request({"op": "hello", "v": PROTOCOL_VERSION})
                assert time.monotonic() - started < 1.0
                held.append(deaf_requests())
                time.sleep(0.05)
            assert 0 < max(held) <= most
            # The deaf one: the peer that held requests (the good one's are answered).
            assert len(set(busiest)) == 1, busiest
            deaf_ident = busiest[0]
            # Its replies are dropped after reply_timeout_s; it keeps its state meanwhile.
            assert until(
                lambda: (
                    d.daemon.metrics.requests.labels("unknown", "reply_timeout")._value.get() > 0
                )
            )
            assert d.call(lambda: server.leases.quota.total_held) == 1
        finally:
            deaf.close(0)
            ctx.term()
        # Gone: everything it held goes with it, within moments, not lease_timeout_s.
        assert until(lambda: d.call(lambda: server.leases.quota.total_held) == 0, 5)
        assert until(lambda: d.call(lambda: d.daemon.status()["plans"]) == [], 5)
        assert until(lambda: d.call(lambda: deaf_ident not in server.peers.by_ident), 5)
        # Left: the good connection, and its heartbeat's socket once that has beaten.
        assert d.call(lambda: len(server.peers)) <= 2
        assert d.call(lambda: (len(server._tasks), server._queued, len(server._flushers))) == (
            0,
            0,
            0,
        )
        assert d.call(lambda: d.daemon.status()["hot"]["pinned_shards"]) == 0
        good.request({"op": "hello", "v": PROTOCOL_VERSION})  # and still answered after
        good.close()


def test_requests_past_the_bound_are_refused_with_limit_exceeded(
    s3_server: S3Server, bucket: str, tmp_path: Path, proxy: FaultProxy
) -> None:
    """A client over its bound whose queue takes the answer gets ``limit_exceeded`` naming
    the key (LimitExceeded in the client library); another client is answered."""
    urls = upload(s3_server, bucket, dataset_shards(4, 3))
    most = 4
    cfg = daemon_config(tmp_path, proxy.endpoint_url, **{"server.max_requests_per_client": most})
    with thread_daemon(cfg) as d:
        proxy.inject("delay", times=100, method=None, delay_s=3.0)
        ctx: zmq.Context[Any] = zmq.Context()
        sock = raw_dealer(ctx, d.socket)
        try:
            for i, url in enumerate(urls):  # in flight: downloads from a slow store
                sock.send(encode({"op": "open", "id": i, "url": url, "stream": "s"}))
            assert until(lambda: d.call(lambda: len(d.daemon.server._tasks)) == most)
            reply = ask(sock, {"op": "hello", "id": 99, "v": PROTOCOL_VERSION})
            assert reply["code"] == "limit_exceeded"
            assert "[server] max_requests_per_client = 4" in reply["message"]
            other = Connection(d.socket)
            other.request({"op": "hello", "v": PROTOCOL_VERSION})
            other.close()
            proxy.clear()
        finally:
            sock.close(0)
            ctx.term()
    # The client library maps the code to a CachedClientError subclass.
    assert isinstance(remote_error("limit_exceeded", "x"), LimitExceeded)


def test_an_oversized_request_frame_drops_its_connection_not_memory(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """[server] max_request_bytes is enforced by ZeroMQ as the frame's size arrives: the
    connection is dropped, the daemon's memory does not grow by the frames, and the
    client's next connection is served. The client library refuses to send one."""
    config = write_config(
        tmp_path / "config.toml",
        {
            "server": {
                "socket": f"ipc://{tmp_path}/cached.sock",
                "http": "127.0.0.1:0",
                "max_request_bytes": "1MiB",
            },
            "cache": {"dir": str(tmp_path / "hot"), "capacity": "1GiB", "min_free": "0"},
            "s3": {"endpoint_url": s3_server.endpoint_url},
        },
    )
    socket = f"ipc://{tmp_path}/cached.sock"
    with ProcessDaemon(config, socket) as daemon:
        assert daemon.proc is not None
        pid = daemon.proc.pid
        ctx: zmq.Context[Any] = zmq.Context()
        try:
            before = rss_bytes(pid)
            big = b"x" * (128 << 20)
            for _ in range(3):
                sock = raw_dealer(ctx, socket)
                sock.send(big)
                # Dropped, not answered (the header never arrives whole).
                assert not sock.poll(1000)
                sock.close(0)
            del big
            grown = rss_bytes(pid) - before
            assert grown < 32 << 20, f"the daemon grew by {grown} bytes"
            # The next connection, from the same process, is served.
            sock = raw_dealer(ctx, socket)
            assert ask(sock, {"op": "hello", "id": 1, "v": PROTOCOL_VERSION})["ok"]
            sock.close(0)
        finally:
            ctx.term()
        conn = Connection(socket)
        urls = [f"s3://bucket/{'x' * 80}-{i:06d}.tar" for i in range(20_000)]  # ~1.9 MB
        with pytest.raises(RequestTooLarge, match=r"\[server\] max_request_bytes = 1048576"):
            conn.request({"op": "plan", "plan": "p", "urls": urls})
        conn.request({"op": "hello", "v": PROTOCOL_VERSION})  # the connection goes on
        conn.close()


def test_plans_and_pins_are_capped_per_user_across_connections(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """Caps per connection are no bound for a user with many connections: plans, leases
    and pinned bytes are capped per local user (uid, from the ipc connection) too."""
    shards = dataset_shards(4, 3)
    urls = upload(s3_server, bucket, shards)
    size = len(shards[0])
    cfg = daemon_config(
        tmp_path,
        s3_server.endpoint_url,
        **{
            "prefetch.plan_grace_s": 0,
            "server.max_plans_per_client": 2,
            "server.max_plans_per_user": 3,
            "server.max_plan_urls_per_user": 10,
            "server.max_leases_per_client": 2,
            "server.max_leases_per_user": 3,
            # 2.5 shards of the tier's capacity: a user pins 2, not 3.
            "cache.capacity": str(size * 10),
            "server.max_pinned_share_per_user": 0.25,
            "prefetch.lookahead": "0",
        },
    )
    with thread_daemon(cfg) as d:
        a, b, c = Connection(d.socket), Connection(d.socket), Connection(d.socket)
        a.request({"op": "plan", "plan": "a0", "urls": urls[:1]})
        a.request({"op": "plan", "plan": "a1", "urls": urls[:1]})
        b.request({"op": "plan", "plan": "b0", "urls": urls[:1]})
        with pytest.raises(LimitExceeded) as refused:
            c.request({"op": "plan", "plan": "c0", "urls": urls[:1]})
        assert f"{USER} holds 3 plans across its connections" in str(refused.value)
        assert "[server] max_plans_per_user = 3" in str(refused.value)
        # URLs: a replacement that would take the user past its URLs is refused too.
        with pytest.raises(LimitExceeded, match=r"max_plan_urls_per_user = 10"):
            b.request({"op": "plan", "plan": "b0", "urls": urls * 3})
        b.request({"op": "plan", "plan": "b0", "urls": urls * 2})  # 8 + 2 URLs: room

        # Pinned bytes: two shards pinned by two connections, the third refused.
        a.request({"op": "open", "url": urls[0], "stream": "a"})
        b.request({"op": "open", "url": urls[1], "stream": "b"})
        with pytest.raises(LimitExceeded) as refused:
            c.request({"op": "open", "url": urls[2], "stream": "c"})
        assert "of pinned shards across its connections" in str(refused.value)
        assert "[server] max_pinned_share_per_user = 0.25" in str(refused.value)
        assert d.call(lambda: d.daemon.status()["hot"]["pinned_shards"]) == 2
        b.request({"op": "close", "url": urls[1], "stream": "b"})
        c.request({"op": "open", "url": urls[2], "stream": "c"})  # room again
        for conn in (a, b, c):
            conn.close()
        # Closed: what they held goes with them.
        assert until(lambda: d.call(lambda: d.daemon.status()["plans"]) == [], 5)
        assert until(lambda: d.call(lambda: d.daemon.status()["hot"]["pinned_shards"]) == 0, 5)


def test_leases_are_capped_per_user_across_connections(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    urls = upload(s3_server, bucket, dataset_shards(4, 3))
    cfg = daemon_config(
        tmp_path,
        s3_server.endpoint_url,
        **{"server.max_leases_per_client": 2, "server.max_leases_per_user": 3},
    )
    with thread_daemon(cfg) as d:
        a, b = Connection(d.socket), Connection(d.socket)
        a.request({"op": "open", "url": urls[0], "stream": "a"})
        a.request({"op": "open", "url": urls[1], "stream": "a"})
        b.request({"op": "open", "url": urls[2], "stream": "b"})
        with pytest.raises(LimitExceeded, match=r"\[server\] max_leases_per_user = 3"):
            b.request({"op": "open", "url": urls[3], "stream": "b"})
        a.close()
        assert until(lambda: d.call(lambda: d.daemon.status()["hot"]["pinned_shards"]) == 1, 5)
        b.request({"op": "open", "url": urls[3], "stream": "b"})
        b.close()


CLIENT = """
import os, signal, sys, time
from cached_client.transport import Connection
from cached_client.reader import announce
conn = Connection(sys.argv[1])
announce(conn, "reader-0", sys.argv[3:], job="j")
conn.request({"op": "open", "url": sys.argv[3], "stream": "reader-0"})
print("ready", flush=True)
sys.stdin.readline()  # the test looks at the daemon before this process ends
if sys.argv[2] == "exit":
    sys.exit(0)
time.sleep(600)
"""


@pytest.mark.parametrize("end", ["SIGKILL", "exit"])
def test_the_plans_of_a_process_that_ended_leave_status_after_the_grace(
    s3_server: S3Server, bucket: str, tmp_path: Path, end: str
) -> None:
    """A reader's pins go when its process ends, killed or not, and its plan leaves
    ``cached status`` [prefetch] plan_grace_s later (30 s by default: within a minute), not
    plan_timeout_s (900 s) later. Meanwhile the plan stays: a DataLoader worker that ends
    with its epoch leaves the next epoch's plan for the prefetcher."""
    urls = upload(s3_server, bucket, dataset_shards(2, 3))
    grace = 3.0
    cfg = daemon_config(tmp_path, s3_server.endpoint_url, **{"prefetch.plan_grace_s": grace})
    with thread_daemon(cfg) as d:
        child = subprocess.Popen(
            [sys.executable, "-c", CLIENT, d.socket, end, *urls],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdin is not None and child.stdout is not None
            assert child.stdout.readline().strip() == "ready"
            assert [p["job"] for p in d.call(lambda: d.daemon.status()["plans"])] == ["j"]
            assert d.call(lambda: d.daemon.status()["hot"]["pinned_shards"]) == 1
            child.stdin.write("end\n")
            child.stdin.flush()
            if end == "SIGKILL":
                child.send_signal(signal.SIGKILL)
            child.wait(10)
            ended = time.monotonic()
            assert until(lambda: d.call(lambda: d.daemon.status()["hot"]["pinned_shards"]) == 0, 2)
            assert [p["job"] for p in d.call(lambda: d.daemon.status()["plans"])] == ["j"]
            assert until(lambda: d.call(lambda: d.daemon.status()["plans"]) == [], grace + 5)
            assert time.monotonic() - ended >= grace - 0.5
        finally:
            child.kill()
            child.wait()
            for pipe in (child.stdin, child.stdout):
                if pipe is not None:
                    pipe.close()


def test_readyz_says_not_ready_while_no_request_slot_frees(
    s3_server: S3Server,
    bucket: str,
    tmp_path: Path,
    proxy: FaultProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every request slot held by requests that do not finish (downloads from a store that
    does not answer), and a request waiting for one: /readyz says 503 (and the watchdog is
    not fed) after STUCK_AFTER_S; 200 again once requests finish."""
    urls = upload(s3_server, bucket, dataset_shards(4, 3))
    monkeypatch.setattr(server_module, "MAX_ACTIVE_REQUESTS", 4)
    monkeypatch.setattr(server_module, "STUCK_AFTER_S", 0.5)
    cfg = daemon_config(tmp_path, proxy.endpoint_url, **{"prefetch.lookahead": "0"})

    def readyz() -> int:
        try:
            with urllib.request.urlopen(f"{d.daemon.http.url}/readyz", timeout=5) as r:
                return int(r.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    with thread_daemon(cfg) as d:
        assert readyz() == 200
        proxy.inject("delay", times=100, method=None, delay_s=4.0)
        ctx: zmq.Context[Any] = zmq.Context()
        slow = raw_dealer(ctx, d.socket)
        try:
            for i, url in enumerate(urls):  # 4 downloads that take 4 s: every slot
                slow.send(encode({"op": "open", "id": i, "url": url, "stream": "s"}))
            assert until(lambda: d.call(lambda: len(d.daemon.server._tasks)) == 4)
            other = raw_dealer(ctx, d.socket)
            other.send(encode({"op": "hello", "id": 1, "v": PROTOCOL_VERSION}))
            time.sleep(1.0)
            assert readyz() == 503
            assert json.loads(urllib.request.urlopen(f"{d.daemon.http.url}/healthz").read())["ok"]
            assert not d.call(d.daemon.serving)
            proxy.clear()
            # The downloads end; the waiting hello is taken and answered; ready again.
            assert other.poll(30_000)
            assert decode(other.recv_multipart()[0])["ok"]
            assert until(lambda: readyz() == 200, 30)
            other.close(0)
        finally:
            slow.close(0)
            ctx.term()


FLOOD = """
import sys, time, zmq
from cached_client.protocol import encode
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(sys.argv[1])
print("ready", flush=True)
end = time.monotonic() + float(sys.argv[2])
i = 0
while time.monotonic() < end:  # as fast as the socket takes them, never a read
    try:
        sock.send(encode({"op": "status", "id": i}), zmq.NOBLOCK)
        i += 1
    except zmq.Again:
        time.sleep(0.0005)
print(i, flush=True)
"""


def test_a_flood_of_requests_leaves_the_daemon_answering_others(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """A client (another process) that sends requests as fast as it can and reads none:
    past its bound each is refused at once, and the request loop still lets the event
    loop turn, so another client and ``/healthz`` are answered within moments throughout."""
    cfg = daemon_config(tmp_path, s3_server.endpoint_url)
    with thread_daemon(cfg) as d:
        http = d.call(lambda: d.daemon.status()["http"])
        flood = subprocess.Popen(
            [sys.executable, "-c", FLOOD, d.socket, "6"], stdout=subprocess.PIPE, text=True
        )
        try:
            assert flood.stdout is not None
            assert flood.stdout.readline().strip() == "ready"
            good = Connection(d.socket)
            worst = 0.0
            end = time.monotonic() + 4
            while time.monotonic() < end:
                started = time.monotonic()
                good.request({"op": "hello", "v": PROTOCOL_VERSION})
                with urllib.request.urlopen(f"{http}/healthz", timeout=10) as r:
                    assert r.status == 200
                worst = max(worst, time.monotonic() - started)
                time.sleep(0.1)
            good.close()
            sent = int(flood.stdout.readline())
        finally:
            flood.kill()
            flood.wait()
            if flood.stdout is not None:
                flood.stdout.close()
        refused = d.call(d.daemon.metrics.requests.labels("unknown", "limit_exceeded")._value.get)
    assert sent > 10_000 and refused > 0
    assert worst < 2.0, f"a hello and a /healthz took {worst:.2f} s under the flood"


def test_large_requests_are_taken_one_at_a_time_per_client(
    s3_server: S3Server, bucket: str, tmp_path: Path, proxy: FaultProxy
) -> None:
    """Each frame under [server] max_request_bytes, but two at once: while a client's
    first large request is being handled (an open, waiting 2 s for a slow store), its
    second would make the two pass the bound together and gets ``limit_exceeded`` at
    once, so one client cannot make the daemon hold many large frames, and the JSON
    decoded from them, at once. A small one fits beside it; another client is answered
    meanwhile; once the first is answered, the next large one is taken."""
    (url,) = upload(s3_server, bucket, dataset_shards(1, 3))
    limit = 8 << 20
    cfg = daemon_config(tmp_path, proxy.endpoint_url, **{"server.max_request_bytes": limit})
    with thread_daemon(cfg) as d:
        proxy.inject("delay", times=100, method=None, delay_s=2.0)
        ctx: zmq.Context[Any] = zmq.Context()
        sock = raw_dealer(ctx, d.socket)
        try:
            pad = "x" * (6 << 20)  # a valid request of 6 MiB, its id last (as the client's)
            for i in range(2):
                sock.send(encode({"op": "open", "url": url, "stream": "s", "pad": pad, "id": i}))
            sock.send(encode({"op": "hello", "v": PROTOCOL_VERSION, "id": 2}))
            other = Connection(d.socket)
            other.request({"op": "hello", "v": PROTOCOL_VERSION})
            other.close()
            replies: dict[int, Any] = {}
            while len(replies) < 3 and sock.poll(15_000):
                reply = decode(sock.recv_multipart()[0])
                replies[reply["id"]] = reply
            proxy.clear()
            last = ask(sock, {"op": "status", "pad": pad, "id": 3})
        finally:
            sock.close(0)
            ctx.term()
    codes = {i: "ok" if r.get("ok") else r["code"] for i, r in replies.items()}
    assert codes == {0: "ok", 1: "limit_exceeded", 2: "ok"}
    assert f"[server] max_request_bytes = {limit}" in replies[1]["message"]
    assert last.get("ok"), last
