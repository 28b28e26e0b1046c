"""The fast path (FastLoader) and the device helpers, against a real daemon."""

from __future__ import annotations

import collections
import hashlib
import io
import logging
import signal
import tarfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from cached_client import memory
from cached_client.buffers import Batch, Ring, Slot, buffer_size
from cached_client.device import (
    DeviceLoader,
    StallMeter,
    host_buffer,
    pinned_memory_available,
    to_device,
)
from cached_client.errors import CachedClientError, DeviceUnavailable, ShardNotFound, StaleBatch
from cached_client.fast import FastLoader

from tests.daemon import daemon_config, make_tar, thread_daemon
from tests.s3server import S3Server


def arrays_dataset(s3: S3Server, bucket: str, shards: int, per_shard: int) -> dict[str, np.ndarray]:
    """Shards of fixed-size float32 arrays ``x.f32`` and an int label ``y.i64``."""
    expected: dict[str, np.ndarray] = {}
    for s in range(shards):
        samples = []
        for i in range(per_shard):
            key = f"a{s:03d}-{i:04d}"
            x = np.full(16, s * 1000 + i, dtype=np.float32)
            expected[key] = x
            samples.append(
                (key, {"x.f32": x.tobytes(), "y.i64": np.int64(i).tobytes(), "txt": b"unused"})
            )
        s3.put(bucket, f"arr-{s:03d}.tar", make_tar(samples))
    return expected


def test_fast_loader_yields_every_sample_in_batches(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    expected = arrays_dataset(s3_server, bucket, shards=3, per_shard=50)
    urls = f"s3://{bucket}/arr-{{000..002}}.tar"
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        loader = FastLoader(urls, batch_size=16, exts=["x.f32", "y.i64"], socket=d.socket, ring=2)
        seen: dict[str, np.ndarray] = {}
        sizes = []
        for batch in loader:
            x = batch.view("x.f32", torch.float32, (16,))
            assert set(batch.data) == {"x.f32", "y.i64"}  # the daemon sent only these
            sizes.append(len(batch.keys))
            for key, row in zip(batch.keys, x, strict=True):
                seen[key] = row.numpy().copy()
        assert sizes == [16] * 9 + [6]
        assert seen.keys() == expected.keys()
        for key, x in expected.items():
            np.testing.assert_array_equal(seen[key], x)
        # drop_last and another epoch with shuffling
        loader = FastLoader(
            urls, batch_size=16, exts=["x.f32"], socket=d.socket, shuffle=True, drop_last=True
        )
        loader.set_epoch(3)
        keys = [k for b in loader for k in b.keys]
        assert len(keys) == 144 and len(set(keys)) == 144


def test_fast_loader_variable_sizes_and_offsets(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    samples = [(f"v{i:03d}", {"bin": bytes([i % 251]) * (i * 101 + 1)}) for i in range(40)]
    s3_server.put(bucket, "v.tar", make_tar(samples))
    got = {}
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        # Batches alias the ring's buffers: use each before taking `ring` more.
        for b in FastLoader(f"s3://{bucket}/v.tar", batch_size=7, socket=d.socket, ring=2):
            offs = b.offsets["bin"]
            data = b.data["bin"].numpy()
            for j, key in enumerate(b.keys):
                got[key] = data[offs[j] : offs[j + 1]].tobytes()
            with pytest.raises(ValueError, match="differ in size"):
                b.view("bin")
    assert got == {k: m["bin"] for k, m in samples}


def test_fast_loader_missing_shard(s3_server: S3Server, bucket: str, tmp_path: Path) -> None:
    with (
        thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d,
        pytest.raises(ShardNotFound, match=f"s3://{bucket}/nope.tar"),
    ):
        list(FastLoader(f"s3://{bucket}/nope.tar", batch_size=4, socket=d.socket))


def test_pinned_fallback_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    pinned_memory_available.cache_clear()
    with caplog.at_level(logging.INFO, logger="cached_client.buffers"):
        buffers = [host_buffer(1024, pinned=True) for _ in range(3)]
    assert all(b.numel() == 1024 and b.dtype == torch.uint8 for b in buffers)
    if torch.cuda.is_available():
        assert all(b.is_pinned() for b in buffers)
    else:
        assert not any(b.is_pinned() for b in buffers)
        assert sum("pinned memory unavailable" in r.message for r in caplog.records) == 1
    assert not host_buffer(1024).is_pinned()  # pinned only when asked


def test_device_loader_moves_nested_batches() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batches = [{"x": torch.arange(4) + i, "y": [torch.ones(2) * i]} for i in range(5)]
    out = list(DeviceLoader(batches, device, depth=2))
    assert len(out) == 5
    for i, b in enumerate(out):
        assert b["x"].device.type == device
        assert b["x"].tolist() == [i, i + 1, i + 2, i + 3]
        assert b["y"][0].tolist() == [float(i)] * 2


def test_stall_meter_measures_waiting() -> None:
    def slow() -> list[int]:
        out = []
        for i in range(3):
            time.sleep(0.05)
            out.append(i)
        return out

    def gen():  # type: ignore[no-untyped-def]
        for i in range(3):
            time.sleep(0.05)
            yield i

    meter = StallMeter()
    for _ in meter.wrap(gen()):
        time.sleep(0.05)
    assert meter.batches == 3
    assert 0.12 < meter.wait_s < 0.5
    assert 0.3 < meter.fraction < 0.7
    meter.reset()
    assert meter.fraction == 0.0 and slow() == [0, 1, 2]


# -- the defects, each provoked ----------------------------------------------------------

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
NEEDS_CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (make gpu-check runs these paths)"
)


def digests(batches: Iterator[Batch], ext: str) -> Counter[str]:
    """sha256 of every member ``ext`` of every batch, as a multiset."""
    seen: Counter[str] = Counter()
    for batch in batches:
        data, offs = batch.data[ext].numpy(), batch.offsets[ext]
        for i in range(len(batch)):
            seen[hashlib.sha256(data[offs[i] : offs[i + 1]]).hexdigest()] += 1
    return seen


def test_fast_loader_survives_a_daemon_restart_mid_epoch(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """kill -9 the daemon while the loader waits on a download; a new daemon comes up on
    the same socket: the epoch completes, every sample exactly once (content hashes)."""
    from tests.daemon import ProcessDaemon, dataset_shards, serve_config
    from tests.faultproxy import FaultProxy

    shards = dataset_shards(3, 20, payload=2000)
    for i, body in enumerate(shards):
        s3_server.put(bucket, f"shard-{i:04d}.tar", body)
    urls = [f"s3://{bucket}/shard-{i:04d}.tar" for i in range(3)]
    expected = Counter(
        hashlib.sha256(body).hexdigest()
        for shard in shards
        for key, body in tar_members(shard, "bin")
    )
    with FaultProxy.start(s3_server.endpoint_url) as proxy:
        config, socket = serve_config(tmp_path, proxy.endpoint_url)
        with config.open("a") as toml:  # demand only: shard 2 must still be missing
            toml.write("\n[prefetch]\nlookahead = 0\n")
        first = ProcessDaemon(config, socket).start()
        second = ProcessDaemon(config, socket)
        try:
            proxy.inject("delay", delay_s=3.0, path="shard-0002")  # its download hangs
            loader = FastLoader(urls, batch_size=8, exts=["bin"], socket=socket, inflight=2)
            it = iter(loader)

            def batches() -> Iterator[Batch]:
                for n, batch in enumerate(it):
                    if n == 4:  # into shard 1; the open of shard 2 is waiting: crash now
                        threading.Timer(0.5, lambda: first.stop(signal.SIGKILL)).start()
                        threading.Timer(1.5, second.start).start()
                    yield batch

            started = time.monotonic()
            got = digests(batches(), "bin")
            assert time.monotonic() - started < 12  # re-sent on the new instance's reply
            assert first.proc is not None and first.proc.poll() == -signal.SIGKILL
            # The new daemon served the rest, and was told the plan (this epoch and next).
            assert second.status()["counters"]["served_samples"] > 0
            assert [p["shards"] for p in second.status()["plans"]] == [6]
        finally:
            first.stop()
            if second.proc is not None:
                assert second.stop() == 0
    assert got == expected


def tar_members(shard: bytes, ext: str) -> Iterator[tuple[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(shard)) as tar:
        for member in tar:
            if member.name.endswith(f".{ext}"):
                fh = tar.extractfile(member)
                assert fh is not None
                yield member.name.split(".")[0], fh.read()


@NO_CUDA
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_no_cuda_is_refused_at_construction_before_connecting(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_connection(*args: object, **kwargs: object) -> None:
        raise AssertionError("a connection was made")

    monkeypatch.setattr("cached_client.transport.Connection.__init__", no_connection)
    for make in (
        lambda: FastLoader("s3://b/x.tar", batch_size=4, device=device),
        lambda: DeviceLoader([torch.ones(2)], device),
    ):
        with pytest.raises(DeviceUnavailable, match="CUDA is not available") as caught:
            make()
        assert isinstance(caught.value, CachedClientError)


def test_a_stale_host_batch_raises(s3_server: S3Server, bucket: str, tmp_path: Path) -> None:
    expected = arrays_dataset(s3_server, bucket, shards=1, per_shard=40)
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        loader = FastLoader(f"s3://{bucket}/arr-000.tar", batch_size=4, socket=d.socket, ring=2)
        assert not loader.pin_memory  # host mode pins nothing unless asked
        it = iter(loader)
        first, second = next(it), next(it)
        kept = first.to("cpu")  # same device: the same (aliasing) batch
        assert kept is first
        assert first.view("x.f32", torch.float32, (16,))[0, 0] == 0.0
        third = next(it)  # reuses the first batch's slot
        assert first.stale and not second.stale and not third.stale
        for use in (lambda: first.data, lambda: first.view("x.f32"), lambda: first.to("cpu")):
            with pytest.raises(StaleBatch, match="reused"):
                use()
        # The slot now holds the third batch, under its own keys.
        x = third.view("x.f32", torch.float32, (16,))
        for key, row in zip(third.keys, x, strict=True):
            np.testing.assert_array_equal(row.numpy(), expected[key])


def test_device_loader_over_fast_loader(s3_server: S3Server, bucket: str, tmp_path: Path) -> None:
    """DeviceLoader knows FastLoader's batches (it used to pass them through untouched);
    on the CPU it yields them in order, each intact when taken."""
    expected = arrays_dataset(s3_server, bucket, shards=2, per_shard=30)
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        urls = f"s3://{bucket}/arr-{{000..001}}.tar"
        fast = FastLoader(urls, batch_size=7, exts=["x.f32"], socket=d.socket, ring=2)
        seen = {}
        for batch in DeviceLoader(fast, "cpu", depth=3):
            assert isinstance(batch, Batch)
            for key, row in zip(batch.keys, batch.view("x.f32", torch.float32, (16,)), strict=True):
                seen[key] = row.numpy().copy()
    assert seen.keys() == expected.keys()
    for key, x in expected.items():
        np.testing.assert_array_equal(seen[key], x)


def test_ring_slots_wait_for_the_copies_out_of_them() -> None:
    """A slot is reused only after the events of the copies queued out of it: here events
    that record when they were waited for."""
    waited: list[int] = []

    class Copy:
        def __init__(self, n: int) -> None:
            self.n = n

        def synchronize(self) -> None:
            waited.append(self.n)

    ring = Ring(2, pinned=False)
    a = ring.claim()
    a.guard(Copy(1))
    a.guard(Copy(2))
    b = ring.claim()
    assert waited == [] and b is not a
    generation = a.generation
    assert ring.claim() is a and waited == [1, 2] and a.generation == generation + 1
    assert a.guards == []


def test_buffers_grow_in_powers_of_two_and_keep_their_contents() -> None:
    assert buffer_size(1) == 1 << 20  # at least 1 MiB
    assert [buffer_size(n) for n in ((1 << 20) + 1, 3 << 20, 4 << 20)] == [
        2 << 20,
        4 << 20,
        4 << 20,
    ]
    slot = Slot()
    head = slot.region("x", 0, 1000)
    head[:] = 7
    grown = slot.region("x", 1000, 3 << 20)  # past the first buffer: grows to 4 MiB
    assert slot.buffers["x"].numel() == 4 << 20 and grown.shape == (3 << 20,)
    assert (slot.views["x"][:1000] == 7).all()  # what was received stays


def test_to_device_handles_namedtuples_and_device_loader_len() -> None:
    pair = collections.namedtuple("pair", "x y")
    out = to_device(pair(torch.ones(2), [torch.zeros(1)]), torch.device("cpu"))
    assert type(out) is pair and out.x.tolist() == [1.0, 1.0] and out.y[0].tolist() == [0.0]
    assert len(DeviceLoader([1, 2, 3], "cpu")) == 3
    with pytest.raises(TypeError, match="no length: the generator it wraps has none"):
        len(DeviceLoader((i for i in range(3)), "cpu"))


def test_malloc_tuning_default_and_opt_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """``keep`` in the training process and its workers alike (D18); the variable opts
    out, and reaches DataLoader workers."""
    monkeypatch.delenv(memory.ENV, raising=False)
    assert memory.resolve_mode() == "keep"
    loader = torch.utils.data.DataLoader(_WorkerMode(), batch_size=None, num_workers=1)
    assert list(loader) == ["keep"]
    monkeypatch.setenv(memory.ENV, "off")
    assert memory.resolve_mode() == "off"
    assert list(loader) == ["off"]


class _WorkerMode(torch.utils.data.IterableDataset[str]):
    def __iter__(self) -> Iterator[str]:
        yield memory.resolve_mode()


@NEEDS_CUDA
def test_gpu_paths_byte_exact_under_a_slow_consumer() -> None:
    """The GPU half of the defects (streams of the right device, slot events, host-mode
    copies, pinned memory): bench/gpu_check.py's checks, run here when there is a GPU."""
    from bench import gpu_check

    assert gpu_check.main(["--require-cuda"]) == 0
