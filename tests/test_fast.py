"""The fast path (FastLoader) and the device helpers, against a real daemon."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from cached_client.device import DeviceLoader, StallMeter, host_buffer, pinned_memory_available
from cached_client.errors import ShardNotFound
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
    with caplog.at_level(logging.INFO, logger="cached_client.device"):
        buffers = [host_buffer(1024) for _ in range(3)]
    assert all(b.numel() == 1024 and b.dtype == torch.uint8 for b in buffers)
    if torch.cuda.is_available():
        assert all(b.is_pinned() for b in buffers)
    else:
        assert not any(b.is_pinned() for b in buffers)
        assert sum("pinned memory unavailable" in r.message for r in caplog.records) == 1


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
