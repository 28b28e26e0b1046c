"""Bytes fetched per epoch by the real pipeline, against Belady's MIN over the same reads.

The question (issue 11): with the dataset twice the hot tier, does any epoch fetch more
than the dataset, and how close do warm epochs come to MIN "for the slots the pipeline
really has"? A reader holds (pins) the shard it reads while its next one arrives, so the
pipeline has one shard of room less per reader than the hot tier; MIN with that room is
the floor it can reach (``min_slots``); MIN with the whole tier is shown too (``min``).

What runs: a real daemon (``cached.daemon.Daemon``, in a thread of this process, so that
its hot tier can be watched), shards in an S3 store on loopback (``--store``: RGW or moto,
bench/stores.py, in their own processes) or as ``file://`` URLs, and ``CachedDataset`` in
a DataLoader with worker processes, shuffled, over several epochs. Per epoch it records:

- ``fetched``: the daemon's ``fetched_bytes`` counter over the epoch / the dataset;
- ``for_epoch``: the bytes fetched *for* the epoch: each fetch of the daemon's fetch log
  (its ``fetched URL ... (N bytes)`` line: URL, bytes, when) is attributed to the epoch
  whose read of that shard first follows it, whenever it happened (the last shards of a
  cold epoch's window are prefetched for the next epoch before the boundary);
- ``ahead``: of the bytes fetched during the epoch, those fetched for a later epoch;
- ``unread``: bytes fetched during the epoch that no read followed (the run's end
  included); ``twice`` (``wasted`` in the JSON): bytes fetched during the epoch of a
  shard fetched again before anyone read it (a prefetch evicted before its read), and
  their count per run; ``again``: shards fetched more than once for one epoch's reads;

So ``fetched`` = ``for_epoch`` - (what earlier epochs fetched for it) + ``ahead`` +
``unread`` + ``twice``: an epoch's counter above the dataset with ``for_epoch`` at 1.000x
and nothing ``twice`` is the next epoch's shards, fetched early, not waste.
- ``min``, ``min_slots``: MIN over the reads the daemon saw (each shard's first pin per
  epoch, in order), with the hot tier's capacity, and with one shard less per reader.

Every configuration gets a fresh daemon and an empty hot tier; ``--repeats`` runs with
seeds ``--first-seed`` on. It prints figures and asserts nothing.

    python bench/volume.py                       # 32 shards, 2 workers, 3 epochs, 3 seeds
    python bench/volume.py --store file --repeats 1
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cached_client import CachedDataset
from torch.utils.data import DataLoader

from bench import common, stores
from bench.cache_sim import misses_by_epoch
from cached.config import load
from cached.daemon import Daemon
from cached_demo.stack import daemon_in_thread

# (time, "fetch" | "read", url, bytes): the daemon's fetches (bytes fetched) and pins (a
# reader's lease on the shard; bytes held), in order.
Event = tuple[float, str, str, int]


class _FetchLog(logging.Handler):
    """Takes the daemon's fetch log (``cached.fetcher``'s ``fetched %s from the %s tier (%d
    bytes) in %.2fs``, logged once per download as it is published) as events."""

    def __init__(self, events: list[Event]) -> None:
        super().__init__(logging.INFO)
        self.events = events

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, str) and record.msg.startswith("fetched %s from the"):
            assert isinstance(record.args, tuple)
            url, _tier, size = record.args[:3]
            assert isinstance(size, int)
            self.events.append((time.monotonic(), "fetch", str(url), size))


@contextmanager
def watch(daemon: Daemon) -> Iterator[list[Event]]:
    """Record every download (the daemon's fetch log) and every pin (a reader's lease)."""
    events: list[Event] = []
    hot, pin = daemon.hot, daemon.hot.pin

    def pinned(shard: Any) -> None:
        events.append((time.monotonic(), "read", shard.url, shard.reserved_bytes))
        pin(shard)

    hot.pin = pinned  # type: ignore[method-assign]
    logger = logging.getLogger("cached.fetcher")
    handler, level = _FetchLog(events), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield events
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


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


@dataclass
class Attributed:
    """Fetched bytes per epoch by what they were fetched for (see the module's doc)."""

    for_epoch: list[int]
    ahead: list[int]
    unread: list[int]
    wasted: list[int]  # bytes of the fetches counted in ``twice``, by when they happened
    twice: int
    again: int


def attribute(events: Sequence[Event], windows: Sequence[tuple[float, float]]) -> Attributed:
    """Each fetch to the epoch whose read of its shard first follows it; the fetches no
    read followed, and those followed by another fetch of the shard first."""
    n = len(windows)
    out = Attributed([0] * n, [0] * n, [0] * n, [0] * n, 0, 0)
    consumed: set[tuple[int, str]] = set()

    def epoch_at(t: float) -> int:  # the last epoch that started by then
        return max([0] + [e for e, (start, _) in enumerate(windows) if start <= t])

    for i, (t, kind, url, size) in enumerate(events):
        if kind != "fetch":
            continue
        following = next(((t2, k) for t2, k, u, _ in events[i + 1 :] if u == url), None)
        during = epoch_at(t)
        if following is None:
            out.unread[during] += size
        elif following[1] == "fetch":
            out.twice += 1
            out.wasted[during] += size
        else:
            epoch = epoch_at(following[0])
            out.for_epoch[epoch] += size
            if epoch != during:
                out.ahead[during] += size
            out.again += (epoch, url) in consumed
            consumed.add((epoch, url))
    return out


def min_per_epoch(
    events: Sequence[Event], windows: Sequence[tuple[float, float]], capacity: int
) -> list[int]:
    """Bytes MIN fetches per epoch over the reads seen (first pin per shard and epoch):
    its choices with the room each shard takes in the hot tier, its bytes counted as the
    daemon's fetch log counts them (the shard's own size), like ``for_epoch``."""
    fetched = {url: size for _, kind, url, size in events if kind == "fetch"}
    epochs: list[list[tuple[str, int]]] = []
    for start, end in windows:
        reads: dict[str, int] = {}
        for t, kind, url, size in events:
            if kind == "read" and start <= t <= end:
                reads.setdefault(url, size)
        epochs.append(list(reads.items()))
    return [
        sum(fetched.get(str(url), size) for url, size in misses)
        for misses in misses_by_epoch(epochs, capacity)
    ]


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
            # One user on a tier a few shards large: the shared-node share (0.75 of the
            # tier) is two workers' pins at --small's size, and a third pin was refused.
            "server.max_pinned_share_per_user": 1.0,
        }
        if endpoint is not None:
            overrides["s3.endpoint_url"] = endpoint
        cfg = load(None, env={}, overrides=overrides)
        with daemon_in_thread(cfg, start_timeout_s=60) as (daemon, _loop), watch(daemon) as events:
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
    done = attribute(events, windows)
    return {
        "seed": seed,
        "fetched": fetched,
        "for_epoch": done.for_epoch,
        "ahead": done.ahead,
        "unread": done.unread,
        "wasted": done.wasted,
        "twice": done.twice,
        "again": done.again,
        "min": min_per_epoch(events, windows, args.capacity),
        "min_slots": min_per_epoch(events, windows, args.capacity - args.workers * shard),
        "shard_bytes": shard,
    }


def stage(args: argparse.Namespace, work: Path, stack: ExitStack) -> tuple[list[str], str | None]:
    """The shards: written to ``work`` and, unless ``--store file``, uploaded to the S3
    store (bench/stores.py; RGW or moto, its own processes, stopped with ``stack``)."""
    shards = common.write_shards(work / "shards", args.shards, args.samples, args.sample_size)
    args.dataset = shards.tar_bytes
    args.capacity = int(args.dataset * args.capacity_fraction)
    if args.store == "file":
        return shards.urls, None
    import boto3

    # The daemon's S3 client reads the store's keys from the environment s3_store sets.
    store = stack.enter_context(stores.s3_store(args.store, work))
    common.log(store.describe())
    endpoint = store.endpoint_url
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket="volume")
    for path in shards.paths:
        s3.upload_file(str(path), "volume", path.name)
    return [f"s3://volume/{p.name}" for p in shards.paths], endpoint


def summary(runs: Sequence[dict[str, Any]], dataset: int) -> str:
    """Medians per epoch, as shares of the dataset, and each epoch against MIN's slots."""
    lines = [
        "epoch  fetched  for epoch  max for epoch   ahead  unread  twice    min  min_slots  "
        "for epoch / min_slots"
    ]

    def median(key: str, e: int) -> float:
        return float(statistics.median(r[key][e] for r in runs)) / dataset

    for e in range(len(runs[0]["fetched"])):
        own, slots = median("for_epoch", e), median("min_slots", e)
        most = max(r["for_epoch"][e] for r in runs) / dataset
        lines.append(
            f"{e:>5}  {median('fetched', e):>6.3f}x  {own:>8.3f}x  {most:>12.3f}x  "
            f"{median('ahead', e):>5.3f}x  {median('unread', e):>5.3f}x  "
            f"{median('wasted', e):>5.3f}x  "
            f"{median('min', e):.3f}x  {slots:>8.3f}x  {own / slots:>10.3f}x"
        )
    lines.append(f"fetched twice before a read, per run: {[r['twice'] for r in runs]}")
    lines.append(f"fetched again for one epoch's reads, per run: {[r['again'] for r in runs]}")
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
    p.add_argument(
        "--store",
        choices=(*stores.STORES, "file"),
        default="auto",
        help="the S3 store (bench/stores.py: auto, rgw, moto) or file:// URLs",
    )
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
