"""The client's receive layer and its errors, against a scripted daemon (a real ROUTER
socket that can misbehave) and a real one: every error a user sees is a
``CachedClientError``, and no error leaves the connection poisoned."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cached_client
import numpy as np
import pytest
import torch
from cached_client import (
    CachedClientError,
    CachedDataset,
    DaemonTimeout,
    DaemonUnavailable,
    FastLoader,
    ProtocolError,
    ShardNotFound,
    UsageError,
    VersionMismatch,
)
from cached_client.device import require_device
from cached_client.transport import Connection
from cached_wire import protocol as wire
from cached_wire.protocol import Header, encode
from torch.utils.data import DataLoader

from tests.daemon import daemon_config, make_tar, thread_daemon
from tests.s3server import S3Server
from tests.scripted import Script, ok, scripted_daemon

URL = "s3://b/shard.tar"
N, SIZE = 12, 10  # samples of the scripted shard, bytes of each one's only member


def member(i: int) -> bytes:
    return bytes([i]) * SIZE


def shard_script(bad_reads: int = 0, short_frame: bool = True) -> Script:
    """Serves one shard of ``N`` samples ``k{i}`` with an ``x`` member; the first
    ``bad_reads`` reads get a reply whose second frame is short (or missing)."""
    bad = itertools.count()

    def script(h: Header) -> list[bytes] | None:
        if h["op"] == "open":
            return [ok(h, url=URL, samples=N, size=N * SIZE, payload=N * SIZE)]
        if h["op"] in ("plan", "close"):
            return [ok(h)]
        start, stop = h["start"], min(N, h["start"] + h["count"])
        samples = [[f"k{i:02d}", [["x", SIZE]]] for i in range(start, stop)]
        frames = [member(i) for i in range(start, stop)]
        if next(bad) < bad_reads:
            frames = [*frames[:1], frames[1][:3], *frames[2:]] if short_frame else frames[:1]
        head = ok(h, start=start, next=stop, end=stop == N, samples=samples)
        return [head, *frames]

    return script


def read_epoch(loader: FastLoader) -> dict[str, bytes]:
    out = {}
    for batch in loader:
        data, offs = batch.data["x"].numpy(), batch.offsets["x"]
        for i, key in enumerate(batch.keys):
            out[key] = data[offs[i] : offs[i + 1]].tobytes()
    return out


EXPECTED = {f"k{i:02d}": member(i) for i in range(N)}


@pytest.mark.parametrize("short_frame", [True, False], ids=["short-frame", "missing-frame"])
def test_a_bad_reply_fails_the_epoch_and_not_the_next(tmp_path: Path, short_frame: bool) -> None:
    with scripted_daemon(tmp_path, shard_script(bad_reads=1, short_frame=short_frame)) as ep:
        loader = FastLoader(URL, batch_size=5, socket=ep)
        with pytest.raises(ProtocolError, match=r"k0\d\.x: ") as caught:
            read_epoch(loader)
        assert isinstance(caught.value, CachedClientError)
        # The rest of the bad reply was drained: the next epoch reads clean headers.
        assert read_epoch(loader) == EXPECTED


def test_leaving_mid_reply_does_not_poison_the_next_epoch(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """A batch boundary inside a reply, and the user breaks out there: the reply's other
    frames are still on the socket. The next epoch must not take one for a header."""
    samples = [(f"m{i:03d}", {"x": bytes([i]) * 64}) for i in range(50)]
    s3_server.put(bucket, "m.tar", make_tar(samples))
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        loader = FastLoader(f"s3://{bucket}/m.tar", batch_size=3, socket=d.socket)
        for _ in loader:
            break  # one read carries all 50 samples: 47 frames left unread
        assert read_epoch(loader) == {k: m["x"] for k, m in samples}


def test_a_reply_left_unread_is_drained_before_the_next(tmp_path: Path) -> None:
    with scripted_daemon(tmp_path, shard_script()) as ep:
        conn = Connection(ep)
        read = {"op": "read", "url": URL, "stream": "s", "start": 0, "count": 4}
        reply = conn.receive(conn.send(read), in_place=True)
        buf = np.zeros(SIZE, dtype=np.uint8)
        assert reply.read_into(buf) == SIZE and buf.tobytes() == member(0)
        _, frames = conn.request({**read, "start": 4})  # 3 frames of the first unread
        assert [bytes(f.buffer) for f in frames] == [member(i) for i in range(4, 8)]
        with pytest.raises(ProtocolError, match="discarded"):
            reply.read_into(buf)  # the old reply's frames are gone, and it says so
        conn.close()


def test_a_header_that_is_not_json_is_a_protocol_error(tmp_path: Path) -> None:
    with scripted_daemon(tmp_path, lambda h: [b"\xff not json"]) as ep:
        with pytest.raises(ProtocolError, match="not JSON") as caught:
            Connection(ep).request({"op": "status"})
        # Both the client's base and the wire protocol's error type.
        assert isinstance(caught.value, CachedClientError)
        assert isinstance(caught.value, wire.ProtocolError)


def test_a_silent_daemon_times_out_as_daemon_timeout(tmp_path: Path) -> None:
    # Answers pings (alive) but never the request: a timeout, not a reconnect loop.
    with scripted_daemon(tmp_path, lambda h: None) as ep:
        conn = Connection(ep, request_timeout_s=1.5)
        with pytest.raises(DaemonTimeout, match="within 2s") as caught:
            conn.request({"op": "status"})
        assert isinstance(caught.value, TimeoutError)


def test_version_mismatch_is_exported_and_raised(tmp_path: Path) -> None:
    def hello(h: Header) -> list[bytes]:
        return [encode(wire.error(h["id"], wire.ErrorCode.VERSION, "speaks v9"))]

    with (
        scripted_daemon(tmp_path, lambda h: None, hello=hello) as ep,
        pytest.raises(cached_client.VersionMismatch, match="v9"),
    ):
        Connection(ep).open()
    assert cached_client.VersionMismatch is VersionMismatch


def _provokers(tmp: Path, s3: S3Server, bucket: str) -> dict[str, Callable[[], Any]]:
    """One way to provoke each error a user can meet."""
    s3.put(bucket, "bad.tar", b"this is no tar archive" * 40)
    s3.put(bucket, "ok.tar", make_tar([(f"v{i}", {"a": b"1" * (i + 1)}) for i in range(4)]))
    dead = f"ipc://{tmp}/nobody.sock"

    def stale() -> None:
        with thread_daemon(daemon_config(tmp / "d1", s3.endpoint_url)) as d:
            batches = list(FastLoader(f"s3://{bucket}/ok.tar", batch_size=1, socket=d.socket))
            assert batches[0].data  # taken after the ring moved past it: raises

    def in_worker(url: str) -> Callable[[], None]:
        def run() -> None:
            with thread_daemon(daemon_config(tmp / "d2", s3.endpoint_url)) as d:
                ds = CachedDataset(url, socket=d.socket)
                list(DataLoader(ds, batch_size=None, num_workers=1))

        return run

    def view_of_uneven() -> None:
        with thread_daemon(daemon_config(tmp / "d3", s3.endpoint_url)) as d:
            for b in FastLoader(f"s3://{bucket}/ok.tar", batch_size=4, socket=d.socket):
                b.view("a")

    return {
        "unavailable": lambda: list(FastLoader(URL, batch_size=1, socket=dead)),
        "unavailable-dataset": lambda: list(CachedDataset(URL, socket=dead)),
        "not-found-in-worker": in_worker(f"s3://{bucket}/nope.tar"),
        "not-a-tar-in-worker": in_worker(f"s3://{bucket}/bad.tar"),
        "bad-url": lambda: FastLoader("http://x/y.tar", batch_size=1),
        "bad-batch-size": lambda: FastLoader(URL, batch_size=0),
        "bad-rank": lambda: CachedDataset(URL, rank=3, world_size=2),
        "bad-malloc-mode": lambda: cached_client.memory.resolve_mode("fast"),
        "stale-batch": stale,
        "uneven-view": view_of_uneven,
        "no-cuda": lambda: FastLoader(URL, batch_size=1, device="cuda:99"),
    }


PROVOKED = [
    "unavailable",
    "unavailable-dataset",
    "not-found-in-worker",
    "not-a-tar-in-worker",
    "bad-url",
    "bad-batch-size",
    "bad-rank",
    "bad-malloc-mode",
    "stale-batch",
    "uneven-view",
    "no-cuda",
]


@pytest.mark.parametrize("case", PROVOKED)
def test_every_error_a_user_sees_is_a_cached_client_error(
    case: str, s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    with pytest.raises(Exception) as caught:
        _provokers(tmp_path, s3_server, bucket)[case]()
    assert isinstance(caught.value, CachedClientError), repr(caught.value)
    expected = {
        "unavailable": DaemonUnavailable,
        "unavailable-dataset": DaemonUnavailable,
        "not-found-in-worker": ShardNotFound,
        "bad-url": UsageError,
        "bad-batch-size": UsageError,
        "bad-rank": UsageError,
        "bad-malloc-mode": UsageError,
        "stale-batch": cached_client.StaleBatch,
        "uneven-view": UsageError,
        "no-cuda": cached_client.DeviceUnavailable,
    }.get(case)
    if expected is not None:
        assert isinstance(caught.value, expected), repr(caught.value)
    if case.startswith("bad-") or case == "uneven-view":
        assert isinstance(caught.value, ValueError)  # code catching ValueError still works


def test_every_exported_error_derives_from_the_base() -> None:
    errors = [getattr(cached_client, n) for n in cached_client.__all__ if n.endswith("Error")]
    errors += [cached_client.DaemonUnavailable, cached_client.DaemonTimeout]
    errors += [cached_client.ShardNotFound, cached_client.NotATar, cached_client.StaleBatch]
    errors += [cached_client.DeviceUnavailable, cached_client.VersionMismatch]
    assert all(issubclass(e, CachedClientError) for e in errors)
    # A DataLoader re-raises a worker's error as type(exc)(message): one argument must do.
    assert all(str(e("why")) == "why" for e in errors)


def test_a_cuda_device_the_node_lacks_is_refused_on_any_node() -> None:
    """The "no-cuda" case above uses an index no machine has, so it holds on GPU nodes too.
    Here: the index one past this node's last device is refused, whatever the node; and
    where torch sees no CUDA, bare "cuda" is refused the same way (see test_fast.py)."""
    count = torch.cuda.device_count()
    with pytest.raises(cached_client.DeviceUnavailable):
        require_device(f"cuda:{count}")
    if torch.cuda.is_available():
        assert require_device("cuda").type == "cuda"
    else:
        assert count == 0
        with pytest.raises(cached_client.DeviceUnavailable, match="CUDA is not available"):
            require_device("cuda")


def test_an_early_reply_is_stashed_and_read_in_place_later(tmp_path: Path) -> None:
    """The second request's reply is awaited first: the first one's arrives before it and
    is stashed with its frames, then received in place like one still on the socket."""
    with scripted_daemon(tmp_path, shard_script()) as ep:
        conn = Connection(ep)
        read = {"op": "read", "url": URL, "stream": "s", "count": 3}
        first, second = conn.send({**read, "start": 0}), conn.send({**read, "start": 3})
        _, frames = conn.wait(second)
        assert [bytes(f.buffer) for f in frames] == [member(i) for i in range(3, 6)]
        assert conn.has_reply(first)
        reply = conn.receive(first, in_place=True)
        bufs = [np.zeros(SIZE, dtype=np.uint8) for _ in range(3)]
        assert [reply.read_into(b) for b in bufs] == [SIZE] * 3
        assert [b.tobytes() for b in bufs] == [member(i) for i in range(3)]
        with pytest.raises(ProtocolError, match="fewer payload frames"):
            reply.read_into(bufs[0])
        conn.close()
