"""The local data plane: readers on the daemon's node read sample bytes from the hot tier's
files, the socket carrying only control messages; where they cannot (another mount, a
namesake file), they read through the socket, chosen automatically.

Real parts: the moto S3 server, a real daemon, real ZeroMQ, DataLoader worker processes,
and for "a container without the mount" a client process in a mount namespace of its own
(``unshare -m``) with a tmpfs over the hot tier's directory.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Any

import cached_client.local as local_module
import pytest
from cached_client import CachedDataset, FastLoader, LocalReadsUnavailable
from cached_client.local import MAX_GAP
from cached_client.reader import read_shard
from cached_client.transport import Connection
from torch.utils.data import DataLoader

from cached_demo.tars import make_tar
from tests.daemon import daemon_config, dataset_shards, thread_daemon
from tests.s3server import S3Server
from tests.test_daemon import upload
from tests.test_integrity import flip

ROOT = Path(__file__).resolve().parents[1]


def expected(shards: list[bytes], per: int, payload: int) -> dict[str, bytes]:
    """Each sample's ``bin`` bytes, as ``dataset_shards`` makes them."""
    out = {}
    for s in range(len(shards)):
        for i in range(per):
            key = f"s{s:04d}-{i:05d}"
            out[key] = (key.encode() * (payload // len(key) + 1))[:payload]
    return out


@pytest.fixture
def data(s3_server: S3Server, bucket: str) -> tuple[list[str], dict[str, bytes]]:
    shards = dataset_shards(6, 20, payload=5000)
    return upload(s3_server, bucket, shards), expected(shards, 20, 5000)


def test_every_sample_once_with_workers_and_no_byte_through_the_socket(
    s3_server: S3Server, data: tuple[list[str], dict[str, bytes]], tmp_path: Path
) -> None:
    urls, want = data
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        for epoch in range(2):  # cold, then warm
            ds = CachedDataset(urls, socket=d.socket, shuffle=True, seed=1)
            ds.set_epoch(epoch)
            got = list(DataLoader(ds, batch_size=None, num_workers=2, timeout=60))
            assert Counter(s["__key__"] for s in got) == Counter(want.keys())
            assert all(s["bin"] == want[s["__key__"]] for s in got)
        served, local = d.served()
        hot = d.daemon.hot
        leases = d.leases_left()
    # Every payload byte of both epochs (bin, and a cls of one digit) came from the files.
    assert served == local == 2 * sum(len(v) + 1 for v in want.values())
    # The readers closed what they read: no lease left behind.
    assert leases == 0
    # The security model: the daemon's group may read, nobody else.
    assert hot.dir.stat().st_mode & 0o777 == 0o750
    assert {p.stat().st_mode & 0o777 for p in hot.dir.glob("*.tar")} == {0o640}


def test_fast_loader_reads_the_files_into_its_ring(
    s3_server: S3Server, data: tuple[list[str], dict[str, bytes]], tmp_path: Path
) -> None:
    urls, want = data
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        loader = FastLoader(urls, socket=d.socket, batch_size=16, exts=["bin"])
        seen = {}
        for batch in loader:
            data, offs = batch.data["bin"].numpy(), batch.offsets["bin"]
            for i, key in enumerate(batch.keys):
                seen[key] = data[offs[i] : offs[i + 1]].tobytes()
        served, local = d.served()
    assert seen == want
    assert served == local == sum(map(len, want.values()))


@pytest.mark.parametrize("reader", ["compiled", "python"])
def test_fast_loader_reads_runs_of_members_in_one_call_and_skips_what_it_was_not_asked(
    s3_server: S3Server,
    bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    reader: str,
) -> None:
    """FastLoader reads the members of a run of samples with one ``preadv`` (the tar
    headers between them into scratch space), splits a run at a member it did not ask for
    that is larger than the gap a read may span, and every byte lands where it belongs:
    members of uneven sizes, one empty, batches that end mid-shard. The compiled reader
    (D32) does the same in one call per reply and batch; tests/test_gather.py compares
    the two member by member."""
    rng = random.Random(7)
    want: dict[str, tuple[bytes, bytes]] = {}
    shards = []
    for s in range(3):
        samples = []
        for i in range(30):
            key = f"k{s}-{i:03d}"
            a = rng.randbytes(rng.choice([0, 1, 511, 512, 513, rng.randrange(1, 9000)]))
            c = str(i).encode()
            big = rng.randbytes(MAX_GAP + 1000) if i % 7 == 3 else b"b"
            samples.append((key, {"a": a, "big": big, "c": c}))
            want[key] = (a, c)
        shards.append(make_tar(samples))
    urls = upload(s3_server, bucket, shards)
    calls = []
    real = os.preadv
    compiled = local_module.GATHER
    if reader == "python":
        monkeypatch.setattr(local_module, "GATHER", None)

    def counted(fd: int, buffers: Any, offset: int) -> int:
        calls.append(len(buffers))
        return real(fd, buffers, offset)

    packed = []

    class Counted:  # the compiled reader, its calls counted
        @staticmethod
        def layout_packed(*args: Any) -> Any:
            packed.append(1)
            return compiled.layout_packed(*args)

        @staticmethod
        def read(*args: Any) -> Any:
            calls.append(-1)
            return compiled.read(*args)

    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        loader = FastLoader(urls, socket=d.socket, batch_size=16, exts=["a", "c"])
        loader.lengths()  # the shards resident, so every read below is local
        monkeypatch.setattr(os, "preadv", counted)
        if reader == "compiled":
            monkeypatch.setattr(local_module, "GATHER", Counted)
        seen = {}
        for batch in loader:
            a, c = batch.data["a"].numpy(), batch.data["c"].numpy()
            oa, oc = batch.offsets["a"], batch.offsets["c"]
            for i, key in enumerate(batch.keys):
                seen[key] = (a[oa[i] : oa[i + 1]].tobytes(), c[oc[i] : oc[i + 1]].tobytes())
        monkeypatch.undo()
        served, local = d.served()
    assert seen == want
    assert served == local
    # 180 members asked for; split at each big member skipped (13) and at batch ends.
    assert 0 < len(calls) < 180 // 4
    # Each reader alone: the compiled one never calls os.preadv, the Python one does.
    assert set(calls) == {-1} if reader == "compiled" else -1 not in calls
    # The compiled reader laid the packed layouts out (D34); the Python one decoded them.
    assert bool(packed) == (reader == "compiled")


def test_a_local_reader_gives_its_pins_back_with_its_next_request(
    s3_server: S3Server, data: tuple[list[str], dict[str, bytes]], tmp_path: Path
) -> None:
    """A local reader holds a shard's pin until it has closed the file; it gives the pin
    back with its next open or read ("release"), not with a ``close`` of its own: one
    request less per shard for the daemon. The last shard's goes by ``close``; no lease
    is left behind."""
    urls, want = data
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        requests = d.daemon.metrics.requests

        def closes() -> float:
            return d.call(requests.labels("close", "ok")._value.get)

        FastLoader(urls, socket=d.socket, batch_size=8).lengths()  # resident: local reads
        before = closes()
        loader = FastLoader(urls, socket=d.socket, batch_size=8, inflight=2)
        seen = [key for batch in loader for key in batch.keys]
        after = closes()
        leases = d.leases_left()
    assert sorted(seen) == sorted(want)
    # Of 6 shards: those whose reader sent nothing more (the last ones) close.
    assert after - before <= 2
    assert leases == 0


def test_a_whole_shards_layout_is_made_once_per_request_kind_and_stays_right(
    s3_server: S3Server, data: tuple[list[str], dict[str, bytes]], tmp_path: Path
) -> None:
    """The daemon encodes a whole shard's local layout once (per set of extensions asked
    for) and sends the same bytes again; a part of a shard is listed afresh."""
    urls, want = data
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        conn = Connection(d.socket)
        read = {"op": "read", "url": urls[0], "stream": "t", "start": 0, "count": 20}
        replies = [conn.request({**read, **extra})[0] for extra in ({}, {}, {"exts": ["bin"]})]
        part = conn.request({**read, "start": 5, "count": 3})[0]
        conn.close()
        shard = d.call(lambda: d.daemon.hot.get(Path(replies[0]["local"]["path"]).stem))
    index = shard.index
    layout = [
        [s.key, [[m.ext, m.size, m.offset, m.checksum] for m in s.members]] for s in index.samples
    ]
    assert replies[0]["samples"] == replies[1]["samples"] == layout
    assert replies[2]["samples"] == [[k, [m for m in ms if m[0] == "bin"]] for k, ms in layout]
    assert part["samples"] == layout[5:8]
    assert len(index.memo) == 2  # everything, and bin alone; not the part
    # The members' bytes are where the layout says.
    blob = Path(replies[0]["local"]["path"]).read_bytes()
    for key, members in layout:
        offset, size = members[0][2], members[0][1]
        assert blob[offset : offset + size] == want[key]


def test_a_reply_that_arrived_is_seen_without_waiting_for_it(
    s3_server: S3Server, data: tuple[list[str], dict[str, bytes]], tmp_path: Path
) -> None:
    """``has_reply`` takes the replies already on the socket off it: a reader's pipeline
    sends its next read as soon as that shard's open is answered, not a round trip later."""
    urls, _ = data
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        conn = Connection(d.socket)
        rid = conn.send({"op": "open", "url": urls[0], "stream": "t", "pin": False})
        deadline = time.monotonic() + 30
        while not conn.has_reply(rid):
            assert time.monotonic() < deadline, "the open's reply was never seen"
            time.sleep(0.01)
        header, _ = conn.wait(rid)
        conn.close()
    assert header["samples"] == 20


def test_bytes_stay_right_when_the_daemon_evicts_the_shard_mid_read(
    s3_server: S3Server, data: tuple[list[str], dict[str, bytes]], tmp_path: Path
) -> None:
    """A local reader's file stays readable after the daemon unlinks it (a lease that
    lapsed, a forced eviction): the open descriptor keeps the bytes."""
    urls, want = data
    bucket = urls[0].split("/")[2]
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        conn = Connection(d.socket)
        read = {"op": "read", "url": urls[0], "stream": "t", "count": 10}
        header, frames = conn.request({**read, "start": 0})
        assert "local" in header
        path, ino = Path(header["local"]["path"]), header["local"]["ino"]
        got = [bytes(f.bytes) for f in frames]  # read from the file: it is open now
        assert opened(ino), "the reader does not have the shard's file open"
        second = conn.receive(conn.send({**read, "start": 10}))  # answered, not yet taken
        hot = d.daemon.hot
        d.call(lambda: hot._evict(hot.get(path.stem, access=False)))
        deadline = time.monotonic() + 30
        while path.exists() or list(hot.dir.glob("*.evicted")):  # unlinked in a thread
            assert time.monotonic() < deadline, "the evicted file was never unlinked"
            time.sleep(0.01)
        got += [bytes(f.bytes) for f in second.frames()]
        assert opened(ino)  # still the same open file, now unlinked
        served, local = d.served()
        conn.close()
    keys = [f"s0000-{i:05d}" for i in range(20)]
    assert got[0::2] == [want[k] for k in keys]  # bin, cls, bin, cls...
    # Every byte came from that file: no read fell back to the socket, which would have
    # had the daemon fetch the evicted shard again.
    assert local == served > 0
    assert s3_server.count("GET", f"/{bucket}/shard-0000.tar") == 1


def opened(ino: int) -> bool:
    """Whether this process holds the file of inode ``ino`` open (unlinked or not)."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.stat(f"/proc/self/fd/{fd}").st_ino == ino:
                return True
        except OSError:
            pass  # closed meanwhile (another thread's)
    return False


def in_mount_namespace(
    hot_dir: Path, socket: str, urls: list[str], mode: str, *, namesakes: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run a reader in a mount namespace where the hot tier's directory is an empty tmpfs
    (a container without the cache mount), or holds copies of its files (``namesakes``:
    the same names, other files). It prints the samples it read, or the error."""
    script = textwrap.dedent(
        f"""
        import json, sys
        from cached_client import CachedDataset
        ds = CachedDataset({urls!r}, socket={socket!r}, local_reads={mode})
        try:
            n = sum(1 for _ in ds)
        except Exception as exc:
            print(json.dumps({{"error": type(exc).__name__, "message": str(exc)}}))
        else:
            print(json.dumps({{"samples": n}}))
        """
    )
    copy = f"cp -a {hot_dir}/. /tmp/namesakes/ && " if namesakes else ""
    back = f"cp -a /tmp/namesakes/. {hot_dir}/ && " if namesakes else ""
    shell = (
        f"mkdir -p /tmp/namesakes && {copy}mount -t tmpfs none {hot_dir} && {back}"
        f"exec {sys.executable} -c {shlex.quote(script)}"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", shell],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def _needs_namespaces() -> None:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare (mount namespaces) for a reader without the mount")


@pytest.mark.parametrize("namesakes", [False, True], ids=["no-mount", "namesake-files"])
def test_a_reader_that_cannot_see_the_files_reads_through_the_socket(
    s3_server: S3Server,
    data: tuple[list[str], dict[str, bytes]],
    tmp_path: Path,
    namesakes: bool,
) -> None:
    _needs_namespaces()
    urls, want = data
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        if namesakes:
            assert sum(1 for _ in CachedDataset(urls, socket=d.socket)) == len(want)
        before = d.served()
        done = in_mount_namespace(d.daemon.hot.dir, d.socket, urls, "None", namesakes=namesakes)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout.splitlines()[-1]) == {"samples": len(want)}
        served, local = d.served()
        # Auto: every byte came through the socket, each counted once. (Its first reads
        # were answered as local ones, which it could not use and asked again for.)
        assert served - before[0] == sum(len(v) + 1 for v in want.values())
        assert local == before[1]
        # Nor did the local replies it could not use leave their leases (pins) behind.
        assert d.leases_left() == 0
        # Required: it says why and what to do.
        forced = in_mount_namespace(d.daemon.hot.dir, d.socket, urls, "True", namesakes=namesakes)
    out = json.loads(forced.stdout.splitlines()[-1])
    assert out["error"] == "LocalReadsUnavailable", forced.stderr
    why = "is not the daemon's file" if namesakes else "cannot open"
    assert why in out["message"] and "daemon's node" in out["message"]


def test_local_reads_off_at_the_daemon_or_the_client(
    s3_server: S3Server, data: tuple[list[str], dict[str, bytes]], tmp_path: Path
) -> None:
    urls, want = data
    cfg = daemon_config(tmp_path / "off", s3_server.endpoint_url, **{"server.local_reads": False})
    with thread_daemon(cfg) as d:
        assert sum(1 for _ in CachedDataset(urls, socket=d.socket)) == len(want)
        served, local = d.served()
        assert served > 0 and local == 0
        with pytest.raises(LocalReadsUnavailable, match="does not offer local reads"):
            next(iter(CachedDataset(urls, socket=d.socket, local_reads=True)))
    with thread_daemon(daemon_config(tmp_path / "on", s3_server.endpoint_url)) as d:
        ds = CachedDataset(urls, socket=d.socket, local_reads=False)
        assert sum(1 for _ in ds) == len(want)
        assert d.served()[1] == 0
    # Turned on over a hot tier written while they were off: the reloaded shards are
    # opened to the group too, and read locally at once.
    off_dir = tmp_path / "off" / "hot"
    for tar in off_dir.glob("*.tar"):
        tar.chmod(0o600)  # as a daemon with UMask=0077 leaves them
    cfg = daemon_config(tmp_path / "off", s3_server.endpoint_url)
    with thread_daemon(cfg) as d:
        assert {p.stat().st_mode & 0o777 for p in off_dir.glob("*.tar")} == {0o640}
        assert sum(1 for _ in CachedDataset(urls, socket=d.socket)) == len(want)
        served, local = d.served()
        assert served == local > 0


def test_a_bad_setting_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHED_LOCAL_READS", "sometimes")
    with pytest.raises(ValueError, match="CACHED_LOCAL_READS must be auto, on or off"):
        CachedDataset(["s3://b/a.tar"])
    monkeypatch.setenv("CACHED_LOCAL_READS", "off")
    assert CachedDataset(["s3://b/a.tar"]).local_reads is False


def rot(path: Path, offset: int) -> None:
    """Flip a byte as the disk would: in place, the file's identity (inode, size, mtime)
    unchanged, so that a local reader opens it as the daemon's file and must find the rot
    by its checksum (a changed mtime would send it to the socket for another reason)."""
    before = path.stat()
    flip(path, offset)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def _reader_found_rot(caplog: pytest.LogCaptureFixture) -> bool:
    """Whether the reader itself (not the daemon) logged a member failing its checksum."""
    return any(
        r.name.startswith("cached_client") and "fails its checksum" in r.getMessage()
        for r in caplog.records
    )


def _bins(loader: str, urls: list[str], socket: str) -> dict[str, bytes]:
    """Every sample's ``bin`` member, read by a CachedDataset or a FastLoader."""
    if loader == "dataset":
        return {s["__key__"]: s["bin"] for s in CachedDataset(urls, socket=socket)}
    assert loader.startswith("fast")
    got = {}
    for batch in FastLoader(urls, socket=socket, batch_size=8, exts=["bin"]):
        data, offs = batch.data["bin"].numpy(), batch.offsets["bin"]
        got.update((k, data[offs[i] : offs[i + 1]].tobytes()) for i, k in enumerate(batch.keys))
    return got


@pytest.mark.parametrize("loader", ["dataset", "fast", "fast-python"])
def test_a_rotten_byte_is_caught_by_the_reader_and_healed_through_the_socket(
    s3_server: S3Server,
    data: tuple[list[str], dict[str, bytes]],
    tmp_path: Path,
    *,
    loader: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The disk flips a byte of a resident shard. A local reader checks each member
    against the daemon's checksum (FastLoader: after reading a run of them at once), asks
    for that read through the socket, where the daemon finds the rot, drops the copy and
    fetches a good one: the bytes are right."""
    urls, want = data
    if loader == "fast-python":  # FastLoader where the compiled reader is not built
        monkeypatch.setattr(local_module, "GATHER", None)
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        assert sum(1 for _ in CachedDataset(urls[:1], socket=d.socket)) == 20
        hot = d.daemon.hot
        shard = d.call(lambda: next(iter(hot.resident())))
        member = shard.index.samples[3].members[0]
        rot(hot.path(shard), member.offset + 10)
        with caplog.at_level(logging.INFO, logger="cached_client.local"):
            got = _bins(loader, urls[:1], d.socket)
        corrupt = d.call(lambda: d.daemon.status()["counters"]["corrupt_shards"])
    assert got == {k: v for k, v in want.items() if k.startswith("s0000-")}
    assert _reader_found_rot(caplog)
    assert corrupt == 1


def test_members_taken_after_their_file_was_closed_are_still_right(
    s3_server: S3Server, data: tuple[list[str], dict[str, bytes]], tmp_path: Path
) -> None:
    """Local frames read their bytes when asked: one asked after the reader closed the
    shard's file (a caller that keeps raw samples) opens it again by path and identity,
    never reads a descriptor number that another file took since."""
    urls, want = data
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        conn = Connection(d.socket)
        raws = list(read_shard(conn, urls[0], "keep"))  # the span is done: file closed
        other = os.open(os.devnull, os.O_RDONLY)  # likely takes the freed number
        try:
            got = {key: bytes(members[0][1].bytes) for key, members in raws}
        finally:
            os.close(other)
        conn.close()
    assert got == {k: v for k, v in want.items() if k.startswith("s0000-")}


@pytest.mark.parametrize(
    "path", ["compiled", "python", "socket"], ids=["local-compiled", "local-python", "socket"]
)
def test_a_batch_across_shards_keeps_its_first_bytes_when_its_buffer_grows(
    s3_server: S3Server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """A batch that begins in one shard's reply and grows its buffer in the next one's:
    the members of the first are kept (the buffers grew without them before D32's tests
    found it: 1.5 MB of a 2.4 MB batch read back as zeros)."""
    shards = dataset_shards(3, 10, payload=150_000)  # 1.5 MB a shard, buffers start at 1 MiB
    urls = upload(s3_server, bucket, shards)
    want = expected(shards, 10, 150_000)
    if path == "python":
        monkeypatch.setattr(local_module, "GATHER", None)
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        got = {}
        loader = FastLoader(
            urls, socket=d.socket, batch_size=16, exts=["bin"], local_reads=path != "socket"
        )
        for batch in loader:
            data, offs = batch.data["bin"].numpy(), batch.offsets["bin"]
            got.update((k, data[offs[i] : offs[i + 1]].tobytes()) for i, k in enumerate(batch.keys))
        served, local = d.served()
    assert got == want
    assert served == sum(map(len, want.values()))
    assert local == (served if path != "socket" else 0)
