"""The measurements, in order and within a time budget: the daemon's status, the store and
the residency, the transport and the disk, decoding, the loader, the fast path."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from cached_wire.protocol import Op
from cached_wire.units import format_size
from cached_wire.urls import expand_all

from ..errors import DaemonTimeout, UsageError
from ..local import choose
from ..transport import Connection
from .measurements import DEFAULT_CONCURRENCY, Measurements
from .rates import Decode, decode_rate, disk_rate, fast_rate, loader_rate, read_samples, run_readers
from .store import STORE_MAX_COLD, classify, probe, resident_files, store_rate

# Resident shards opened for the shards' sizes beside the cold ones the store measurement
# fetches.
SIZE_SAMPLE = 8
# Without a view of the hot tier's directory, a random sample of this many shards is
# opened to learn which share is resident.
PROBE_MAX = 32
# Resident shards read by the transport, loader and fast-path measurements.
READ_SAMPLE = 16
# Samples read in this process for the decode measurement.
DECODE_SAMPLES = 256
# Shares of the time budget per phase (the rest: starting processes, handshakes).
SHARE_STORE = 0.35
# ... and up to this share when no shard answered by then (nothing to size them by).
SHARE_STORE_MAX = 0.8
SHARE_READ = 0.06
SHARE_DISK = 0.02
SHARE_DECODE = 0.05
SHARE_LOADER = 0.12
SHARE_LOADER_2X = 0.08
SHARE_FAST = 0.04

Progress = Callable[[str], None]


def measure(
    socket: str,
    patterns: Sequence[str],
    *,
    workers: int,
    batch_size: int = 64,
    decode: Decode | None = None,
    budget_s: float = 40.0,
    progress: Progress | None = None,
    use_hot_dir: bool = True,
    seed: int = 0,
) -> Measurements:
    """Measure the store, the hot tier, the transport, decoding, the loader and the fast
    path for the shards ``patterns`` name, through the daemon at ``socket``, in about
    ``budget_s`` seconds.

    ``use_hot_dir=False`` ignores the hot tier's directory even where it is readable (what
    a user who may not read it gets). Raises :class:`UsageError` for bad URLs and a failing
    decode function, and the client's errors for an unreachable daemon or a shard the
    store does not have.
    """
    began = time.monotonic()
    urls = expand_all(list(patterns))
    if workers < 1:
        raise UsageError(f"--workers must be at least 1, not {workers}")
    # Local reads or the socket as the loaders would choose ($CACHED_LOCAL_READS).
    conn = Connection(socket, connect_timeout_s=3.0, local_reads=choose(None))
    try:
        m = _measure(
            conn,
            socket,
            urls,
            workers=workers,
            batch_size=batch_size,
            decode=decode,
            budget_s=budget_s,
            say=progress or (lambda _line: None),
            use_hot_dir=use_hot_dir,
            rng=random.Random(seed),
        )
    finally:
        conn.close()
    m.seconds = time.monotonic() - began
    return m


def _status(conn: Connection) -> dict[str, Any]:
    header, _ = conn.request({"op": Op.STATUS})
    status: dict[str, Any] = header["status"]
    return status


def _measure(
    conn: Connection,
    socket: str,
    urls: list[str],
    *,
    workers: int,
    batch_size: int,
    decode: Decode | None,
    budget_s: float,
    say: Progress,
    use_hot_dir: bool,
    rng: random.Random,
) -> Measurements:
    status = _status(conn)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    notes: list[str] = []
    hot_dir = str(status["hot"]["dir"])
    # The downloads the daemon runs at once; prefetches, which the store measurement's
    # opens are, get all but one of them (the last is kept for readers' demand misses).
    concurrency = int(status["prefetch"].get("concurrency") or 0)
    if concurrency < 1:
        concurrency = DEFAULT_CONCURRENCY
        notes.append(
            f"the daemon's status does not say its [prefetch] concurrency: {concurrency} "
            "(the default) assumed"
        )
    slots = max(1, concurrency - 1)
    before = resident_files(hot_dir, urls) if use_hot_dir else None
    if before is None:
        notes.append(
            (
                f"the hot tier's directory {hot_dir} is not readable here"
                if use_hot_dir
                else "the hot tier's directory was not looked at"
            )
            + f": residency estimated from {min(PROBE_MAX, len(urls))} shards, "
            "disk not measured"
        )

    # 1. The store: cold shards through the daemon (sizes from a few resident ones).
    store_budget = SHARE_STORE * budget_s
    if before is not None:
        resident = [u for u in urls if u in before]
        cold = [u for u in urls if u not in before]
        queue = [(u, False) for u in rng.sample(resident, min(SIZE_SAMPLE, len(resident)))]
        queue += [(u, True) for u in rng.sample(cold, min(STORE_MAX_COLD, len(cold)))]
        say(
            f"store: {len(resident)} of {len(urls)} shards resident; fetching "
            f"{min(STORE_MAX_COLD, len(cold))} cold ones (about {store_budget:.0f} s)"
        )
    else:
        queue = [(u, False) for u in rng.sample(urls, min(PROBE_MAX, len(urls)))]
        say(f"store: opening {len(queue)} shards (about {store_budget:.0f} s)")
    counters = _status(conn)["counters"]
    began = time.monotonic()
    probed = probe(
        socket,
        queue,
        store_budget,
        slots=slots,
        hard_s=SHARE_STORE_MAX * budget_s,
        bound_cold=before is None,
    )
    opens = probed.opens
    status = _status(conn)
    how = "hot tier directory"
    if before is None:
        how = classify(opens, counters, status["counters"])
    store = store_rate(probed)
    answered = [o.header for o in opens if o.header is not None]
    if not answered:
        waited = probed.ended - began
        raise DaemonTimeout(
            f"no shard of the dataset arrived within {waited:.0f} s ({slots} "
            "downloads at once), so there is nothing to size the shards by: the store is "
            "that slow for these shards; warm a few first (cached prefetch) or raise --budget"
        )
    sizes = [int(h["size"]) for h in answered]
    counts = [int(h["samples"]) for h in answered]
    n_samples = max(1, sum(counts))
    after = resident_files(hot_dir, urls) if before is not None else None
    if after is not None:
        resident_urls = [u for u in urls if u in after]
        resident_now = float(len(resident_urls))
    else:
        resident_urls = [o.url for o in opens if o.header is not None]
        hit_share = sum(1 for o in opens if not o.cold) / len(opens)
        resident_now = len(resident_urls) + (len(urls) - len(opens)) * hit_share
    hot = status["hot"]
    m = Measurements(
        shards=len(urls),
        shards_opened=len(answered),
        shard_bytes=sum(sizes) / len(sizes),
        samples_per_shard=sum(counts) / len(counts),
        tar_bytes_per_sample=sum(sizes) / n_samples,
        payload_bytes_per_sample=sum(int(h["payload"]) for h in answered) / n_samples,
        dataset_bytes=sum(sizes) / len(sizes) * len(urls),
        epoch_samples=sum(counts) / len(counts) * len(urls),
        resident_shards=resident_now,
        residency_from=how,
        capacity_bytes=int(hot["capacity_bytes"]),
        used_bytes=int(hot["used_bytes"]),
        lookahead_bytes=int(status["prefetch"]["lookahead_bytes"]),
        cpus=cpus or 1,
        concurrency=concurrency,
        store=store,
        notes=notes,
    )
    if store is None:
        say("store: every shard opened was resident (store not measured)")
    elif store.bytes_per_s is not None:
        say(f"store: {format_size(store.bytes_per_s)}/s")

    sample_urls = rng.sample(resident_urls, min(READ_SAMPLE, len(resident_urls)))
    if not sample_urls:
        notes.append("no resident shard to read: hot tier and transport not measured")
        return m

    # 2. The transport: resident shards through the daemon; the disk under it, raw.
    # The phases after the store's share its time; less when the store took longer.
    rest = SHARE_READ + SHARE_DISK + SHARE_DECODE + SHARE_LOADER + SHARE_LOADER_2X + SHARE_FAST
    left = (1.0 - SHARE_STORE) * budget_s - (time.monotonic() - began - store_budget)
    scale = min(1.0, max(0.3, left / budget_s / (rest + 0.15)))

    def phase(share: float) -> float:
        return share * budget_s * scale

    say(f"transport: {workers} readers for {phase(SHARE_READ):.1f} s")
    m.reads, why = run_readers(socket, sample_urls, workers, phase(SHARE_READ))
    if m.reads is None:
        notes.append(f"reads through the daemon not measured: {why}")
    if after is not None:
        say("hot tier: reading the shard files raw")
        paths = [after[u] for u in sample_urls if u in after]
        m.disk_bytes_per_s = disk_rate(paths, workers, phase(SHARE_DISK))
        notes.append("the raw disk read includes the page cache, as the daemon's reads do")

    # 3. Decoding, on real samples, in this process.
    if decode is not None:
        samples = read_samples(conn, sample_urls, DECODE_SAMPLES)
        say(f"decode: {len(samples)} samples for {phase(SHARE_DECODE):.1f} s")
        m.decode_s_per_sample, m.decode_cpu_per_sample = decode_rate(
            decode, samples, phase(SHARE_DECODE)
        )

    # 4. The loader, as training runs it: W workers, then 2W.
    loaders = ((workers, SHARE_LOADER, "loader"), (2 * workers, SHARE_LOADER_2X, "loader_2x"))
    for n, share, attr in loaders:
        say(f"loader: a DataLoader with {n} workers for {phase(share):.1f} s")
        rate, why = loader_rate(
            socket,
            sample_urls,
            workers=n,
            batch_size=batch_size,
            decode=decode,
            seconds=phase(share),
            per_pass=m.samples_per_shard * len(sample_urls),
            expect=m.reads.samples_per_s if m.reads else 50_000.0,
        )
        setattr(m, attr, rate)
        if rate is None:
            notes.append(
                f"the DataLoader was not measured ({why}): the prediction leaves out "
                "collation and the hop from the workers to the training process"
            )
            break

    # 5. The fast path: one process, frames received in place.
    say(f"fast path: one reader for {phase(SHARE_FAST):.1f} s")
    m.fast_samples_per_s = fast_rate(conn, sample_urls, phase(SHARE_FAST))
    return m
