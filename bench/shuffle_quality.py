"""Shuffle quality of the placements, beside Mosaic Streaming's py1e (issue 24, item 1).

``placement="node"`` keeps each shard on one node and shuffles within the node; the
question is what that costs the batches against ``"global"``, which spreads every epoch
over all readers, and against Mosaic Streaming's default (``py1e`` over canonical nodes,
``relaxed`` partitions), which makes the same trade.

Nothing is read: every loader's epoch order is computed by the loaders' own code.
``cached``: ``placement.plan`` for each reader (rank x DataLoader worker), each part's
samples in order through the reader's ``ShuffleBuffer`` (its seed, its early start after
the first part), cut into batches as a DataLoader worker does. Mosaic: ``get_partitions``
and ``get_shuffle`` as its ``random`` batching calls them (its defaults:
``num_canonical_nodes`` = nodes, ``shuffle_block_size`` = max(4,000,000 / nodes, 2**18)).

The dataset is laid out the hard way, as data written class by class often is: ``C``
classes, each in a run of consecutive shards. Per batch:

- distinct shards: how many source shards its samples come from (more is better);
- label entropy: the entropy of its labels over ``log(min(batch, C))`` (1: as mixed as a
  batch of that size can be);
- shard pairs met: over the epochs run, the share of all pairs of shards whose samples
  met in some batch (a pair never met can never shape a gradient step on one rank
  together; under a fixed placement, shards of two nodes never meet).

    .venv-peers/bin/python bench/shuffle_quality.py           # 4 nodes x 2 ranks x 2 workers,
                                                              # 1,024 shards of 256, 3 epochs
    .venv-peers/bin/python bench/shuffle_quality.py --small
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cached_client import partition, placement

from bench import common

Batch = list[tuple[int, int]]  # (shard, sample index within it)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    p.add_argument("--shards", type=int, default=1024)
    p.add_argument("--per-shard", type=int, default=256, help="samples per shard")
    p.add_argument("--classes", type=int, default=128, help="each in a run of shards")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--shuffle-buffer", type=int, default=1000, help="CachedDataset's default")
    p.add_argument(
        "--big-buffer", type=int, default=8000, help="a larger shuffle_buffer, for one more row"
    )
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--small", action="store_true", help="2 nodes, 128 shards of 64, 1 epoch")
    p.add_argument("--out", type=Path, default=common.OUT_DIR)
    args = p.parse_args(argv)
    if args.small:
        args.nodes, args.shards, args.per_shard, args.epochs = 2, 128, 64, 1
    if not 0 < args.classes <= args.shards or min(args.nodes, args.batch_size) < 1:
        p.error("--classes must be within 1..--shards; --nodes and --batch-size positive")
    return args


def cached_batches(
    args: argparse.Namespace, place: str, mix: float, epoch: int, buffer: int, *, seed: int = 0
) -> Iterator[Batch]:
    """Every DataLoader batch of the job in ``epoch`` under ``placement=place``."""
    world = args.nodes * args.ranks_per_node
    for rank in range(world):
        for worker in range(args.workers):
            reader = placement.Reader(
                rank,
                world,
                worker,
                args.workers,
                placement=place,
                local_world_size=args.ranks_per_node,
                mix=mix,
            )
            parts = placement.plan(args.shards, reader, shuffle=True, seed=seed, epoch=epoch)
            rng = random.Random(f"samples/{seed}/{epoch}/{reader.stream}")
            yield from _batches(_shuffled(parts, args.per_shard, buffer, rng), args.batch_size)


def _shuffled(
    parts: Sequence[partition.Part], per_shard: int, buffer: int, rng: random.Random
) -> Iterator[tuple[int, int]]:
    """A reader's samples through its shuffle buffer, which starts early once the first
    part is all in (as ``CachedDataset``'s does)."""
    first_in = False

    def samples() -> Iterator[tuple[int, int]]:
        nonlocal first_in
        for i, part in enumerate(parts):
            stop = per_shard if part.stop is None else part.stop
            for k in range(part.start, stop):
                yield part.shard, k
            first_in = first_in or i == 0

    return partition.buffered_shuffle(samples(), buffer, rng, early=lambda: first_in)


def _batches(items: Iterator[tuple[int, int]], size: int) -> Iterator[Batch]:
    batch: Batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def mosaic_batches(args: argparse.Namespace, epoch: int, seed: int = 0) -> Iterator[Batch] | None:
    """Mosaic Streaming's batches in ``epoch`` (py1e, relaxed), or None without it."""
    try:
        import numpy as np

        from bench.peers_systems.sys_mosaic import import_streaming

        import_streaming()  # with its torchvision stand-in (see there)
        from streaming.base.partition import get_partitions
        from streaming.base.shuffle import get_shuffle
    except ImportError:
        return None
    nodes = args.nodes
    total = args.shards * args.per_shard
    ids = get_partitions(
        "relaxed", total, nodes, nodes, args.ranks_per_node, args.workers, args.batch_size
    )
    block = max(4_000_000 // nodes, 1 << 18)
    sizes = np.full(args.shards, args.per_shard, dtype=np.int64)
    order = get_shuffle("py1e", sizes, nodes, seed, epoch, block)
    ids = np.where(ids != -1, order[ids], -1)
    flat = ids.reshape(-1, ids.shape[-1])

    def batches() -> Iterator[Batch]:
        for row in flat:
            batch = [(int(i) // args.per_shard, int(i) % args.per_shard) for i in row if i >= 0]
            if batch:
                yield batch

    return batches()


def measure(args: argparse.Namespace, batches: Iterator[Batch], met: set[int]) -> dict[str, Any]:
    """Distinct shards and label entropy per batch; the pairs of shards met go into
    ``met`` (as ``a * shards + b``, a < b)."""
    per_class = max(1, args.shards // args.classes)
    distinct, entropy = [], []
    samples = Counter[tuple[int, int]]()
    for batch in batches:
        samples.update(batch)
        shards = Counter(s for s, _ in batch)
        distinct.append(len(shards))
        labels = Counter(min(s // per_class, args.classes - 1) for s, _ in batch)
        n = len(batch)
        h = -sum(c / n * math.log(c / n) for c in labels.values())
        top = math.log(min(n, args.classes))
        entropy.append(h / top if top > 0 else 1.0)
        met.update(a * args.shards + b for a, b in itertools.combinations(sorted(shards), 2))
    return {
        "batches": len(distinct),
        "samples": sum(samples.values()),
        "repeats": sum(c - 1 for c in samples.values() if c > 1),
        "distinct_shards_mean": statistics.fmean(distinct),
        "distinct_shards_p10": sorted(distinct)[len(distinct) // 10],
        "label_entropy_mean": statistics.fmean(entropy),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    doc, started = common.start_run("shuffle_quality", "Shuffle quality of the placements")
    total = args.shards * args.per_shard
    common.log(
        f"{args.nodes} nodes x {args.ranks_per_node} ranks x {args.workers} workers; "
        f"{args.shards} shards x {args.per_shard} samples, {args.classes} classes each in "
        f"a run of shards; batch {args.batch_size}, shuffle buffer {args.shuffle_buffer}"
    )
    rows: dict[str, list[dict[str, Any]]] = {}
    met: dict[str, set[int]] = {}
    buf, big = args.shuffle_buffer, args.big_buffer
    for epoch in range(args.epochs):
        runs: dict[str, Iterator[Batch] | None] = {
            "cached global": cached_batches(args, "global", 0.0, epoch, buf),
            "cached node": cached_batches(args, "node", 0.0, epoch, buf),
            "cached node, mix 0.1": cached_batches(args, "node", 0.1, epoch, buf),
            f"cached node, shuffle_buffer {big}": cached_batches(args, "node", 0.0, epoch, big),
            "Mosaic py1e (default)": mosaic_batches(args, epoch),
        }
        for name, batches in runs.items():
            if batches is None:
                continue
            row = measure(args, batches, met.setdefault(name, set()))
            if row["samples"] - row["repeats"] < total * 0.99:
                raise SystemExit(f"{name}: an epoch read {row['samples']} of {total} samples")
            rows.setdefault(name, []).append(row)
    if "Mosaic py1e (default)" not in rows:
        common.log("Mosaic Streaming is not importable here: its row is left out")
    pairs = args.shards * (args.shards - 1) // 2
    common.log(
        f"\n| loader | distinct shards per batch (mean, p10) | label entropy | shard pairs met "
        f"in {args.epochs} epoch(s) |\n|---|---|---|---|"
    )
    for name, epochs in rows.items():
        mean = statistics.fmean(r["distinct_shards_mean"] for r in epochs)
        p10 = min(r["distinct_shards_p10"] for r in epochs)
        ent = statistics.fmean(r["label_entropy_mean"] for r in epochs)
        share = len(met[name]) / pairs
        doc.setdefault("pairs_met", {})[name] = share
        common.log(f"| {name} | {mean:.1f}, {p10} | {ent:.3f} | {share:.3f} |")
    doc["rows"] = rows
    common.finish_run("shuffle_quality", doc, started, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
