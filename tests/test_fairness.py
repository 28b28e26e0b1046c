"""Fairness and memory bounds on a shared node (docs/operations.md, "Fairness and bounds on a
shared node"): what one connection or one user may hold, what goes when a connection
closes, the largest request frame, and readiness that follows the request loop. Real
daemons, real sockets, a real S3 server (moto).

A bound's test runs the hostile client as another local user (uid ``nobody``: a process
under ``setpriv``, :class:`OtherUser`, or a forked child, tests/hostile.py) against a
``cached serve`` process whose socket every local user may reach, and checks that a good
client of another user (root, this test) is served while the hostile one is at its bound.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import zmq
from cached_client.errors import LimitExceeded, RequestTooLarge, remote_error
from cached_client.transport import Connection
from cached_wire.protocol import PROTOCOL_VERSION, decode, encode

from cached.server import loop as server_module
from tests.daemon import ProcessDaemon, daemon_config, dataset_shards, thread_daemon
from tests.faultproxy import FaultProxy
from tests.hostile import (
    HOSTILE,
    IN_FLIGHT,
    LIMIT_EXCEEDED,
    OtherUser,
    ask,
    metric,
    raw_dealer,
    refused,
    rss_bytes,
    shared,
    until,
)
from tests.s3server import S3Server
from tests.test_daemon import upload
from tests.test_socket_access import NOBODY, needs_root


@needs_root
def test_a_client_that_never_reads_holds_only_its_own_bound(
    s3_server: S3Server, bucket: str, public_dir: Path
) -> None:
    """The issue's wedge: another user's client that sends requests and never reads the
    replies. It holds at most [server] max_requests_per_client (its replies wait
    reply_timeout_s, then go); root's client is answered during and after; when it
    disconnects, its lease, plan, requests and waiting replies go, and the daemon is back
    to idle."""
    urls = upload(s3_server, bucket, dataset_shards(2, 3))
    most = 16
    config, socket = shared(
        public_dir,
        s3_server.endpoint_url,
        server={"max_requests_per_client": most, "reply_timeout_s": 1.0},
        prefetch={"plan_grace_s": 0},
    )
    with ProcessDaemon(config, socket) as daemon:
        http = daemon.status()["http"]
        ctx: zmq.Context[Any] = zmq.Context()
        good = raw_dealer(ctx, socket)  # no heartbeat: its requests are the hellos below
        try:
            with OtherUser(socket) as deaf:
                # It holds state first (a pin and a plan), then stops reading.
                opened, planned = deaf.ask(
                    ("deaf", {"op": "open", "url": urls[0], "stream": "deaf"}),
                    ("deaf", {"op": "plan", "plan": "deaf", "urls": urls}),
                )
                assert opened["ok"] and planned["ok"], (opened, planned)
                assert daemon.status()["hot"]["pinned_shards"] == 1
                # ~3 KB replies: far past what the queues hold.
                (flood,) = deaf.ask(("deaf", {"op": "_flood", "n": 3000}))
                assert flood["sent"] > 500, flood
                # Its replies wait in its backlog: requests in flight, all of them its.
                assert until(lambda: metric(http, IN_FLIGHT) > 0)
                held = []
                for i in range(20):  # root's client, while the deaf one is flooding
                    started = time.monotonic()
                    assert ask(good, {"op": "hello", "id": i, "v": PROTOCOL_VERSION})["ok"]
                    assert time.monotonic() - started < 1.0
                    held.append(metric(http, IN_FLIGHT))
                    time.sleep(0.05)
                assert 0 < max(held) <= most, held
                assert metric(http, LIMIT_EXCEEDED) > 0  # the rest were refused
                # Its replies are dropped after reply_timeout_s; it keeps its state meanwhile.
                timeout = 'cached_requests_total{op="unknown",result="reply_timeout"}'
                assert until(lambda: metric(http, timeout) > 0)
                status = daemon.status()
                assert status["hot"]["pinned_shards"] == 1
                assert [(p["stream"], p["user"]) for p in status["plans"]] == [("deaf", HOSTILE)]
                assert status["descriptors"]["connections_by_user"][HOSTILE] == 1
            # Gone: everything it held goes with it, within moments, not lease_timeout_s.
            assert until(lambda: daemon.status()["hot"]["pinned_shards"] == 0, 5)
            assert until(lambda: daemon.status()["plans"] == [], 5)
            assert until(
                lambda: HOSTILE not in daemon.status()["descriptors"]["connections_by_user"], 5
            )
            assert until(lambda: metric(http, IN_FLIGHT) == 0, 5)
            # And root's connection is still answered after.
            assert ask(good, {"op": "hello", "id": 99, "v": PROTOCOL_VERSION})["ok"]
        finally:
            good.close(0)
            ctx.term()


@needs_root
def test_requests_past_the_bound_are_refused_with_limit_exceeded(
    s3_server: S3Server, bucket: str, proxy: FaultProxy, public_dir: Path
) -> None:
    """Another user's client over its bound whose queue takes the answer gets
    ``limit_exceeded`` naming the key (LimitExceeded in the client library); root's client
    is answered while the other's requests hold all of its slots."""
    urls = upload(s3_server, bucket, dataset_shards(4, 3))
    most = 4
    config, socket = shared(
        public_dir, proxy.endpoint_url, server={"max_requests_per_client": most}
    )
    with ProcessDaemon(config, socket) as daemon, OtherUser(socket) as other:
        http = daemon.status()["http"]
        proxy.inject("delay", times=100, method=None, delay_s=3.0)
        # In flight: downloads from a slow store; then one more.
        opens = [("c", {"op": "open", "url": url, "stream": "s"}) for url in urls]
        other.send(*opens, ("c", {"op": "hello", "v": PROTOCOL_VERSION}))
        assert until(lambda: metric(http, LIMIT_EXCEEDED) == 1)
        assert metric(http, IN_FLIGHT) == most
        good = Connection(socket)
        started = time.monotonic()
        good.request({"op": "hello", "v": PROTOCOL_VERSION})
        assert time.monotonic() - started < 1.0
        assert metric(http, IN_FLIGHT) == most  # the other's opens were still under way
        good.close()
        proxy.clear()
        *opened, hello = other.replies()
    assert all(r["ok"] for r in opened), opened
    assert "[server] max_requests_per_client = 4" in refused(hello)
    # The client library maps the code to a CachedClientError subclass.
    assert isinstance(remote_error("limit_exceeded", "x"), LimitExceeded)


@needs_root
def test_an_oversized_request_frame_drops_its_connection_not_memory(
    s3_server: S3Server, public_dir: Path
) -> None:
    """[server] max_request_bytes is enforced by ZeroMQ as the frame's size arrives:
    another user's connection that sends one is dropped, the daemon's memory does not grow
    by the frames, that user's next connection is served, and so is root's connection
    throughout. The client library refuses to send one."""
    config, socket = shared(
        public_dir, s3_server.endpoint_url, server={"max_request_bytes": "1MiB"}
    )
    with ProcessDaemon(config, socket) as daemon:
        assert daemon.proc is not None
        pid = daemon.proc.pid
        ctx: zmq.Context[Any] = zmq.Context()
        good = raw_dealer(ctx, socket)  # root's, open before and after the frames
        try:
            assert ask(good, {"op": "hello", "id": 1, "v": PROTOCOL_VERSION})["ok"]
            before = rss_bytes(pid)
            with OtherUser(socket) as other:
                # Dropped, not answered (the header never arrives whole), three times.
                frames = other.ask(*[(f"big{i}", {"op": "_frame", "n": 128}) for i in range(3)])
                assert frames == [{"answered": False}] * 3, frames
                grown = rss_bytes(pid) - before
                assert grown < 32 << 20, f"the daemon grew by {grown} bytes"
                # Its next connection is served, and root's connection was never dropped.
                (hello,) = other.ask(("next", {"op": "hello", "v": PROTOCOL_VERSION}))
                assert hello["ok"], hello
            assert ask(good, {"op": "hello", "id": 2, "v": PROTOCOL_VERSION})["ok"]
        finally:
            good.close(0)
            ctx.term()
        conn = Connection(socket)
        urls = [f"s3://bucket/{'x' * 80}-{i:06d}.tar" for i in range(20_000)]  # ~1.9 MB
        with pytest.raises(RequestTooLarge, match=r"\[server\] max_request_bytes = 1048576"):
            conn.request({"op": "plan", "plan": "p", "urls": urls})
        conn.request({"op": "hello", "v": PROTOCOL_VERSION})  # the connection goes on
        conn.close()


@needs_root
def test_plans_and_pins_are_capped_per_user_across_connections(
    s3_server: S3Server, bucket: str, public_dir: Path
) -> None:
    """Caps per connection are no bound for a user with many connections: plans, leases
    and pinned bytes are capped per local user (uid, from the ipc connection) too. Another
    user at each cap across three connections is refused, naming it; root, a user of its
    own, plans and pins meanwhile."""
    shards = dataset_shards(4, 3)
    urls = upload(s3_server, bucket, shards)
    size = len(shards[0])
    server = {
        "max_plans_per_client": 2,
        "max_plans_per_user": 3,
        "max_plan_urls_per_user": 10,
        "max_leases_per_client": 2,
        "max_leases_per_user": 3,
        "max_pinned_share_per_user": 0.25,
    }
    config, socket = shared(
        public_dir,
        s3_server.endpoint_url,
        server=server,
        prefetch={"plan_grace_s": 0, "lookahead": "0"},
        # 2.5 shards of the tier's capacity: a user pins 2, not 3.
        cache={"capacity": str(size * 10)},
    )

    def plan(conn: str, key: str, planned: list[str]) -> tuple[str, dict[str, Any]]:
        return conn, {"op": "plan", "plan": key, "urls": planned}

    def pin(conn: str, url: str) -> tuple[str, dict[str, Any]]:
        return conn, {"op": "open", "url": url, "stream": conn}

    with ProcessDaemon(config, socket) as daemon:
        with OtherUser(socket) as other:
            # One request at a time: the daemon takes each connection's in its own order.
            def one(request: tuple[str, dict[str, Any]]) -> Any:
                return other.ask(request)[0]

            for conn, key in (("a", "a0"), ("a", "a1"), ("b", "b0")):
                assert one(plan(conn, key, urls[:1]))["ok"]
            message = refused(one(plan("c", "c0", urls[:1])))
            assert f"{HOSTILE} holds 3 plans across its connections" in message, message
            assert "[server] max_plans_per_user = 3" in message, message
            # URLs: a replacement that would take the user past its URLs is refused too.
            assert "[server] max_plan_urls_per_user = 10" in refused(one(plan("b", "b0", urls * 3)))
            assert one(plan("b", "b0", urls * 2))["ok"]  # 8 + 2 URLs: room

            # Pinned bytes: two shards pinned by two connections, the third refused.
            assert one(pin("a", urls[0]))["ok"] and one(pin("b", urls[1]))["ok"]
            message = refused(one(pin("c", urls[2])))
            assert "of pinned shards across its connections" in message, message
            assert "[server] max_pinned_share_per_user = 0.25" in message, message
            status = daemon.status()
            assert status["hot"]["pinned_shards"] == 2
            assert sorted(p["stream"] for p in status["plans"]) == ["a0", "a1", "b0"]

            # Root, meanwhile, a user of its own: its plans and pins are its own.
            good = Connection(socket)
            good.request({"op": "plan", "plan": "r0", "urls": urls * 2})
            good.request({"op": "plan", "plan": "r1", "urls": urls[:2]})  # its 10 URLs
            good.request({"op": "open", "url": urls[2], "stream": "r"})  # the one refused
            assert daemon.status()["hot"]["pinned_shards"] == 3
            good.close()
            assert until(lambda: daemon.status()["hot"]["pinned_shards"] == 2, 5)

            assert one(("b", {"op": "close", "url": urls[1], "stream": "b"}))["ok"]
            assert one(pin("c", urls[2]))["ok"]  # room again
        # Its process ended: what its connections held goes with them.
        assert until(lambda: daemon.status()["plans"] == [], 5)
        assert until(lambda: daemon.status()["hot"]["pinned_shards"] == 0, 5)


@needs_root
def test_leases_are_capped_per_user_across_connections(
    s3_server: S3Server, bucket: str, public_dir: Path
) -> None:
    """Another user's leases on two connections reach ``max_leases_per_user`` and its
    next open is refused, naming the key, while root opens the same shard; once one of
    its connections closes, the open is taken."""
    urls = upload(s3_server, bucket, dataset_shards(4, 3))
    config, socket = shared(
        public_dir,
        s3_server.endpoint_url,
        server={"max_leases_per_client": 2, "max_leases_per_user": 3},
    )
    with ProcessDaemon(config, socket) as daemon, OtherUser(socket) as other:

        def pin(conn: str, url: str) -> Any:
            return other.ask((conn, {"op": "open", "url": url, "stream": conn}))[0]

        assert pin("a", urls[0])["ok"] and pin("a", urls[1])["ok"] and pin("b", urls[2])["ok"]
        assert "[server] max_leases_per_user = 3" in refused(pin("b", urls[3]))
        good = Connection(socket)
        good.request({"op": "open", "url": urls[3], "stream": "r"})  # root's own leases
        good.request({"op": "close", "url": urls[3], "stream": "r"})
        good.close()
        assert other.ask(("a", {"op": "_disconnect"})) == [{}]
        assert until(lambda: daemon.status()["hot"]["pinned_shards"] == 1, 5)
        assert pin("b", urls[3])["ok"]


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
from cached_wire.protocol import encode
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


@needs_root
def test_a_flood_of_requests_leaves_the_daemon_answering_others(
    s3_server: S3Server, public_dir: Path
) -> None:
    """Another user's process that sends requests as fast as it can and reads none: past
    its bound each is refused at once, and the request loop still lets the event loop
    turn, so root's client and ``/healthz`` are answered within moments throughout."""
    config, socket = shared(public_dir, s3_server.endpoint_url)
    with ProcessDaemon(config, socket) as daemon:
        http = daemon.status()["http"]
        as_nobody = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
        flood = subprocess.Popen(
            [*as_nobody, sys.executable, "-c", FLOOD, socket, "6"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert flood.stdout is not None
            assert flood.stdout.readline().strip() == "ready"
            good = Connection(socket)
            worst = 0.0
            end = time.monotonic() + 4
            while time.monotonic() < end:
                started = time.monotonic()
                good.request({"op": "hello", "v": PROTOCOL_VERSION})
                with urllib.request.urlopen(f"{http}/healthz", timeout=10) as r:
                    assert r.status == 200
                worst = max(worst, time.monotonic() - started)
                time.sleep(0.1)
            users = daemon.status()["descriptors"]["connections_by_user"]  # still flooding
            good.close()
            sent = int(flood.stdout.readline())
        finally:
            flood.kill()
            flood.wait()
            if flood.stdout is not None:
                flood.stdout.close()
        limited = metric(http, LIMIT_EXCEEDED)
    assert worst < 2.0, f"a hello and a /healthz took {worst:.2f} s under the flood"
    assert sent > 10_000 and limited > 0, (sent, limited)
    assert users.get(HOSTILE) == 1, users  # the flood came from the other user


@needs_root
def test_large_requests_are_taken_one_at_a_time_per_client(
    s3_server: S3Server, bucket: str, proxy: FaultProxy, public_dir: Path
) -> None:
    """Each frame under [server] max_request_bytes, but two at once: while another user's
    client's first large request is being handled (an open, waiting 2 s for a slow store),
    its second would make the two pass the bound together and gets ``limit_exceeded`` at
    once, so one client cannot make the daemon hold many large frames, and the JSON
    decoded from them, at once. A small one fits beside it; root's large request is taken
    meanwhile; once the first is answered, the client's next large one is taken."""
    (url,) = upload(s3_server, bucket, dataset_shards(1, 3))
    limit = 8 << 20
    config, socket = shared(public_dir, proxy.endpoint_url, server={"max_request_bytes": limit})
    pad = "x" * (6 << 20)  # a valid request of 6 MiB, its id last (as the client's)
    with ProcessDaemon(config, socket) as daemon, OtherUser(socket) as other:
        http = daemon.status()["http"]
        proxy.inject("delay", times=100, method=None, delay_s=2.0)
        large = {"op": "open", "url": url, "stream": "s", "pad": pad}
        other.send(("c", large), ("c", large), ("c", {"op": "hello", "v": PROTOCOL_VERSION}))
        assert until(lambda: metric(http, LIMIT_EXCEEDED) == 1)
        ctx: zmq.Context[Any] = zmq.Context()
        good = raw_dealer(ctx, socket)
        try:
            # Root's, while the other's first large request is held (the store takes 2 s).
            assert ask(good, {"op": "status", "pad": pad, "id": 1})["ok"]
        finally:
            good.close(0)
            ctx.term()
        replies = other.replies()
        proxy.clear()
        (last,) = other.ask(("c", {"op": "status", "pad": pad}))
    codes = ["ok" if r.get("ok") else r["code"] for r in replies]
    assert codes == ["ok", "limit_exceeded", "ok"], replies
    assert f"[server] max_request_bytes = {limit}" in replies[1]["message"]
    assert last.get("ok"), last
