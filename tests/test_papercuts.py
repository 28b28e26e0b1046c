"""Papercuts of a first use (issue 20, item 8), each provoked as a user meets it: a config
file, a brace pattern, `cached prefetch` with a missing object, a scalar view of a batch, a
job's first second in `cached status`, `cached demo --keep`."""

from __future__ import annotations

import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from cached_client import CachedDataset, FastLoader
from cached_client.errors import UsageError
from cached_client.transport import Connection
from cached_wire.urls import expand_all

from cached.config import load
from cached.errors import ConfigError
from tests.daemon import ProcessDaemon, daemon_config, make_tar, serve_config, thread_daemon
from tests.s3server import S3Server
from tests.test_cli import cached, one_line_failure

# -- [s3] endpoint_url without a scheme -------------------------------------------------------


def test_an_endpoint_url_without_a_scheme_is_refused_at_start(tmp_path: Path) -> None:
    """botocore would take it and fail at the first fetch, far from the line to fix."""
    config = tmp_path / "config.toml"
    config.write_text(
        f'[server]\nsocket = "ipc://{tmp_path}/cached.sock"\n'
        f'[cache]\ndir = "{tmp_path}/hot"\n[s3]\nendpoint_url = "127.0.0.1:9000"\n'
    )
    line = one_line_failure(cached("serve", "--config", str(config), timeout=30))
    assert f"{config}: bad value for [s3] endpoint_url" in line, line
    assert "has no scheme: write http://127.0.0.1:9000" in line, line
    assert not (tmp_path / "hot").exists()  # refused before anything started

    # The same from the environment, a flag, and the cold tier's endpoint.
    with pytest.raises(
        ConfigError, match=r"environment CACHED_S3_ENDPOINT_URL: .*write http://m:9"
    ):
        load(None, env={"CACHED_S3_ENDPOINT_URL": "m:9"})
    with pytest.raises(ConfigError, match=r"flag --endpoint_url: .*write http://m:9"):
        load(None, env={}, overrides={"s3.endpoint_url": "m:9"})
    config.write_text('[cold]\nendpoint_url = "ftp://a"\n')
    with pytest.raises(ConfigError, match=r"\[cold\] endpoint_url: 'ftp://a' is not an http"):
        load(config, env={})
    # What users write is still taken.
    for good in ("http://127.0.0.1:9000", "https://s3.example.com", "http://minio:9000/"):
        assert load(None, env={"CACHED_S3_ENDPOINT_URL": good}).s3.endpoint_url == good


# -- unbalanced braces ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "fault"),
    [
        ("s3://b/train-{000..009.tar", "a '{' is not closed"),
        ("s3://b/train-000..009}.tar", "a '}' without its '{'"),
        ("s3://b/train-{000..009}}.tar", "a '}' without its '{'"),
        ("s3://b/train-{x}.tar", "a {...} that is neither a range nor a list"),
    ],
)
def test_an_unbalanced_brace_is_a_syntax_error(tmp_path: Path, pattern: str, fault: str) -> None:
    """Not a URL sent to the daemon, which would answer "not found" for a key with a brace."""
    with pytest.raises(UsageError, match=re.escape(f"bad brace pattern {pattern!r}: {fault}")):
        expand_all(pattern)
    with pytest.raises(UsageError, match="bad brace pattern"):
        CachedDataset(pattern, socket=f"ipc://{tmp_path}/none.sock")
    # The CLI says so in one line, before it looks for a daemon.
    line = one_line_failure(cached("prefetch", "--socket", f"ipc://{tmp_path}/none.sock", pattern))
    assert f"bad brace pattern {pattern!r}: {fault}" in line
    assert "%7B" in line  # how to write a brace that belongs to the key


def test_balanced_braces_and_escaped_ones_still_expand() -> None:
    assert expand_all("s3://b/{0..1}-{x,y}.tar") == [
        "s3://b/0-x.tar",
        "s3://b/0-y.tar",
        "s3://b/1-x.tar",
        "s3://b/1-y.tar",
    ]
    assert expand_all("s3://b/odd%7Bname%7D.tar") == ["s3://b/odd%7Bname%7D.tar"]


# -- cached prefetch with a missing object ----------------------------------------------------


@pytest.fixture
def daemon(s3_server: S3Server, tmp_path: Path) -> Iterator[ProcessDaemon]:
    """``cached serve`` as a process, against the moto server."""
    proc = ProcessDaemon(*serve_config(tmp_path, s3_server.endpoint_url)).start()
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log_tail()


def test_prefetch_names_a_failed_url_once_and_its_bar_counts_failures_as_they_happen(
    s3_server: S3Server, bucket: str, daemon: ProcessDaemon
) -> None:
    for i in range(3):
        s3_server.put(bucket, f"p-{i}.tar", make_tar([(f"k{i}", {"bin": b"x" * 100})]))
    gone = f"s3://{bucket}/gone.tar"
    # The missing object first: the failure must show while the other three are to come.
    done = cached("prefetch", "--socket", daemon.socket, gone, f"s3://{bucket}/p-{{0..2}}.tar")
    assert done.returncode == 1, done.stderr
    lines = re.split(r"[\r\n]", done.stderr)
    (error,) = [line for line in lines if "gone.tar" in line]
    assert error.count(gone) == 1, error
    assert error.startswith(f"{gone}: not found at {s3_server.endpoint_url}"), error
    # The bar drawn at the failure counts it, with 3 shards still to come.
    assert any("1/4" in line and "1 failed" in line for line in lines), done.stderr
    assert "4/4" in done.stderr
    assert lines[-2] == "cached: 1 of 4 shards failed", done.stderr


# -- Batch.view(ext, dtype, ()) ---------------------------------------------------------------


def test_a_scalar_view_of_a_batch_is_one_value_per_sample(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    samples = [
        (f"s{i:03d}", {"y.f32": np.float32(i / 2).tobytes(), "x.u8": bytes([i] * 6)})
        for i in range(10)
    ]
    s3_server.put(bucket, "scalars.tar", make_tar(samples))
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        loader = FastLoader(f"s3://{bucket}/scalars.tar", batch_size=4, socket=d.socket)
        batch = next(iter(loader))
        y = batch.view("y.f32", torch.float32, ())
        assert y.shape == (4,)
        assert y.tolist() == [0.0, 0.5, 1.0, 1.5]
        # Without a shape: each member as a row of dtype, as before.
        assert batch.view("y.f32", torch.float32).shape == (4, 1)
        assert batch.view("x.u8").shape == (4, 6)
        assert batch.view("x.u8", torch.uint8, (2, 3)).shape == (4, 2, 3)
        # A shape that does not fit the members is the client's usage error, saying why.
        with pytest.raises(UsageError, match=r"'x.u8' \(6 bytes each\) as \[\] of torch.uint8"):
            batch.view("x.u8", torch.uint8, ())


# -- a job's first moments in cached status ---------------------------------------------------


@pytest.mark.parametrize(
    ("loop_s", "wait_s", "said"),
    [
        (0.3, 0.1854, "waiting 61.8% of 300 ms of loop"),
        (4.25, 1.0, "waiting 23.5% of 4.2 s of loop"),
        (100.0, 25.0, "waiting 25.0% of 100 s of loop"),
        (0.0004, 0.0002, "no loop time yet"),
    ],
)
def test_a_jobs_wait_over_little_loop_time_reads_sensibly(
    s3_server: S3Server, tmp_path: Path, loop_s: float, wait_s: float, said: str
) -> None:
    """A job's first report used to show "waiting 61.8% of 0 s of loop"."""
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        Connection(d.socket).request(
            {
                "op": "report",
                "job": "train",
                "reporter": "r1",
                "wait_s": wait_s,
                "loop_s": loop_s,
                "batches": 2,
                "ready": None,
            }
        )
        done = cached("status", "--socket", d.socket)
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if "job train:" in line]
    assert line == f"  job train: {said}, 2 batches, 1 processes, 0 plans", line


# -- cached demo --keep -----------------------------------------------------------------------


def lines_of(stream: Iterable[str]) -> queue.Queue[str]:
    """The stream's lines, read by a thread, to wait for with a timeout."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in stream:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    return lines


def test_demo_keep_leaves_the_stack_up_and_says_how_to_use_it(tmp_path: Path) -> None:
    demo = subprocess.Popen(
        [
            *(sys.executable, "-m", "cached", "demo", "--keep", "--epochs", "0"),
            *(
                "--shards",
                "2",
                "--samples-per-shard",
                "4",
                "--workers",
                "0",
                "--dir",
                str(tmp_path),
            ),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert demo.stdout is not None
    try:
        lines, said = lines_of(demo.stdout), list[str]()
        deadline = time.monotonic() + 90
        while not said or not said[-1].startswith("config "):
            said.append(lines.get(timeout=max(0.1, deadline - time.monotonic())))
        text = "".join(said)
        assert "until Ctrl-C" in text, text
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CACHED_"))}
        for line in said:
            if line.strip().startswith("export "):
                env.update(dict(w.split("=", 1) for w in shlex.split(line)[1:]))
        assert env["CACHED_SOCKET"] == f"ipc://{tmp_path}/cached.sock"
        assert env["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
        (urls,) = re.findall(r"^shards\s+(\S+)", text, re.M)
        assert urls == "s3://demo/train-{000000..000001}.tar"

        # Another shell, with only what was printed.
        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )

        fetched = run("-m", "cached", "prefetch", urls)
        assert fetched.returncode == 0 and "2/2" in fetched.stderr, fetched.stderr
        status = run("-m", "cached", "status")
        assert status.returncode == 0 and "2 misses" in status.stdout, status.stdout
        count = "import boto3; print(boto3.client('s3').list_objects_v2(Bucket='demo')['KeyCount'])"
        listed = run("-c", count)
        assert listed.stdout.strip() == "2", listed.stderr
        assert demo.poll() is None  # still up

        demo.send_signal(signal.SIGINT)  # Ctrl-C
        assert demo.wait(60) == 0
        assert run("-m", "cached", "status").returncode == 2  # the daemon is gone
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        demo.stdout.close()
