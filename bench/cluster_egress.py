"""Cluster egress, measured (issue 24, item 3): N daemons as N nodes, M gloo ranks each,
one store; the bytes the store sends per epoch under both placements, against each
node's Belady MIN for its own order.

Each node is a ``cached serve`` process with its own hot tier and socket; each rank a
spawned process under torchrun's variables (``RANK``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``...), on gloo, reading ``CachedDataset(placement=...)`` for ``--epochs``
epochs through its node's daemon. After every epoch (a barrier) the node's first rank
asks its daemon what it fetched. Every rank records its keys, so the run also checks
that every sample was read exactly once per epoch across the job.

Two tiers: ``--fit`` of the dataset per node (N x fit >= 1.2: the tiers together hold
it) and ``--short`` (they do not). The floor is MIN: each node's own reads, in the order
its readers ask (the placement's plans, dealt round-robin over the node's ranks),
replayed through ``bench/cache_sim.offline_min`` with the node's tier, summed over the
nodes. Issue 24 asks, with the tiers holding the dataset, epochs 2 and later at most 5 %
of it under ``"node"`` (``"global"`` about ``D (1 - C/D)``), and with less room at most
1.05x the sum of the nodes' MIN.

    python bench/cluster_egress.py            # 4 nodes x 2 ranks, 240 shards, 3 epochs
    python bench/cluster_egress.py --small    # 3 nodes x 2 ranks, 48 shards
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common, stores

PLACEMENTS = ("node", "global")
BUCKET = "egress"
JOIN_TIMEOUT_S = 600


@dataclass(frozen=True)
class Job:
    """What the ranks are told (plain values: pickled into spawned processes)."""

    pattern: str
    sockets: dict[str, list[str]]  # per placement, per node
    local: int  # ranks per node
    epochs: int
    init_file: str
    out: str
    seed: int = 3


def rank_main(rank: int, job: Job) -> None:
    """One training process under torchrun's variables: for each placement, ``epochs``
    epochs through its node's daemon; the node's first rank reads the daemon's fetched
    bytes after every epoch (all ranks of the job past a barrier, so the epoch is over).
    Writes ``rank{rank}.json`` into ``job.out``."""
    import torch
    import torch.distributed as dist
    from cached_client import CachedDataset
    from cached_client.transport import Connection
    from cached_wire.protocol import Op

    nodes = len(next(iter(job.sockets.values())))
    world = nodes * job.local
    node, local = divmod(rank, job.local)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(local),
        LOCAL_WORLD_SIZE=str(job.local),
        GROUP_RANK=str(node),
        GLOO_SOCKET_IFNAME="lo",
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{job.init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    result: dict[str, Any] = {}
    try:
        for placement, sockets in job.sockets.items():
            socket = sockets[node]
            ds = CachedDataset(
                job.pattern, socket=socket, shuffle=True, seed=job.seed, placement=placement
            )
            assert (ds.rank, ds.world_size, ds.local_world_size) == (
                rank,
                world,
                job.local if placement == "node" else None,
            )
            epochs: list[dict[str, Any]] = []
            for epoch in range(job.epochs):
                ds.set_epoch(epoch)
                keys = [s["__key__"] for s in ds]
                dist.barrier()
                fetched = None
                if local == 0:
                    conn = Connection(socket, connect_timeout_s=5.0)
                    try:
                        header, _ = conn.request({"op": Op.STATUS})
                    finally:
                        conn.close()
                    fetched = header["status"]["counters"]["fetched_bytes"]
                epochs.append({"keys": keys, "fetched": fetched})
                dist.barrier()
            result[placement] = epochs
        Path(job.out, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(job: Job, world: int, timeout_s: float = JOIN_TIMEOUT_S) -> list[dict[str, Any]]:
    """Spawn the job's ``world`` ranks, wait for them (``timeout_s`` at most: a hang
    raises), and return what each recorded."""
    import torch.multiprocessing as tmp

    ctx = tmp.start_processes(  # type: ignore[no-untyped-call,attr-defined]
        rank_main, args=(job,), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the ranks did not finish within {timeout_s:.0f}s (a hang)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(10)
    return [json.loads(Path(job.out, f"rank{r}.json").read_text()) for r in range(world)]


def fetched_per_epoch(
    ranks: list[dict[str, Any]], placement: str, nodes: int, local: int
) -> list[float]:
    """The bytes the store sent per epoch (every node's daemon, summed)."""
    epochs = len(ranks[0][placement])
    totals = [
        sum(ranks[n * local][placement][e]["fetched"] for n in range(nodes)) for e in range(epochs)
    ]
    return [b - a for a, b in zip([0.0, *totals], totals, strict=False)]


def exactly_once(ranks: list[dict[str, Any]], placement: str, keys: list[str]) -> bool:
    """Whether every epoch read every key exactly once across all ranks."""
    return all(
        Counter(k for r in ranks for k in r[placement][e]["keys"]) == Counter(keys)
        for e in range(len(ranks[0][placement]))
    )


def min_per_epoch(placement: str, sizes: list[int], nodes: int, tier: int, job: Job) -> list[float]:
    """The sum over nodes of Belady's MIN for each node's own reads, per epoch."""
    from cached_client import placement as plans

    from bench.cache_sim import misses_by_epoch

    local, shards = job.local, len(sizes)
    world = nodes * local
    out = [0.0] * job.epochs
    for node in range(nodes):
        epochs: list[list[tuple[int, int]]] = []
        for epoch in range(job.epochs):
            readers = [
                [
                    p.shard
                    for p in plans.plan(
                        shards,
                        plans.Reader(rank, world, placement=placement, local_world_size=local),
                        shuffle=True,
                        seed=job.seed,
                        epoch=epoch,
                    )
                ]
                for rank in range(node * local, (node + 1) * local)
            ]
            # The node's readers ask in turn: their plans dealt round-robin.
            rounds = range(max(map(len, readers), default=0))
            epochs.append([(r[i], sizes[r[i]]) for i in rounds for r in readers if i < len(r)])
        for epoch, misses in enumerate(misses_by_epoch(epochs, tier)):
            out[epoch] += sum(size for _, size in misses)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--local", type=int, default=2, help="gloo ranks per node")
    p.add_argument("--shards", type=int, default=240)
    p.add_argument("--per-shard", type=int, default=4, help="samples per shard")
    p.add_argument("--sample-kb", type=int, default=12)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--fit", type=float, default=0.35, help="tier per node, x the dataset")
    p.add_argument("--short", type=float, default=0.15, help="a tier too small, x the dataset")
    p.add_argument("--small", action="store_true", help="3 nodes x 2 ranks, 48 shards")
    p.add_argument("--out", type=Path, default=common.OUT_DIR)
    stores.add_argument(p)
    args = p.parse_args(argv)
    if args.small:
        args.nodes, args.shards, args.per_shard, args.fit = 3, 48, 8, 0.45
    if min(args.nodes, args.local, args.shards, args.per_shard, args.epochs) < 1:
        p.error("--nodes, --local, --shards, --per-shard and --epochs must be positive")
    return args


def one_tier(
    args: argparse.Namespace, share: float, store: stores.Store, work: Path, sizes: list[int]
) -> dict[str, Any]:
    """Both placements with tiers of ``share`` of the dataset: measured and MIN."""
    dataset = sum(sizes)
    tier = int(share * dataset)
    run = work / f"tier-{share}"
    with ExitStack() as stack:
        sockets = {
            placement: [
                stack.enter_context(
                    common.s3_daemon(
                        run / f"{placement}{n}",
                        store.endpoint_url,
                        str(tier),
                        # One user pins what a rank reads: let it pin the whole tier.
                        server={"max_pinned_share_per_user": 1.0},
                    )
                ).socket
                for n in range(args.nodes)
            ]
            for placement in PLACEMENTS
        }
        job = Job(
            pattern=f"s3://{BUCKET}/shard-{{000000..{args.shards - 1:06d}}}.tar",
            sockets=sockets,
            local=args.local,
            epochs=args.epochs,
            init_file=str(run / "init"),
            out=str(run),
        )
        ranks = run_ranks(job, args.nodes * args.local)
    keys = [f"s{s:06d}-{i:07d}" for s in range(args.shards) for i in range(args.per_shard)]
    out: dict[str, Any] = {"tier_share": share, "dataset_bytes": dataset}
    for placement in PLACEMENTS:
        measured = fetched_per_epoch(ranks, placement, args.nodes, args.local)
        floor = min_per_epoch(placement, sizes, args.nodes, tier, job)
        out[placement] = {
            "exactly_once": exactly_once(ranks, placement, keys),
            "fetched": measured,
            "min": floor,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    doc, started = common.start_run("cluster_egress", "Cluster egress: N daemons, one store")
    with common.workdir("cached-egress-") as work, stores.s3_store(args.store, work) as store:
        common.log(store.describe())
        import boto3

        shards = common.write_shards(
            work / "shards", args.shards, args.shards * args.per_shard, args.sample_kb << 10
        )
        s3 = boto3.client("s3", endpoint_url=store.endpoint_url, region_name="us-east-1")
        s3.create_bucket(Bucket=BUCKET)
        for path in shards.paths:
            s3.upload_file(str(path), BUCKET, path.name)
        sizes = [p.stat().st_size for p in shards.paths]
        common.log(
            f"{args.nodes} nodes x {args.local} ranks, {args.shards} shards "
            f"({common.human(sum(sizes))}), {args.epochs} epochs"
        )
        tiers = [one_tier(args, share, store, work, sizes) for share in (args.fit, args.short)]
    doc["store"], doc["tiers"] = store.kind, tiers
    ok = True
    for t in tiers:
        d = t["dataset_bytes"]
        together = args.nodes * t["tier_share"]
        common.log(
            f"\ntiers of {t['tier_share']:.2f}x the dataset each ({together:.2f}x "
            f"together); bytes from the store per epoch, x the dataset\n\n"
            f"| placement | measured | MIN, each node's own order | measured / MIN, all epochs "
            f"| exactly once |\n|---|---|---|---|---|"
        )
        for placement in PLACEMENTS:
            r = t[placement]
            got = ", ".join(f"{b / d:.2f}" for b in r["fetched"])
            floor = ", ".join(f"{b / d:.2f}" for b in r["min"])
            ratio = sum(r["fetched"]) / max(1.0, sum(r["min"]))
            ok &= r["exactly_once"]
            common.log(f"| {placement} | {got} | {floor} | {ratio:.2f}x | {r['exactly_once']} |")
    common.finish_run("cluster_egress", doc, started, args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
