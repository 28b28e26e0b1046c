"""Malformed request headers against a real daemon: deeply nested JSON, and ``id``/``op``
of the wrong type, are ``bad_request`` (not ``internal`` with a traceback in the log), and
the daemon keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from cached_wire.protocol import ErrorCode, ProtocolError, decode, encode

from tests.daemon import ProcessDaemon, serve_config

DEEP = 50_000
# An open that gives pins back with it ("release": see docs/protocol.md).
OPEN = {"op": "open", "id": 1, "url": "s3://b/a.tar", "stream": "s"}


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[ProcessDaemon]:
    # Nothing is fetched: an endpoint nobody listens on.
    with ProcessDaemon(*serve_config(tmp_path, "http://127.0.0.1:9")) as d:
        yield d


@pytest.fixture
def ask(daemon: ProcessDaemon) -> Iterator[object]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(daemon.socket)

    def ask(frame: bytes) -> dict[str, object]:
        sock.send(frame)
        assert sock.poll(10_000), "the daemon did not answer"
        return decode(sock.recv_multipart()[0])

    yield ask
    sock.close(linger=0)
    ctx.term()


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (b"[" * DEEP + b"]" * DEEP, "nested too deeply"),
        (b'{"op":"hello","id":1,"v":' + b"[" * DEEP + b"]" * DEEP + b"}", "nested too deeply"),
        (b'{"op":"hello","id":1,"v":' + b'{"a":' * DEEP + b"1" + b"}" * DEEP + b"}", "too deeply"),
        (b'{"op":"hello","id":1,"v":1,"x":' + b"[" * 30 + b"]" * 30 + b"}", "more than 8 levels"),
        # Deep enough for str() of it to exhaust the stack, shallow enough to decode.
        (
            b'{"op":"plan","id":1,"plan":"p","urls":[],"job":' + b"[" * 900 + b"]" * 900 + b"}",
            "levels",
        ),
        (encode({"op": "hello", "id": [[[1]]], "v": 1}), "'id' must be an integer"),
        (encode({"op": "hello", "id": True, "v": 1}), "'id' must be an integer"),
        (encode({"op": [["hello"]], "id": 1, "v": 1}), "'op' must be one of"),
        (encode({"id": 1}), "'op' must be one of"),
        (encode({**OPEN, "release": "s3://b/a.tar"}), "'release' must list at most"),
        (encode({**OPEN, "release": ["s3://b/a.tar", 7]}), "'release' must be a list of URLs"),
        (encode({**OPEN, "release": ["s3://b/a.tar"] * 65}), "'release' must list at most 64"),
    ],
    ids=[
        "arrays-top-level",
        "arrays-in-a-field",
        "objects-in-a-field",
        "over-the-limit",
        "plan-job",
        "id-nested",
        "id-bool",
        "op-nested",
        "op-missing",
        "release-not-a-list",
        "release-not-urls",
        "release-too-many",
    ],
)
def test_malformed_headers_are_bad_requests_and_the_daemon_keeps_serving(
    daemon: ProcessDaemon, ask: object, frame: bytes, message: str
) -> None:
    reply = ask(frame)  # type: ignore[operator]
    assert reply["ok"] is False and reply["code"] == ErrorCode.BAD_REQUEST, reply
    assert message in str(reply["message"])
    assert ask(encode({"op": "hello", "id": 2, "v": 1}))["ok"] is True  # type: ignore[operator]
    assert daemon.status()["ready"]
    log = daemon.log_tail(100_000)
    assert "Traceback" not in log and "ERROR" not in log, log


def test_decode_refuses_deep_nesting_on_the_client_side_too() -> None:
    with pytest.raises(ProtocolError, match="nested too deeply"):
        decode(b'{"a":' + b"[" * DEEP + b"]" * DEEP + b"}")
    with pytest.raises(ProtocolError, match="more than 3 levels"):
        decode(b'{"a":[[[1]]]}', max_depth=3)
    assert decode(b'{"a":[[1]]}', max_depth=3) == {"a": [[1]]}
