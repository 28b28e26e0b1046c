"""Bounds and lifetimes a user relies on (docs/architecture.md, sections 2 and 4): a heartbeat
renews only its own user's connection, and keeps that connection's plans alive; a plan
names at most ``max_plan_shards`` shards; a whole read asked only if resident pins at most
half the tier; a connection keeps at most 32 shard files open.

Real parts: the moto S3 server, real daemons (in a thread of this process, or ``cached
serve``), real ZeroMQ sockets, and for another user a forked child of this test that takes
uid 65534 (nobody) and connects itself.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from cached_client.errors import RemoteError
from cached_client.local import MAX_OPEN_FILES
from cached_client.transport import Connection
from cached_wire.protocol import PROTOCOL_VERSION

from cached.server import Server
from tests.daemon import (
    ProcessDaemon,
    daemon_config,
    dataset_shards,
    held_files,
    serve_config,
    thread_daemon,
)
from tests.hostile import ask, raw_dealer, readable, until
from tests.s3server import S3Server
from tests.test_daemon import upload
from tests.test_local_reads import expected
from tests.test_socket_access import NOBODY, needs_root

# A session name as a client's hello gives it (8-64 letters, digits, - or _).
SESSION = "victim-session-0001"


def status(d: Any) -> dict[str, Any]:
    result: dict[str, Any] = d.call(d.daemon.status)
    return result


def plan_names(d: Any) -> list[str]:
    return sorted(str(p["stream"]) for p in status(d)["plans"])


def pinned(d: Any) -> int:
    return int(status(d)["hot"]["pinned_shards"])


class Impostor:
    """A forked child of this test that is another local user (``uid``): it says hello
    claiming ``session``, then sends a heartbeat naming it every 50 ms until :meth:`stop`,
    which returns what the daemon answered. The child uses a ZeroMQ context of its own and
    never returns into pytest."""

    def __init__(self, endpoint: str, session: str, uid: int = NOBODY) -> None:
        self.endpoint, self.session, self.uid = endpoint, session, uid
        self._pid = 0
        self._out: Any = None
        self._stop_w = -1

    def __enter__(self) -> Impostor:
        out_r, out_w = os.pipe()
        stop_r, stop_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            result: dict[str, Any] = {}
            try:
                os.close(out_r)
                os.close(stop_w)
                result = self._child(out_w, stop_r)
            except BaseException as exc:
                result["error"] = repr(exc)
            finally:
                try:  # a parent that gave up has closed the pipe: exit all the same
                    os.write(out_w, json.dumps(result).encode() + b"\n")
                finally:
                    os._exit(0)
        os.close(out_w)
        os.close(stop_r)
        self._pid, self._stop_w = pid, stop_w
        self._out = os.fdopen(out_r, "rb")
        line = self._line()
        assert line == b"beating\n", f"the child did not start beating: {line!r}"
        return self

    def _line(self) -> bytes:
        assert readable(self._out, 20), "no word from the child"
        line: bytes = self._out.readline()
        return line

    def _child(self, out_w: int, stop_r: int) -> dict[str, Any]:
        os.setgroups([])
        os.setgid(self.uid)
        os.setuid(self.uid)
        ctx: zmq.Context[Any] = zmq.Context()
        sock = raw_dealer(ctx, self.endpoint)
        session = self.session
        hello = ask(sock, {"op": "hello", "id": 1, "v": PROTOCOL_VERSION, "session": session})
        out: dict[str, Any] = {"uid": os.getuid(), "hello": hello, "known": []}
        deadline = time.monotonic() + 30  # never outlives the test for long
        for i in itertools.count(2):
            reply = ask(sock, {"op": "heartbeat", "id": i, "session": session})
            out["known"].append(reply.get("known"))
            if i == 2:
                os.write(out_w, b"beating\n")
            if readable(stop_r, 0.05) or time.monotonic() > deadline:
                break
        sock.close(linger=0)
        return out

    def stop(self) -> dict[str, Any]:
        os.write(self._stop_w, b"x")
        result: dict[str, Any] = json.loads(self._line())
        return result

    def __exit__(self, *exc: object) -> None:
        os.close(self._stop_w)
        self._out.close()
        os.waitpid(self._pid, 0)


@needs_root
def test_a_heartbeat_from_another_user_renews_nothing_and_cannot_take_the_session(
    s3_server: S3Server, bucket: str, tmp_path: Path, public_dir: Path
) -> None:
    """A heartbeat names a connection by its session, a name any local user could learn.
    The daemon renews a connection's leases and plans only for a heartbeat of the same
    user: another user's heartbeats naming the session keep nothing alive (they are
    answered ``known: false``), and another user's hello claiming the session is refused,
    so the session stays with its connection."""
    url = upload(s3_server, bucket, dataset_shards(1, 3))[0]
    cfg = daemon_config(
        tmp_path,
        s3_server.endpoint_url,
        **{
            "server.socket": f"ipc://{public_dir}/cached.sock",
            "server.socket_mode": "0666",
            "server.lease_timeout_s": 0.4,  # heartbeat_s 0.1
            "prefetch.plan_timeout_s": 1.0,
            "prefetch.lookahead": "0",
        },
    )
    with thread_daemon(cfg) as d:
        ctx: zmq.Context[Any] = zmq.Context()
        owner, beater = raw_dealer(ctx, d.socket), raw_dealer(ctx, d.socket)
        try:
            hello = {"op": "hello", "id": 1, "v": PROTOCOL_VERSION, "session": SESSION}
            assert ask(owner, hello)["session"] == SESSION
            assert ask(owner, {"op": "open", "id": 2, "url": url, "stream": "s"})["ok"]
            assert ask(owner, {"op": "plan", "id": 3, "plan": "owned", "urls": [url]})["ok"]
            beats = itertools.count(1)

            def beat() -> Any:
                return ask(beater, {"op": "heartbeat", "id": next(beats), "session": SESSION})

            # The owner's own user: its heartbeats (on a socket of their own, as the
            # client's thread sends them) keep the lease and the plan past their timeouts.
            until_s = time.monotonic() + 1.5
            while time.monotonic() < until_s:
                assert beat()["known"] is True
                time.sleep(0.05)
            assert pinned(d) == 1 and plan_names(d) == ["owned"]

            # Another user's heartbeats naming the session: both lapse under them.
            with Impostor(d.socket, SESSION) as impostor:
                lapsed = until(lambda: pinned(d) == 0 and plan_names(d) == [])
                seen = impostor.stop()
            assert "error" not in seen, seen
            assert seen["uid"] == NOBODY
            assert lapsed, "another user's heartbeats kept the connection's lease or plan"
            assert len(seen["known"]) >= 5 and set(seen["known"]) == {False}, seen
            # Its hello claiming the session was refused ...
            refused = seen["hello"]
            assert refused["ok"] is False and refused["code"] == "bad_request", refused
            assert refused["message"] == "that session belongs to another user's connection"
            # ... and the session still names the owner's connection.
            assert beat()["known"] is True
            assert ask(owner, {"op": "status", "id": 4})["ok"]  # the owner is still served
        finally:
            owner.close(0)
            beater.close(0)
            ctx.term()


def test_a_heartbeat_keeps_a_silent_connections_plan_past_the_plan_timeout(
    tmp_path: Path,
) -> None:
    """A reader that sends no request for longer than ``[prefetch] plan_timeout_s`` (it
    reads from files, or its training step runs) keeps its plan, and so its prefetch, as
    long as its connection's heartbeat beats; a connection without heartbeats loses its
    plan once the timeout passes, not before."""
    timeout_s = 1.0
    cfg = daemon_config(
        tmp_path,
        None,
        **{
            "server.lease_timeout_s": 0.4,  # heartbeat_s 0.1
            "prefetch.plan_timeout_s": timeout_s,
            "prefetch.lookahead": "0",  # nothing is fetched
        },
    )
    urls = [f"s3://b/shard-{i:04d}.tar" for i in range(4)]
    with thread_daemon(cfg) as d:
        ctx: zmq.Context[Any] = zmq.Context()
        silent = raw_dealer(ctx, d.socket)  # says no hello, so has no heartbeat
        reader = Connection(d.socket)  # its heartbeat thread starts with its hello
        try:
            started = time.monotonic()
            reader.request({"op": "plan", "plan": "beating", "urls": urls, "job": "j"})
            assert ask(silent, {"op": "plan", "id": 1, "plan": "quiet", "urls": urls})["ok"]
            assert plan_names(d) == ["beating", "quiet"]
            assert until(lambda: "quiet" not in plan_names(d))
            assert time.monotonic() - started >= timeout_s  # dropped after the timeout
            assert plan_names(d) == ["beating"]
            # Three timeouts without a request: the heartbeat alone keeps it.
            while time.monotonic() - started < 3 * timeout_s:
                assert plan_names(d) == ["beating"]
                time.sleep(0.1)
        finally:
            reader.close()
            silent.close(0)
            ctx.term()


def test_a_plan_past_max_plan_shards_is_refused_and_holds_nothing_one_at_the_limit_is_taken(
    tmp_path: Path,
) -> None:
    """A plan naming more shards than the daemon's ``max_plan_shards`` is a bad request
    that says the limit; it installs nothing, counts nothing against the client's plan
    quotas, and leaves a plan already under its key as it was. A plan of exactly the
    limit is installed."""
    cfg = daemon_config(tmp_path, None, **{"prefetch.lookahead": "0"})
    urls = [f"s3://b/shard-{i:04d}.tar" for i in range(5)]
    with thread_daemon(cfg) as d:
        server = d.daemon.server
        d.call(lambda: setattr(server.plans, "max_plan_shards", 4))  # the Server's parameter

        def held() -> tuple[int, int]:
            return d.call(lambda: (server.plan_quota.total_held, server.plan_urls.total_held))

        conn = Connection(d.socket)
        try:
            with pytest.raises(RemoteError) as refused:
                conn.request({"op": "plan", "plan": "p", "urls": urls, "job": "j"})
            assert refused.value.code == "bad_request"
            assert str(refused.value) == "a plan may name at most 4 shards"
            assert status(d)["plans"] == [] and held() == (0, 0)

            conn.request({"op": "plan", "plan": "p", "urls": urls[:4], "job": "j"})
            assert [(p["stream"], p["shards"]) for p in status(d)["plans"]] == [("p", 4)]
            assert held() == (1, 4)
            # Refused as a replacement too: the plan under the key stays whole.
            with pytest.raises(RemoteError, match="at most 4 shards"):
                conn.request({"op": "plan", "plan": "p", "urls": urls, "job": "j"})
            assert [(p["stream"], p["shards"]) for p in status(d)["plans"]] == [("p", 4)]
            assert held() == (1, 4)
        finally:
            conn.close()


def test_a_plan_names_at_most_1_000_000_shards_by_default_as_documented(tmp_path: Path) -> None:
    """docs/protocol.md and docs/operations.md: a plan names at most 1,000,000 shards. A
    daemon as configured refuses a plan of 1,000,001 at once (before checking its URLs),
    saying so, and keeps serving."""
    assert Server.__init__.__kwdefaults__["max_plan_shards"] == 1_000_000
    cfg = daemon_config(tmp_path, None, **{"prefetch.lookahead": "0"})
    with thread_daemon(cfg) as d:
        server = d.daemon.server
        assert d.call(lambda: server.plans.max_plan_shards) == 1_000_000
        conn = Connection(d.socket)
        try:
            urls = [f"s3://b/{i}" for i in range(1_000_001)]
            with pytest.raises(RemoteError) as refused:
                conn.request({"op": "plan", "plan": "p", "urls": urls, "job": "j"})
            assert refused.value.code == "bad_request"
            assert str(refused.value) == "a plan may name at most 1000000 shards"
            assert status(d)["plans"] == []
            assert d.call(lambda: server.plan_urls.total_held) == 0
            assert conn.request({"op": "status"})[0]["ok"]
        finally:
            conn.close()


def test_a_whole_read_if_resident_pins_a_shard_only_while_pins_hold_at_most_half_the_tier(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """A reader's whole reads ahead (``if_resident``) may pin a resident shard only while
    the tier's pinned bytes, that shard's included, stay within half the capacity, so
    that pins ahead never leave too little room for the shards readers wait for. Past
    that the daemon answers ``resident: false`` and pins nothing; a shard some stream
    already pins is read whole whatever the others pin. Checked at the bound itself."""
    # a: 200 KB, b: 100 KB, t: 10 KB (each sample 10 KB).
    urls = upload(s3_server, bucket, dataset_shards(3, [20, 10, 1], payload=10_000))
    a, b, t = urls
    values = {"prefetch.lookahead": "0"}
    # A first daemon brings the shards in. A second one on the same directory loads them,
    # with a capacity of exactly twice a's and b's sizes in the tier (data and sidecar).
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url, **values)) as d:
        conn = Connection(d.socket)
        for url in urls:
            conn.request({"op": "open", "url": url, "stream": "bring", "pin": False})
        conn.close()
        hot = d.daemon.hot
        size = d.call(lambda: {s.url: s.reserved_bytes for s in hot.resident()})
    capacity = 2 * (size[a] + size[b])
    cfg = daemon_config(tmp_path, s3_server.endpoint_url, **values, **{"cache.capacity": capacity})
    with thread_daemon(cfg) as d:
        hot = d.daemon.hot
        assert d.call(lambda: {s.url: s.reserved_bytes for s in hot.resident()}) == size
        assert d.call(lambda: hot.capacity_bytes) == capacity
        ctx: zmq.Context[Any] = zmq.Context()
        sock = raw_dealer(ctx, d.socket)
        ids = itertools.count(1)

        def request(**fields: Any) -> Any:
            reply = ask(sock, {"id": next(ids), **fields})
            assert reply["ok"] is True, reply
            return reply

        def whole_if_resident(url: str) -> Any:
            fields = {"url": url, "start": 0, "whole": True, "if_resident": True}
            return request(op="read", stream="ahead", **fields)

        def read_whole(url: str) -> None:
            reply = whole_if_resident(url)
            assert reply.get("end") is True and len(reply.get("samples", ())) == 10, reply

        def pinned_bytes() -> int:
            return int(d.call(lambda: hot.pinned_total))

        try:
            for url in urls:  # the store's answers are fresh again: the shards are resident
                request(op="open", url=url, stream="look", pin=False)
            # Nothing pinned: b is read whole (and, read through the socket to its last
            # sample, given back).
            read_whole(b)
            assert until(lambda: pinned_bytes() == 0)
            # a pinned: a + b is exactly half the tier, still allowed.
            request(op="open", url=a, stream="hold")
            assert pinned_bytes() == size[a]
            read_whole(b)
            assert until(lambda: pinned_bytes() == size[a])
            # a and t pinned: b would pass half the tier by t's bytes; nothing is pinned.
            request(op="open", url=t, stream="hold")
            refused = whole_if_resident(b)
            assert refused.get("resident") is False and "samples" not in refused, refused
            assert pinned_bytes() == size[a] + size[t] and pinned(d) == 2
            # b pinned by another stream: read whole, whatever the others pin.
            request(op="open", url=b, stream="other")
            read_whole(b)
            assert pinned_bytes() == size[a] + size[t] + size[b]
        finally:
            sock.close(0)
            ctx.term()


def test_a_connection_that_read_more_than_32_shard_files_holds_at_most_32_and_reads_right(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """A reader that reads 40 shards from their files, and keeps every reply to read again
    (no ``done`` closes a file), holds at most 32 of the tier's files open at any time.
    Every sample's bytes are right, also from the replies whose files the connection
    closed meanwhile (opened again), and every byte came from the files."""
    n, per, payload = 40, 3, 2000
    shards = dataset_shards(n, per, payload=payload)
    urls = upload(s3_server, bucket, shards)
    want = expected(shards, per, payload)
    config, socket = serve_config(tmp_path, s3_server.endpoint_url)
    hot_dir = tmp_path / "hot"
    assert MAX_OPEN_FILES == 32
    with ProcessDaemon(config, socket) as daemon:  # its own descriptors are not ours
        conn = Connection(socket, local_reads=True)
        replies = []
        most = 0

        def check(header: Any, frames: Any) -> int:
            members = [(key, m[0]) for key, ms in header["samples"] for m in ms]
            assert len(members) == len(frames) == 2 * per
            for (key, ext), frame in zip(members, frames, strict=True):
                right = want[key] if ext == "bin" else str(int(key[-5:]) % 10).encode()
                assert frame.bytes == right, f"wrong bytes for {key}.{ext}"
            return len(held_files(hot_dir))

        try:
            for url in urls:
                header, frames = conn.request(
                    {"op": "read", "url": url, "stream": "s", "start": 0, "count": per}
                )
                assert "local" in header, header
                replies.append((header, frames))
                most = max(most, check(header, frames))
            assert most == MAX_OPEN_FILES
            for header, frames in replies:  # oldest first: each file was closed, reopens
                most = max(most, check(header, frames))
            assert most == MAX_OPEN_FILES
            counters = daemon.status()["counters"]
        finally:
            conn.close()
        assert held_files(hot_dir) == []
    assert counters["local_fallback_bytes"] == 0
    assert counters["served_bytes"] == counters["local_read_bytes"] > 0
