"""Rates over resident shards: reads through the daemon by reader processes at once (and
the ``--worker`` entry of each), the hot tier's files read raw, decoding, a real
DataLoader, and the fast path."""

from __future__ import annotations

import contextlib
import json
import math
import select
import statistics
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

from ..errors import UsageError, check_reply
from ..local import choose
from ..reader import Span, pipelined_reads, raw_samples
from ..transport import Connection
from .measurements import LoaderRate, ReadRate

# CachedDataset's and FastLoader's read requests in flight per reader.
READER_INFLIGHT = 4
FAST_INFLIGHT = 8

Decode = Callable[[dict[str, Any]], Any]
T = TypeVar("T")


def _until(deadline: float, passes: Callable[[], Iterator[T]]) -> Generator[T, None, None]:
    """The items of ``passes()``, pass after pass, until ``deadline`` (looked at after each
    item); a pass left early, at the deadline or when this is closed, is closed (a read's,
    releasing its pins)."""
    while time.monotonic() < deadline:
        items = passes()
        try:
            for item in items:
                yield item
                if time.monotonic() >= deadline:
                    return
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()


def _sample(url: str, key: str, members: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """The dict ``CachedDataset`` yields (bytes copied out of the frames, as it does)."""
    sample: dict[str, Any] = {"__key__": key, "__url__": url}
    for ext, frame in members:
        sample[ext] = frame.bytes
    return sample


def _reads(conn: Connection, spans: list[Span], stream: str) -> Iterator[list[dict[str, Any]]]:
    """The samples of each read of ``spans``, as ``CachedDataset`` yields them, its reads
    in flight; closing it early releases the pins."""
    reads = pipelined_reads(conn, spans, stream, inflight=READER_INFLIGHT)
    with contextlib.closing(reads):
        for read, rid in reads:
            reply, frames = conn.wait(rid)
            yield [_sample(read.url, k, ms) for k, ms in raw_samples(reply, frames)]


def read_for(conn: Connection, urls: Sequence[str], stream: str, seconds: float) -> dict[str, Any]:
    """Read ``urls`` (from the first again when done) as a ``CachedDataset`` worker does,
    for ``seconds``; returns samples, payload bytes, wall and CPU seconds."""
    spans = [Span(u) for u in urls]
    samples = nbytes = 0
    start, cpu0 = time.monotonic(), time.process_time()
    with contextlib.closing(_until(start + seconds, lambda: _reads(conn, spans, stream))) as reads:
        for read in reads:
            for sample in read:
                nbytes += sum(len(v) for k, v in sample.items() if not k.startswith("__"))
                samples += 1
    return {
        "samples": samples,
        "bytes": nbytes,
        "wall_s": time.monotonic() - start,
        "cpu_s": time.process_time() - cpu0,
    }


def worker_main() -> int:
    """A reader process of the transport measurement (``python -m cached_client.diagnose
    --worker``): a job line in, ``ready``, wait for ``go``, read for the job's seconds, a
    result line out."""
    job = json.loads(sys.stdin.readline())
    conn = Connection(job["socket"], connect_timeout_s=5.0, local_reads=choose(None))
    conn.open()
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    result = read_for(conn, job["urls"], job["stream"], float(job["seconds"]))
    print(json.dumps(result), flush=True)
    conn.close()
    return 0


def _readline(stream: IO[str], timeout_s: float) -> str:
    """One line from a child's stdout, or "" after ``timeout_s``."""
    # poll, not select: select refuses a descriptor numbered 1024 or more, and a process
    # that embeds the client may hold that many.
    poller = select.poll()
    poller.register(stream, select.POLLIN)
    ready = poller.poll(max(0.0, timeout_s) * 1000)
    return stream.readline() if ready else ""


def run_readers(
    socket: str, urls: Sequence[str], readers: int, seconds: float
) -> tuple[ReadRate | None, str]:
    """``readers`` reader processes (``python -m cached_client.diagnose --worker``) read
    ``urls`` through the daemon at once for ``seconds``, each its own shards; returns the
    rates, or None and why."""
    procs: list[subprocess.Popen[str]] = []
    results: list[dict[str, Any]] = []
    try:
        for i in range(readers):
            mine = list(urls[i::readers]) or [urls[i % len(urls)]]
            job = {
                "socket": socket,
                "urls": mine,
                "seconds": seconds,
                "stream": f"diagnose-{uuid.uuid4().hex[:8]}/w{i}",
            }
            proc = subprocess.Popen(
                [sys.executable, "-m", "cached_client.diagnose", "--worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            procs.append(proc)
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(job) + "\n")
            proc.stdin.flush()
        # All connected before any starts: the rates are of readers running together.
        for proc in procs:
            assert proc.stdout is not None
            if _readline(proc.stdout, 30.0).strip() != "ready":
                return None, _failure(proc)
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        for proc in procs:
            assert proc.stdout is not None
            line = _readline(proc.stdout, seconds + 30.0)
            if not line:
                return None, _failure(proc)
            results.append(json.loads(line))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
    per = [r for r in results if r["samples"]]
    if not per:
        return None, "the readers read no sample"
    wall = sum(float(r["wall_s"]) for r in results) / len(results)
    return (
        ReadRate(
            readers=readers,
            samples_per_s=sum(int(r["samples"]) for r in results) / wall,
            bytes_per_s=sum(int(r["bytes"]) for r in results) / wall,
            s_per_sample=sum(r["wall_s"] / r["samples"] for r in per) / len(per),
            cpu_per_sample=sum(r["cpu_s"] / r["samples"] for r in per) / len(per),
        ),
        "",
    )


def _failure(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    err = proc.stderr.read() if proc.stderr is not None else ""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"a reader exited {proc.returncode}"


def disk_rate(paths: Sequence[Path], threads: int, seconds: float) -> float | None:
    """Bytes per second reading the hot tier's files raw, ``threads`` at once."""
    lock = threading.Lock()
    todo = list(paths)
    total = [0]
    deadline = time.monotonic() + seconds

    def run() -> None:
        buf = bytearray(4 << 20)
        while time.monotonic() < deadline:
            with lock:
                if not todo:
                    return
                path = todo.pop(0)
            try:
                with open(path, "rb", buffering=0) as f:
                    while (n := f.readinto(buf)) and time.monotonic() < deadline:
                        with lock:
                            total[0] += n
            except OSError:
                continue  # evicted meanwhile

    start = time.monotonic()
    pool = [threading.Thread(target=run) for _ in range(max(1, threads))]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.monotonic() - start
    return total[0] / elapsed if total[0] and elapsed > 0 else None


def read_samples(conn: Connection, urls: Sequence[str], limit: int) -> list[dict[str, Any]]:
    """Up to ``limit`` samples of ``urls``, as ``CachedDataset`` yields them."""
    samples: list[dict[str, Any]] = []
    stream = f"diagnose-{uuid.uuid4().hex[:8]}/decode"
    for url in urls:
        for read in _reads(conn, [Span(url, 0, limit - len(samples))], stream):
            samples += read
        if len(samples) >= limit:
            break
    return samples


def _decode(decode: Decode, sample: dict[str, Any]) -> None:
    """``decode`` on a copy of ``sample`` (a decode function may take members out); its
    failure as one line."""
    try:
        decode(dict(sample))
    except Exception as exc:
        raise UsageError(
            f"--decode failed on sample {sample['__key__']!r}: {type(exc).__name__}: {exc}"
        ) from None


def decode_rate(
    decode: Decode, samples: Sequence[dict[str, Any]], seconds: float
) -> tuple[float, float]:
    """Wall and CPU seconds per sample of ``decode`` in this process (the first call,
    which may import things, is not timed)."""
    _decode(decode, samples[0])
    n = 0
    start, cpu0 = time.monotonic(), time.process_time()
    for sample in _until(start + seconds, lambda: iter(samples)):
        _decode(decode, sample)
        n += 1
    n = max(n, 1)
    return (time.monotonic() - start) / n, (time.process_time() - cpu0) / n


def loader_rate(
    socket: str,
    urls: Sequence[str],
    *,
    workers: int,
    batch_size: int,
    decode: Decode | None,
    seconds: float,
    per_pass: float,
    expect: float,
) -> tuple[LoaderRate | None, str]:
    """A real DataLoader (``workers`` workers, default collation) over ``CachedDataset``
    of ``urls``, shuffled as training reads: the time to its first batch, the rate its
    workers deliver when the loop takes batches as fast as they come, and the loop's own
    time to take a batch that is ready (the hop from the workers). None and why when torch
    is not installed here. ``per_pass``: the samples of ``urls``."""
    try:
        from torch.utils.data import DataLoader

        from .. import CachedDataset
    except ImportError as exc:
        return None, f"torch cannot be imported here: {exc}"
    # The same shards again, so that an epoch outlasts the measurement at ``expect``
    # samples per second (the reads' rate: a loader is not faster).
    repeat = max(1, min(256, math.ceil(2 * seconds * expect / max(1.0, per_pass))))
    ds = CachedDataset(
        list(urls) * repeat, socket=socket, shuffle=True, seed=0, decode=decode, job="diagnose"
    )
    start = time.monotonic()
    with warnings.catch_warnings():
        # More workers than CPUs is what the measurement of twice the workers asks for.
        warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
        loader = DataLoader(ds, batch_size=batch_size, num_workers=workers)
        it = iter(loader)
    try:
        next(it)
        first = time.monotonic() - start
        # As fast as the workers deliver (and the loop can take them).
        t0 = time.monotonic()
        taken = 0
        while time.monotonic() - t0 < 0.7 * seconds:
            next(it)
            taken += 1
        elapsed = time.monotonic() - t0
        rate = taken * batch_size / elapsed if taken else batch_size / first
        # A loop slower than the workers: every batch is ready when asked for, and taking
        # it costs the hop alone.
        pause = min(0.2, 2 * batch_size / rate)
        hops: list[float] = []
        t1 = time.monotonic()
        while len(hops) < 5 or (time.monotonic() - t1 < 0.3 * seconds and len(hops) < 50):
            time.sleep(pause)
            a = time.monotonic()
            next(it)
            hops.append(time.monotonic() - a)
    except StopIteration:
        return None, "the loader ran out of samples"
    finally:
        del it  # shuts the workers down
    batches = 1 + taken + len(hops)
    return LoaderRate(workers, rate, first, statistics.median(hops), batches), ""


def fast_rate(conn: Connection, urls: Sequence[str], seconds: float) -> float | None:
    """Samples per second of one process receiving every member in place into a reusable
    buffer, ``FAST_INFLIGHT`` reads in flight: what ``FastLoader`` does, without torch."""
    spans = [Span(u) for u in urls]
    stream = f"diagnose-{uuid.uuid4().hex[:8]}/fast"
    buf = bytearray(1 << 20)
    samples = 0
    start = time.monotonic()

    def passes() -> Iterator[tuple[Any, int]]:
        return pipelined_reads(conn, spans, stream, inflight=FAST_INFLIGHT)

    with contextlib.closing(_until(start + seconds, passes)) as reads:
        for _, rid in reads:
            reply = conn.receive(rid, in_place=True)
            check_reply(reply.header)
            for _key, members in reply.samples():
                for _ext, size, *_ in members:
                    if size > len(buf):
                        buf = bytearray(size)
                    reply.read_into(buf)
                samples += 1
    elapsed = time.monotonic() - start
    return samples / elapsed if samples else None
