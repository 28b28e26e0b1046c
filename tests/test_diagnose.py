"""``cached diagnose``: is training input-bound on a dataset, and what should change.

Real parts only: moto S3 (behind a rate-shaping proxy for a slow store), real daemons
(``cached serve`` processes, and one in a thread), the command run as a user runs it, and
a real training run (a DataLoader with workers over ``CachedDataset``, measured with
``StallMeter``) to check the prediction against.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cached_client import CachedDataset
from cached_client.device import StallMeter
from cached_client.diagnose.measure import measure
from cached_client.diagnose.measurements import Measurements
from cached_client.diagnose.model import BOTTLENECKS, Inputs, epoch, predict
from cached_client.diagnose.report import render, report
from cached_client.diagnose.store import Open, classify
from cached_client.transport import Connection
from cached_wire.units import format_size
from torch.utils.data import DataLoader

from cached_demo import decode_sample, make_shard
from tests.daemon import ProcessDaemon, daemon_config, dataset_shards, serve_config, thread_daemon
from tests.faultproxy import FaultProxy
from tests.s3server import S3Server
from tests.test_daemon import upload
from tests.test_logs import SECRET, TOKEN

ROOT = Path(__file__).resolve().parent.parent


def diagnose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m cached diagnose ARGS`` as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "cached", "diagnose", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    """The error: one line on stderr, after progress lines if any."""
    lines = [
        line
        for line in done.stderr.splitlines()
        if line.strip() and not line.startswith("diagnose: ")
    ]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("cached: error: "), lines[0]
    assert "Traceback" not in done.stderr
    return lines[0]


# -- the acceptance cases ---------------------------------------------------------------------


def test_a_starved_setup_is_diagnosed_store_and_no_secret_shows(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """A slow store (2 MB/s), a cold cache and a short step: the store. Run where torch is
    not installed (as in the daemon's own environment): the loader is left out, said so.
    The daemon and the command hold a distinctive secret; it appears nowhere."""
    upload(s3_server, bucket, dataset_shards(12, 64, payload=4000))  # 3.2 MB
    no_torch = tmp_path / "no-torch"
    (no_torch / "torch").mkdir(parents=True)
    (no_torch / "torch" / "__init__.py").write_text("raise ImportError('no torch here')\n")
    secrets = {"AWS_SECRET_ACCESS_KEY": SECRET, "AWS_SESSION_TOKEN": TOKEN}
    with FaultProxy.start(s3_server.endpoint_url) as link:
        link.rate_bps = 2_000_000
        config, socket = serve_config(tmp_path, link.endpoint_url)
        with ProcessDaemon(config, socket, env=secrets):
            started = time.monotonic()
            done = diagnose(
                "--socket", socket, f"s3://{bucket}/shard-{{0000..0011}}.tar",
                "--workers", "2", "--batch-size", "64", "--step-ms", "5",
                "--budget", "10", "--json",
                env={**secrets, "PYTHONPATH": f"{no_torch}{os.pathsep}{ROOT}"},
            )  # fmt: skip
            took = time.monotonic() - started
            # A shard the store does not have: one line, exit 2.
            missing = diagnose("--socket", socket, f"s3://{bucket}/nope.tar", "--budget", "4")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)  # one JSON object, progress on stderr only
    assert out["bottleneck"] == "store", out["diagnosis"]
    assert out["predicted_wait_fraction"] > 0.5
    m = out["measurements"]
    assert m["store"]["bytes_per_s"] < 2_000_000 * 1.1  # at most the link's rate
    assert m["store"]["shards"] >= 1 and m["residency_from"] == "hot tier directory"
    assert m["loader"] is None and any("torch cannot be imported" in n for n in m["notes"])
    assert {"levers", "recommendations", "measurements"} <= out.keys()
    assert {lv["name"] for lv in out["levers"]} == {"workers", "lookahead", "hot_tier", "fast_path"}
    assert "diagnose: store" in done.stderr and took < 60
    for text in (done.stdout, done.stderr, missing.stdout, missing.stderr):
        for part in (SECRET, SECRET[:20], TOKEN[:20], TOKEN[-24:]):
            assert part not in text
    assert missing.returncode == 2
    assert "nope.tar" in one_line(missing)


def test_a_healthy_setup_is_diagnosed_none(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """A warm cache and a long step: nothing to change. Without a view of the hot tier's
    directory (a user who may not read it), residency comes from the open replies' ``hit``;
    the download slots from the daemon's status."""
    urls = upload(s3_server, bucket, dataset_shards(16, 100, payload=2000))
    cfg = daemon_config(tmp_path, s3_server.endpoint_url, **{"prefetch.concurrency": 6})
    with thread_daemon(cfg) as d:
        conn = Connection(d.socket)
        for url in urls:  # warm: every shard resident
            conn.request({"op": "open", "url": url, "stream": "warm", "pin": False})
        m = measure(d.socket, urls, workers=2, batch_size=16, budget_s=8, use_hot_dir=False)
    x = Inputs.of(m, batch_size=16, step_s=0.2, workers=2, decode=False)
    p = predict(x)
    assert p.bottleneck == "none", p.numbers
    assert p.predicted_wait_fraction < 0.05
    assert m.residency_from == "open replies" and m.resident_shards == 16
    assert m.concurrency == 6 and x.concurrency == 6
    assert not any("concurrency" in note for note in m.notes)
    assert m.store is None and m.disk_bytes_per_s is None  # nothing cold; no directory
    assert m.loader is not None and m.loader.hop_s > 0 and m.reads is not None
    text = render(m, p, x, decode_spec=None)
    for head in ("symptom ", "diagnosis ", "change ", "numbers ", "levers "):
        assert any(line.startswith(head) for line in text.splitlines()), text
    assert "not input-bound" in text and "store      not measured" in text
    out = report(m, p, x, decode_spec=None)
    assert json.loads(json.dumps(out))["bottleneck"] == "none"


def test_the_prediction_matches_a_real_training_run_on_the_demo_dataset(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """The demo's dataset (16 shards x 256 images, cached_demo.make_shard) behind a 3 MB/s store,
    a cold cache, 2 workers, the demo's decode, batch 64, a 20 ms step: diagnose, then
    train one epoch (a loop that sleeps the step per batch) and compare the wait."""
    for i in range(16):
        s3_server.put(bucket, f"train-{i:06d}.tar", make_shard(i, 256))
    urls = f"s3://{bucket}/train-{{000000..000015}}.tar"
    with FaultProxy.start(s3_server.endpoint_url) as link:
        link.rate_bps = 3_000_000
        config, socket = serve_config(tmp_path, link.endpoint_url)
        with ProcessDaemon(config, socket):
            done = diagnose(
                "--socket", socket, urls, "--workers", "2", "--batch-size", "64",
                "--step-ms", "20", "--decode", "cached_demo:decode_sample", "--budget", "15",
                "--json",
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            out = json.loads(done.stdout)
            # What diagnose fetched stays resident: the run starts from the same state.
            ds = CachedDataset(urls, socket=socket, shuffle=True, seed=0, decode=decode_sample)
            loader = DataLoader(ds, batch_size=64, num_workers=2)
            meter = StallMeter(report=False)
            batches = 0
            for _ in meter.wrap(loader):
                time.sleep(0.020)
                batches += 1
    predicted, measured = out["predicted_wait_fraction"], meter.fraction
    print(f"\npredicted {predicted:.3f}, measured {measured:.3f} over {batches} batches")
    assert batches == 64
    assert out["bottleneck"] == "store", out["diagnosis"]
    assert measured > 0.3  # clearly input-bound: the comparison means something
    assert abs(predicted - measured) <= 0.15, out["numbers"]


# -- the model, with hand numbers -------------------------------------------------------------


def inputs(**changes: Any) -> Inputs:
    """1000 shards of 100 samples of 10 kB, all resident in a hot tier that holds them,
    a fast store, 4 workers reading 100 us per sample; batch 100 every 100 ms (1000
    samples/s): healthy."""
    base: dict[str, Any] = {
        "batch_size": 100,
        "step_s": 0.1,
        "workers": 4,
        "cpus": 8,
        "epoch_samples": 100_000,
        "samples_per_shard": 100,
        "dataset_bytes": 1e9,
        "capacity_bytes": 2e9,
        "resident_share": 1.0,
        "tar_bytes_per_sample": 10_000,
        "payload_bytes_per_sample": 9_000,
        "lookahead_bytes": 32 << 30,
        "store_bytes_per_s": 500e6,
        "read_s_per_sample": 100e-6,
        "read_cpu_per_sample": 50e-6,
    }
    base.update(changes)
    return Inputs(**base)


def test_the_model_reaches_every_verdict() -> None:
    healthy = predict(inputs())
    assert healthy.bottleneck == "none" and healthy.predicted_wait_fraction == 0.0
    # A cold cache and a store of 5 MB/s (500 samples/s): half the loop time waits.
    store = predict(inputs(resident_share=0.0, store_bytes_per_s=5e6))
    assert store.bottleneck == "store"
    assert store.predicted_wait_fraction == pytest.approx(0.5, abs=0.01)
    # A disk of 5 MB/s under the daemon: the hot tier.
    disk = predict(inputs(disk_bytes_per_s=4.5e6))
    assert disk.bottleneck == "hot_tier"
    # 10 ms per sample of decoding in each of 4 workers: 400 samples/s.
    decode = predict(inputs(decode_s_per_sample=0.01, decode_given=True))
    assert decode.bottleneck == "decode"
    assert decode.predicted_wait_fraction == pytest.approx(0.6, abs=0.01)
    # Reads of 10 ms per sample through the daemon: the transport.
    slow = predict(inputs(read_s_per_sample=0.01))
    assert slow.bottleneck == "transport"
    # A 50 ms hop to take each batch from the workers, beside a 100 ms step: a third.
    hop = predict(inputs(hop_s=0.05, loader_samples_per_s=10_000))
    assert hop.bottleneck == "transport" and "taking each batch" in hop.diagnosis
    assert hop.predicted_wait_fraction == pytest.approx(1 / 3, abs=0.01)
    assert {p.bottleneck for p in (healthy, store, disk, decode, slow)} == set(BOTTLENECKS)


def test_the_levers() -> None:
    def lever(p: Any, name: str) -> float:
        return float(next(lv for lv in p.levers if lv.name == name).predicted_wait_fraction)

    # Decode-bound: twice the workers halve the per-sample time; the store does not matter.
    decode = predict(inputs(decode_s_per_sample=0.01, decode_given=True))
    assert lever(decode, "workers") == pytest.approx(0.2, abs=0.01)
    assert lever(decode, "lookahead") == decode.predicted_wait_fraction
    assert lever(decode, "fast_path") == 0.0  # raw bytes: the decode moves to the GPU
    assert "workers" in decode.change
    # Without a lookahead the workers wait for each download: prefetch overlaps them.
    serial = inputs(
        resident_share=0.0, store_bytes_per_s=10e6, lookahead_bytes=0, read_s_per_sample=0.004
    )
    p = predict(serial)
    assert p.bottleneck == "store"
    assert lever(p, "lookahead") < p.predicted_wait_fraction
    assert epoch(serial).seconds == pytest.approx(
        epoch(serial, overlap=True).workers_s + 100_000 * 10_000 / 10e6
    )
    # A dataset twice the hot tier: half of every epoch from the store, even when warm.
    big = inputs(dataset_bytes=4e9, resident_share=0.5, store_bytes_per_s=2e6)
    p = predict(big)
    assert p.bottleneck == "store" and p.steady_wait_fraction > 0.3
    assert lever(p, "hot_tier") == 0.0 and "capacity" in p.change
    # The epoch's start alone names no bottleneck.
    started = predict(inputs(start_s=3.0, epoch_samples=10_000))
    assert started.bottleneck == "none" and started.predicted_wait_fraction > 0.2
    # A store that was not measured never limits.
    assert predict(inputs(resident_share=0.0, store_bytes_per_s=None)).bottleneck == "none"
    # Every number in the report is finite JSON.
    m = Measurements(
        shards=1000, shards_opened=8, shard_bytes=1e6, samples_per_shard=100,
        tar_bytes_per_sample=1e4, payload_bytes_per_sample=9e3, dataset_bytes=1e9,
        epoch_samples=1e5, resident_shards=0, residency_from="open times",
        capacity_bytes=2 * 10**9, used_bytes=0, lookahead_bytes=0, cpus=2,
    )  # fmt: skip
    x = inputs(resident_share=0.0, store_bytes_per_s=None, lookahead_bytes=0)
    text = json.dumps(report(m, predict(x), x, decode_spec=None), allow_nan=False)
    assert not math.isnan(json.loads(text)["predicted_wait_fraction"])


def test_the_download_slots_set_the_last_downloads_and_the_lookahead() -> None:
    """The daemon's ``[prefetch] concurrency`` (4 where its status does not say): how many
    downloads land together at an epoch's end, and the lookahead the lever asks for."""
    cold = inputs(resident_share=0.0, store_bytes_per_s=10e6)
    wide = inputs(resident_share=0.0, store_bytes_per_s=10e6, concurrency=8)
    assert cold.concurrency == 4
    # 4 more shards of 100 samples at the 1,000 samples/s the loop takes them.
    assert epoch(wide).store_s - epoch(cold).store_s == pytest.approx(0.4)
    serial = predict(inputs(resident_share=0.0, lookahead_bytes=0, concurrency=8))
    lookahead = next(lv for lv in serial.levers if lv.name == "lookahead")
    assert f"at least {format_size(8 * 100 * 10_000)}" in lookahead.change


def test_residency_from_the_open_replies_else_the_counters() -> None:
    """Which opens fetched their shard (without a view of the hot tier's directory): the
    replies' ``hit``; from a daemon older than that field, its hit and miss counters (exact
    when nobody else opened anything meanwhile), else the open times."""

    def opens(hits: list[bool | None]) -> list[Open]:
        return [
            Open(
                f"s3://b/{i}.tar",
                0.0,
                done=s,
                header={"size": 1} | ({} if h is None else {"hit": h}),
            )
            for i, (h, s) in enumerate(zip(hits, [2.0, 0.01, 0.01], strict=True))
        ]

    # The replies say it, whatever the times and the counters; no answer: cold.
    new = [*opens([True, False, True]), Open("s3://b/late.tar", 0.0)]
    assert classify(new, {"hits": 0, "misses": 0}, {"hits": 9, "misses": 9}) == "open replies"
    assert [o.cold for o in new] == [False, True, False, True]
    # An older daemon: one miss in its counters, the slowest open ...
    old = opens([None, None, None])
    assert classify(old, {"hits": 5, "misses": 1}, {"hits": 7, "misses": 2}) == "daemon counters"
    assert [o.cold for o in old] == [True, False, False]
    # ... or, with others' opens counted too, the opens far slower than the quickest.
    old = opens([None, None, None])
    assert classify(old, {"hits": 0, "misses": 0}, {"hits": 9, "misses": 9}) == "open times"
    assert [o.cold for o in old] == [True, False, False]


# -- bad input -----------------------------------------------------------------------------------


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    socket = f"ipc://{tmp_path}/nobody.sock"
    bad_url = diagnose("--socket", socket, "http://example.com/a.tar")
    assert bad_url.returncode == 2 and "bad shard URL" in one_line(bad_url)
    for spec, says in (
        ("nomodule_here:decode", "cannot import nomodule_here"),
        ("cached_demo:no_such_function", "has no no_such_function"),
        ("cached_demo", "expected MODULE:FUNC"),
    ):
        bad_decode = diagnose("--socket", socket, "s3://b/a.tar", "--decode", spec)
        assert bad_decode.returncode == 2 and says in one_line(bad_decode)
    nobody = diagnose("--socket", socket, "s3://b/a.tar")
    assert nobody.returncode == 2
    assert "cannot reach the cached daemon" in one_line(nobody)
    step = diagnose("--socket", socket, "s3://b/a.tar", "--step-ms", "0")
    assert step.returncode == 2 and "--step-ms must be positive" in one_line(step)


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_the_readers_read_as_the_loaders_would(
    s3_server: S3Server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """diagnose's readers choose local reads or the socket as the loaders do: from the
    shard files where they can open them, through the socket with
    ``CACHED_LOCAL_READS=off`` (its reader processes inherit the setting)."""
    monkeypatch.setenv("CACHED_LOCAL_READS", mode)
    urls = upload(s3_server, bucket, dataset_shards(4, 50, payload=2000))
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        conn = Connection(d.socket)
        for url in urls:  # warm: every shard resident
            conn.request({"op": "open", "url": url, "stream": "warm", "pin": False})
        m = measure(d.socket, urls, workers=1, batch_size=16, budget_s=4, use_hot_dir=False)
        served, local = d.served()
    assert m.reads is not None and served > 0
    if mode == "off":
        assert local == 0
    else:
        assert local > 0.5 * served
