"""Bytes fetched per epoch by the real pipeline, against Belady's MIN over the same reads.

The question (issue 11): with the dataset twice the hot tier, does any epoch fetch more
than the dataset, and how close do warm epochs come to MIN "for the slots the pipeline
really has"? A reader holds (pins) the shard it reads while its next one arrives, so the
pipeline has one shard of room less per reader than the hot tier; MIN with that room is
the floor it can reach (``min_slots``); MIN with the whole tier is shown too (``min``).

What runs: a real daemon (``cached.daemon.Daemon``, in a thread of this process, so that
its hot tier can be watched), shards in moto's S3 server on loopback (its own process) or
as ``file://`` URLs, and ``CachedDataset`` in a DataLoader with worker processes, shuffled,
over several epochs. Per epoch it records:

- ``fetched``: the daemon's ``fetched_bytes`` counter over the epoch / the dataset;
- ``for_epoch``: the fetches whose next read falls in this epoch (a fetch serves the next
  read of its shard; the last shards of a cold epoch's window may serve the next epoch);
- ``twice``: fetches of a shard that was fetched again before anyone read it (a prefetch
  evicted before its read);
- ``min``, ``min_slots``: MIN over the reads the daemon saw (each shard's first pin per
  epoch, in order), with the hot tier's capacity, and with one shard less per reader.

Every configuration gets a fresh daemon and an empty hot tier; ``--repeats`` runs with
seeds ``--first-seed`` on. It prints figures and asserts nothing.

    python bench/volume.py                       # 32 shards, 2 workers, 3 epochs, 3 seeds
    python bench/volume.py --store file --repeats 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cached_client import CachedDataset
from torch.utils.data import DataLoader

from bench import common, shaping
from bench.cache_sim import min_misses
from cached.config import load
from cached.daemon import Daemon
from cached.local import daemon_in_thread

# (time, "fetch" | "read", url, bytes held): publications and pins, as the daemon did them.
Event = tuple[float, str, str, int]


def watch(daemon: Daemon) -> list[Event]:
    """Record every publication (the policy hears of it) and every pin (a reader's lease)."""
    events: list[Event] = []
    hot, policy = daemon.hot, daemon.hot.policy
    on_insert, pin = policy.on_insert, hot.pin

    def inserted(sid: str, url: str) -> None:
        events.append((time.monotonic(), "fetch", url, 0))
        on_insert(sid, url)

    def pinned(shard: Any) -> None:
        events.append((time.monotonic(), "read", shard.url, shard.reserved_bytes))
        pin(shard)

    policy.on_insert = inserted  # type: ignore[method-assign,assignment]
    hot.pin = pinned  # type: ignore[method-assign]
    return events


def fetched_bytes(daemon: Daemon) -> float:
    """The daemon's ``fetched_bytes`` counter, every tier."""
    return sum(
        s.value
        for metric in daemon.metrics.fetched_bytes.collect()
        for s in metric.samples
        if s.name.endswith("_total")
    )


def count(batch: list[Any]) -> int:
    """The collate function: a batch's number of samples (module level: picklable)."""
    return len(batch)


def attribute(
    events: Sequence[Event], windows: Sequence[tuple[float, float]]
) -> tuple[list[int], int]:
    """Per epoch, the fetches whose next read falls in it; and the fetches followed by
    another fetch of the same shard before any read."""
    served, twice = [0] * len(windows), 0
    for i, (_, kind, url, _) in enumerate(events):
        if kind != "fetch":
            continue
        following = next(((t, k) for t, k, u, _ in events[i + 1 :] if u == url), None)
        if following is not None and following[1] == "fetch":
            twice += 1
        elif following is not None:
            for epoch, (start, end) in enumerate(windows):
                if start <= following[0] <= end:
                    served[epoch] += 1
    return served, twice


def min_per_epoch(
    events: Sequence[Event], windows: Sequence[tuple[float, float]], capacity: int
) -> list[int]:
    """Bytes MIN fetches per epoch over the reads seen (first pin per shard and epoch)."""
    sequence: list[tuple[str, int]] = []
    epochs: list[int] = []
    for epoch, (start, end) in enumerate(windows):
        seen: set[str] = set()
        for t, kind, url, size in events:
            if kind == "read" and start <= t <= end and url not in seen:
                seen.add(url)
                sequence.append((url, size))
                epochs.append(epoch)
    out = [0] * len(windows)
    missed = min_misses(sequence, capacity)
    for (_, size), miss, epoch in zip(sequence, missed, epochs, strict=True):
        if miss:
            out[epoch] += size
    return out


def one_run(
    args: argparse.Namespace, urls: list[str], endpoint: str | None, seed: int
) -> dict[str, Any]:
    """A fresh daemon and hot tier; ``args.epochs`` shuffled epochs; the figures."""
    with tempfile.TemporaryDirectory(prefix="cached-volume-") as tmp:
        overrides: dict[str, Any] = {
            "server.socket": f"ipc://{tmp}/cached.sock",
            "server.http": "127.0.0.1:0",
            # file:// is not served by default; the benchmark's shards may be local files.
            "server.allow": ["s3://", "file:///"],
            "cache.dir": f"{tmp}/hot",
            "cache.capacity": str(args.capacity),
            "cache.min_free": "0",
        }
        if endpoint is not None:
            overrides["s3.endpoint_url"] = endpoint
        cfg = load(None, env={}, overrides=overrides)
        with daemon_in_thread(cfg, start_timeout_s=60) as (daemon, _loop):
            events = watch(daemon)
            ds = CachedDataset(urls, socket=daemon.server.bound_endpoint, shuffle=True, seed=seed)
            loader = DataLoader(
                ds,
                batch_size=32,
                num_workers=args.workers,
                persistent_workers=True,
                collate_fn=count,
            )
            windows, fetched = [], []
            for epoch in range(args.epochs):
                ds.set_epoch(epoch)
                before, start = fetched_bytes(daemon), time.monotonic()
                delivered = sum(loader)
                windows.append((start, time.monotonic()))
                fetched.append(fetched_bytes(daemon) - before)
                if delivered != args.samples:
                    raise RuntimeError(f"epoch {epoch} delivered {delivered} of {args.samples}")
            del loader
    shard = max(size for _, kind, _, size in events if kind == "read")
    served, twice = attribute(events, windows)
    return {
        "seed": seed,
        "fetched": fetched,
        "for_epoch": served,
        "twice": twice,
        "min": min_per_epoch(events, windows, args.capacity),
        "min_slots": min_per_epoch(events, windows, args.capacity - args.workers * shard),
        "shard_bytes": shard,
    }


def stage(args: argparse.Namespace, work: Path, stack: ExitStack) -> tuple[list[str], str | None]:
    """The shards: written to ``work`` and, for ``--store s3``, uploaded to moto (its own
    process, stopped with ``stack``)."""
    shards = common.write_shards(work / "shards", args.shards, args.samples, args.sample_size)
    args.dataset = shards.tar_bytes
    args.capacity = int(args.dataset * args.capacity_fraction)
    if args.store == "file":
        return shards.urls, None
    import boto3

    # moto takes any key; the daemon's S3 client reads them from the environment.
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    endpoint = stack.enter_context(shaping.moto_server(work / "moto.log"))
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket="volume")
    for path in shards.paths:
        s3.upload_file(str(path), "volume", path.name)
    return [f"s3://volume/{p.name}" for p in shards.paths], endpoint


def summary(runs: Sequence[dict[str, Any]], dataset: int) -> str:
    """Medians per epoch, as shares of the dataset, and each epoch against MIN's slots."""
    shard = statistics.median(r["shard_bytes"] for r in runs)
    lines = ["epoch  fetched  for epoch    min  min_slots  for epoch / min_slots"]
    for e in range(len(runs[0]["fetched"])):
        got = statistics.median(r["fetched"][e] for r in runs) / dataset
        own = statistics.median(r["for_epoch"][e] * shard for r in runs) / dataset
        low = statistics.median(r["min"][e] for r in runs) / dataset
        slots = statistics.median(r["min_slots"][e] for r in runs) / dataset
        lines.append(
            f"{e:>5}  {got:>6.3f}x  {own:>8.3f}x  {low:.3f}x  {slots:>8.3f}x  {own / slots:>10.3f}x"
        )
    lines.append(f"fetched twice before a read, per run: {[r['twice'] for r in runs]}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shards", type=int, default=32, help="tar shards (32)")
    p.add_argument("--samples", type=int, default=2144, help="samples in all (2144: 67 a shard)")
    p.add_argument("--sample-size", type=int, default=10_000, help="bytes per sample (10000)")
    p.add_argument("--capacity-fraction", type=float, default=0.5, help="hot tier / dataset (0.5)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (2)")
    p.add_argument("--epochs", type=int, default=3, help="epochs (3)")
    p.add_argument("--repeats", type=int, default=3, help="runs, one seed each (3)")
    p.add_argument("--first-seed", type=int, default=1, help="the first run's seed (1)")
    p.add_argument("--store", choices=("s3", "file"), default="s3", help="moto's S3 or file://")
    p.add_argument("--out", type=Path, default=common.OUT_DIR, help="where the JSON goes")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cached-volume-") as tmp, ExitStack() as stack:
        urls, endpoint = stage(args, Path(tmp), stack)
        started = common.loadavg()
        seeds = range(args.first_seed, args.first_seed + args.repeats)
        runs = [one_run(args, urls, endpoint, seed) for seed in seeds]
    ended = common.loadavg()
    print(summary(runs, args.dataset))
    print(f"load average {started} at the start, {ended} at the end")
    doc = {"args": {k: str(v) for k, v in vars(args).items()}, "load": [started, ended]}
    common.write_json("volume", {**doc, "runs": runs}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
