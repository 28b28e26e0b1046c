"""A thousand nodes on paper (issue 24, item 6): egress per epoch, the cold start's fill,
and the time to the first batch, for N nodes reading one store.

Inputs: nodes, ranks per node and DataLoader workers per rank, the dataset and each
node's hot tier, the shard size, the NIC's rate, the store's bandwidth and request limit.

**Egress per epoch** comes from replaying one node's reads through Belady's MIN (the
optimum the daemon's eviction approaches with the readers' plans: D30, docs/benchmarks.md
"Fetch volume"), ``bench/cache_sim.offline_min``; nodes are alike, so the cluster pulls N
times one node. What a node reads each epoch:

- ``node`` (``placement="node"``): its fixed 1/N of the shards, in a new order each epoch;
- ``global``: a new random 1/N of all shards each epoch (the shards are dealt over every
  reader of the job);
- Mosaic Streaming (py1e over canonical nodes = nodes): the ``node`` reads, with its
  cache's eviction, least recently used first, in place of MIN.

A node's share of shards is replayed whole up to ``--sim-shards``; past that the shards
and the tier are scaled down together (the fractions fetched of random orders do not
depend on the scale; the first epochs' figures say how close).

**Cold start.** Every node fetches its share of the first epoch at once. A node fills at
the least of its NIC, its share of the store's bandwidth, and its share of the request
limit times the bytes per request (a shard of S is ``ceil(S / --part-mb)`` GETs: ``[s3]
part_size``, 16 MiB by default, which the native path takes when the store's requests are
budgeted, D45's ``[s3] max_requests_per_s`` = limit / N). The first batch of every
reader needs its first shard (the shuffle buffer starts once it is in): ranks x workers
shards per node at once.

    python bench/cluster_sim.py                       # 1, 8, 32, 64, 1000 nodes, issue 24's example
    python bench/cluster_sim.py --nodes 32 --dataset-tb 100 --tier-tb 8
    python bench/cluster_sim.py --small
"""

from __future__ import annotations

import argparse
import collections
import math
import random
import sys
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common
from bench.cache_sim import min_misses, misses_by_epoch

MIB = 1 << 20
TB = 10**12
MB = 10**6
PLACEMENTS = ("node", "global", "mosaic")


@dataclass(frozen=True)
class Cluster:
    """The inputs (sizes in bytes, rates in bytes/s and requests/s)."""

    nodes: int
    ranks: int
    workers: int
    dataset: float
    tier: float
    shard: float
    nic: float
    store_bw: float
    store_rps: float
    part: float = 16 * MIB  # bytes per GET: [s3] part_size (the native path's, with a budget)

    @property
    def shards(self) -> int:
        return max(1, round(self.dataset / self.shard))

    @property
    def requests_per_shard(self) -> int:
        return max(1, math.ceil(self.shard / self.part))

    def node_rate(self) -> tuple[float, str]:
        """Bytes/s one node fills at when all fill at once, and what limits it."""
        limits = {
            "NIC": self.nic,
            "store bandwidth": self.store_bw / self.nodes,
            "request limit": self.store_rps / self.nodes / self.requests_per_shard * self.shard,
        }
        name = min(limits, key=lambda k: limits[k])
        return limits[name], name


def epoch_reads(
    placement: str, n_shards: int, nodes: int, epochs: int, rng: random.Random
) -> list[list[int]]:
    """The shards node 0 reads, per epoch."""
    share = max(1, n_shards // nodes)
    mine = rng.sample(range(n_shards), share)
    out = []
    for _ in range(epochs):
        if placement == "global":
            out.append(rng.sample(range(n_shards), share))
        else:
            order = list(mine)
            rng.shuffle(order)
            out.append(order)
    return out


def lru_misses(sequence: Sequence[tuple[Hashable, int]], capacity: int) -> list[bool]:
    """Which ``(key, size)`` reads miss under least-recently-used eviction with
    ``capacity`` bytes (Mosaic Streaming's cache limit evicts so)."""
    held: collections.OrderedDict[Hashable, int] = collections.OrderedDict()
    used = 0
    missed = []
    for key, size in sequence:
        if key in held:
            held.move_to_end(key)
            missed.append(False)
            continue
        missed.append(True)
        held[key] = size
        used += size
        while used > capacity:
            used -= held.popitem(last=False)[1]
    return missed


def egress(c: Cluster, placement: str, epochs: int, sim_shards: int, seed: int) -> list[float]:
    """The cluster's bytes pulled from the store per epoch, as fractions of the dataset."""
    share = c.shards / c.nodes
    scale = min(1.0, sim_shards / share)
    n = max(c.nodes, round(c.shards * scale))
    tier = max(1, int(c.tier / c.shard * scale))
    reads = epoch_reads(placement, n, c.nodes, epochs, random.Random(seed))
    # Shards of one size: a tier of ``tier`` shards; MIN (cache_sim's) is the optimum.
    unit = [[(s, 1) for s in epoch] for epoch in reads]
    replay = {"mosaic": lru_misses}.get(placement, min_misses)
    return [len(m) * c.nodes / n for m in misses_by_epoch(unit, tier, replay)]


@dataclass
class Row:
    """One cluster's figures."""

    nodes: int
    egress: dict[str, list[float]]
    node_rate_mb_s: float
    limited_by: str
    cold_fill_s: float
    cold_requests_per_s: float
    first_batch_s: float


def model(c: Cluster, epochs: int, sim_shards: int, seed: int) -> Row:
    """Egress for every placement, the cold start and the first batch of ``c``."""
    rate, limit = c.node_rate()
    fill = c.dataset / c.nodes / rate  # every node reads its share of the first epoch
    requests = c.nodes * rate / c.shard * c.requests_per_shard
    first_batch = c.ranks * c.workers * c.shard / rate
    return Row(
        nodes=c.nodes,
        egress={p: egress(c, p, epochs, sim_shards, seed) for p in PLACEMENTS},
        node_rate_mb_s=rate / MB,
        limited_by=limit,
        cold_fill_s=fill,
        cold_requests_per_s=requests,
        first_batch_s=first_batch,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 8, 32, 64, 1000])
    p.add_argument("--ranks", type=int, default=8, help="ranks (GPUs) per node")
    p.add_argument("--workers", type=int, default=8, help="DataLoader workers per rank")
    p.add_argument("--dataset-tb", type=float, default=100.0)
    p.add_argument("--tier-tb", type=float, default=8.0, help="each node's hot tier")
    p.add_argument("--shard-mb", type=float, default=64.0)
    p.add_argument("--nic-gbps", type=float, default=100.0, help="each node's, in Gbit/s")
    p.add_argument("--store-gbps", type=float, default=4000.0, help="the store's, in all")
    p.add_argument("--store-rps", type=float, default=5500.0, help="requests/s, in all")
    p.add_argument(
        "--part-mb", type=float, default=16.0, help="bytes per GET, in MiB: [s3] part_size"
    )
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--sim-shards", type=int, default=20_000, help="most shards replayed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--small", action="store_true", help="a smoke run: 2,000 shards replayed")
    p.add_argument("--out", type=Path, default=common.OUT_DIR)
    args = p.parse_args(argv)
    if args.small:
        args.sim_shards = 2_000
    if min(args.nodes) < 1 or args.dataset_tb <= 0 or args.shard_mb <= 0 or args.tier_tb < 0:
        p.error("nodes, dataset and shard size must be positive; the tier not negative")
    return args


def cluster(args: argparse.Namespace, nodes: int) -> Cluster:
    return Cluster(
        nodes=nodes,
        ranks=args.ranks,
        workers=args.workers,
        dataset=args.dataset_tb * TB,
        tier=args.tier_tb * TB,
        shard=args.shard_mb * MB,
        nic=args.nic_gbps * 1e9 / 8,
        store_bw=args.store_gbps * 1e9 / 8,
        store_rps=args.store_rps,
        part=args.part_mb * MIB,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    doc, started = common.start_run("cluster_sim", "A cluster on paper")
    common.log(
        f"dataset {args.dataset_tb:g} TB in {args.shard_mb:g} MB shards; each node: tier "
        f"{args.tier_tb:g} TB, NIC {args.nic_gbps:g} Gbit/s, {args.ranks} ranks x "
        f"{args.workers} workers; the store: {args.store_gbps:g} Gbit/s, "
        f"{args.store_rps:g} requests/s"
    )
    rows = [model(cluster(args, n), args.epochs, args.sim_shards, args.seed) for n in args.nodes]
    head = " | ".join(f"epoch {e + 1}" for e in range(args.epochs))
    common.log(f"\negress per epoch, x the dataset\n\n| nodes | placement | {head} |")
    common.log("|---|---|" + "---|" * args.epochs)
    for row in rows:
        for placement, per_epoch in row.egress.items():
            cells = " | ".join(f"{x:.2f}" for x in per_epoch)
            common.log(f"| {row.nodes} | {placement} | {cells} |")
    common.log(
        "\ncold start\n\n| nodes | node fills at | limited by | first epoch's fill | "
        "requests/s at the store | first batch |\n|---|---|---|---|---|---|"
    )
    for row in rows:
        common.log(
            f"| {row.nodes} | {row.node_rate_mb_s:,.0f} MB/s | {row.limited_by} | "
            f"{row.cold_fill_s:,.0f} s | {row.cold_requests_per_s:,.0f} | "
            f"{row.first_batch_s:,.1f} s |"
        )
    doc["inputs"] = vars(args) | {"out": str(args.out)}
    doc["rows"] = [asdict(r) for r in rows]
    common.finish_run("cluster_sim", doc, started, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
