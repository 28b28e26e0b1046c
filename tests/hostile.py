"""Another local user against a real daemon, as a hostile or careless user's process would
be: :func:`as_other_user`, a forked child of the test that takes another uid (``nobody``
unless told) and speaks the protocol on a raw ZeroMQ socket of its own, its replies back as
JSON on a pipe; :class:`OtherUser`, a process under ``setpriv`` that keeps named
connections open between batches of requests; and the small helpers the bound tests share
(a socket every user may reach, a metric, a refusal, a wait).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import zmq
from cached_wire.protocol import decode, encode

from tests.daemon import serve_config
from tests.test_socket_access import NOBODY


def readable(stream: Any, timeout_s: float) -> bool:
    """Whether ``stream`` (a file or a descriptor) has something to read within
    ``timeout_s``. poll, not select: select refuses a descriptor numbered 1024 or more,
    which a long test session reaches."""
    poller = select.poll()
    poller.register(stream, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


def close_inherited(*keep: int) -> None:
    """In a forked child: close every descriptor the test process had but 0-2 and
    ``keep``, so that a descriptor limit the child sets counts only its own."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):  # the listing's own descriptor, gone already
                os.close(fd)


def as_other_user(
    endpoint: str,
    requests: Sequence[dict[str, Any]],
    *,
    uid: int = NOBODY,
    deaf_s: float = 0.0,
    timeout_s: float = 20.0,
) -> list[dict[str, Any]]:
    """Send ``requests`` (numbered by their ``id``, given one each) as user ``uid`` on one
    connection, and return the replies in order; the connection closes once they are in.
    Each is answered before the next is sent, unless ``deaf_s``: then all are sent at once,
    the child does not read for ``deaf_s`` (a client that does not take its replies), and
    then takes them all."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        out: dict[str, Any] = {}
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out["replies"] = _speak(endpoint, requests, deaf_s, timeout_s)
            out["uid"] = os.getuid()
        except BaseException as exc:
            out["error"] = repr(exc)
        finally:
            try:  # a parent that gave up has closed the pipe: exit all the same
                with os.fdopen(write, "wb") as pipe:
                    pipe.write(json.dumps(out).encode())
            finally:
                os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        assert readable(pipe, timeout_s + deaf_s + 10), "no word from the other user's process"
        data = pipe.read()
    os.waitpid(pid, 0)
    result: dict[str, Any] = json.loads(data)
    assert "error" not in result, result
    assert result["uid"] == uid
    replies: list[dict[str, Any]] = result["replies"]
    return replies


def _speak(
    endpoint: str, requests: Sequence[dict[str, Any]], deaf_s: float, timeout_s: float
) -> list[dict[str, Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if deaf_s:
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, 1 << 16)
    sock.connect(endpoint)
    numbered = [{**r, "id": i} for i, r in enumerate(requests, 1)]
    replies: dict[int, dict[str, Any]] = {}
    try:
        if deaf_s:
            for request in numbered:
                sock.send(encode(request))
            time.sleep(deaf_s)
        deadline = time.monotonic() + timeout_s
        for request in numbered:
            if not deaf_s:
                sock.send(encode(request))
            while request["id"] not in replies:
                assert time.monotonic() < deadline, f"no reply to {request['op']}"
                if sock.poll(100):
                    frames = sock.recv_multipart()
                    reply = decode(frames[0])
                    reply["payload_bytes"] = sum(len(f) for f in frames[1:])
                    replies[reply["id"]] = reply
    finally:
        sock.close(linger=0)
        ctx.term()
    return [replies[r["id"]] for r in numbered]


HOSTILE = f"uid {NOBODY}"

# Another local user's process, run as that user by OtherUser: connections of its own,
# named by the test; each line on its stdin is a batch of [connection, request] pairs, all
# sent at once, and their replies come back as one JSON line, in order (null: none within
# 30 s). A connection named "deaf..." takes one reply at a time (RCVHWM 1). Ops of its own:
# "_flood" sends up to n status requests without waiting and reads none (its reply: how
# many ZeroMQ took), "_frame" sends one raw frame of n MiB (its reply: whether anything
# came back within 1 s), "_disconnect" closes the connection. EOF ends it.
OTHER_USER = """
import json, os, sys, time, zmq
from cached_wire.protocol import decode, encode
ctx, socks, n = zmq.Context(), {}, 0
def sock_for(name):
    if name not in socks:
        sock = socks[name] = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if name.startswith("deaf"):
            sock.setsockopt(zmq.RCVHWM, 1)
        sock.connect(sys.argv[1])
    return socks[name]
print(json.dumps(os.getuid()), flush=True)
for line in sys.stdin:
    out, waiting = [], {}
    for name, request in json.loads(line):
        sock, op = sock_for(name), request["op"]
        if op == "_flood":
            sent = 0
            try:
                while sent < request["n"]:
                    sock.send(encode({"op": "status", "id": -1 - sent}), zmq.NOBLOCK)
                    sent += 1
            except zmq.Again:
                pass
            out.append({"sent": sent})
        elif op == "_frame":
            sock.send(b"x" * (request["n"] << 20))
            out.append({"answered": bool(sock.poll(1000))})
        elif op == "_disconnect":
            socks.pop(name).close(0)
            out.append({})
        else:
            n += 1
            sock.send(encode({**request, "id": n}))
            waiting[n] = (sock, len(out))
            out.append(None)
    deadline = time.monotonic() + 30
    while waiting and time.monotonic() < deadline:
        for sock in {s for s, _ in waiting.values()}:
            while sock.poll(10):
                reply = decode(sock.recv_multipart()[0])
                if reply.get("id") in waiting:
                    out[waiting.pop(reply["id"])[1]] = reply
    print(json.dumps(out), flush=True)
"""


class OtherUser:
    """OTHER_USER as uid ``uid`` (``setpriv``) against the daemon at ``endpoint``: a
    client of another local user that holds its connections, and what they hold, from one
    batch to the next. ``with`` ends it (its connections close with it)."""

    def __init__(self, endpoint: str, uid: int = NOBODY) -> None:
        ids = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        command = ["setpriv", *ids, sys.executable, "-c", OTHER_USER, endpoint]
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        assert json.loads(self.proc.stdout.readline()) == uid, "not running as the other user"

    def send(self, *batch: tuple[str, dict[str, Any]]) -> None:
        """Have it send ``batch``'s requests, each on its named connection, at once."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(batch) + "\n")
        self.proc.stdin.flush()

    def replies(self) -> list[Any]:
        """The replies to the batch sent last, in its order."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the other user's process ended ({self.proc.poll()})"
        replies: list[Any] = json.loads(line)
        return replies

    def ask(self, *batch: tuple[str, dict[str, Any]]) -> list[Any]:
        """:meth:`send` and :meth:`replies`."""
        self.send(*batch)
        return self.replies()

    def close(self) -> None:
        """End the process, and with it its connections."""
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> OtherUser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def shared(directory: Path, endpoint_url: str, **sections: dict[str, Any]) -> tuple[Path, str]:
    """A ``cached serve`` config in ``directory`` (one every user may search) whose socket
    admits every local user (mode 0666); ``sections`` adds keys to any section."""
    server = {"socket_mode": "0666", **sections.pop("server", {})}
    return serve_config(directory, endpoint_url, sections={"server": server, **sections})


def metric(http: str, sample: str) -> float:
    """The value of ``sample`` (a name and its labels, as written) on the daemon's
    /metrics at ``http``; 0 where it is not written (a counter never counted)."""
    with urllib.request.urlopen(f"{http}/metrics", timeout=10) as page:
        for line in page.read().decode().splitlines():
            if line.startswith(f"{sample} "):
                return float(line.split()[-1])
    return 0.0


def refused(reply: dict[str, Any], code: str = "limit_exceeded") -> str:
    """The message of ``reply``, a refusal with ``code``."""
    assert reply is not None and reply["ok"] is False and reply["code"] == code, reply
    message: str = reply["message"]
    return message


IN_FLIGHT = "cached_requests_in_flight"
LIMIT_EXCEEDED = 'cached_requests_total{op="unknown",result="limit_exceeded"}'


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
