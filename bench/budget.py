"""Many nodes start cold against one store with a request limit (issue 24, item 4).

N ``cached serve`` processes, each with its own hot tier and socket (N nodes), read one
bucket through a proxy that answers 503 SlowDown above ``--limit`` requests per second in
total (tests/faultproxy.py: a token bucket holding one request per node), in front of
RGW (``--store``; moto where RGW cannot start). At the go every node runs ``cached
prefetch`` of its own ``--shards-per-node`` shards at once, as a job's nodes do at a cold
start with ``placement="node"``. Two settings, alternated over ``--repeats`` rounds:

- ``share``: ``[s3] max_requests_per_s`` = limit / N on every node;
- ``none``: no share set (0); each daemon finds the rate from the SlowDowns (AIMD).

For each it prints, as medians: the fill time at the store (its first request to its
last) against what the limit allows (requests / limit), the SlowDowns, the failed reads,
and the most requests the store answered in any one second.

With ``--store-mbps`` the store is limited in bandwidth instead (the proxy's responses
share one link of that rate, and no request limit): the setting ``bandwidth``, whose fill
time at the store (the first request's arrival to the link's last byte) is set against
``bench/cluster_sim.py``'s model of a bandwidth-limited cold start (issue 24, item 6).

    python bench/budget.py            # 6 nodes x 60 shards, limit 30/s, 3 rounds
    python bench/budget.py --small    # 3 nodes x 20 shards, 1 round (CI)
    python bench/budget.py --nodes 8 --shards-per-node 16 --shard-kb 1024 --store-mbps 40
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import boto3

from bench import cluster_sim, common, stores
from tests.faultproxy import FaultProxy

BUCKET = "budget"
SETTINGS = ("share", "none")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nodes", type=int, default=6, help="daemons, one per simulated node")
    p.add_argument("--shards-per-node", type=int, default=60)
    p.add_argument(
        "--shard-kb",
        type=int,
        default=64,
        help="shard size: small, so that requests, not bytes, are the limit",
    )
    p.add_argument("--limit", type=float, default=30.0, help="the store's requests/s, in all")
    p.add_argument(
        "--store-mbps",
        type=float,
        default=0.0,
        help="limit the store's bandwidth (MB/s, in all) instead of its requests",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--small", action="store_true", help="3 nodes x 20 shards, 1 round")
    p.add_argument("--out", type=Path, default=common.OUT_DIR)
    stores.add_argument(p)
    args = p.parse_args(argv)
    if args.small:
        args.nodes, args.shards_per_node, args.repeats = 3, 20, 1
    if args.nodes < 1 or args.shards_per_node < 1 or args.limit <= 0 or args.repeats < 1:
        p.error("--nodes, --shards-per-node, --limit and --repeats must be positive")
    if args.store_mbps < 0:
        p.error("--store-mbps must not be negative")
    return args


def settings(args: argparse.Namespace) -> tuple[str, ...]:
    return ("bandwidth",) if args.store_mbps else SETTINGS


def against(args: argparse.Namespace) -> str:
    """What a round's fill is set against."""
    if args.store_mbps:
        return f"the model's for {args.store_mbps:g} MB/s"
    return f"what {args.limit:g}/s allows"


def upload(endpoint: str, work: Path, count: int, size: int) -> tuple[list[str], int]:
    """``count`` tar shards of about ``size`` bytes (16 samples each) in the bucket; their
    URLs and their bytes in all."""
    shards = common.write_shards(work / "shards", count, count * 16, max(1, size // 16))
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket=BUCKET)
    for path in shards.paths:
        s3.upload_file(str(path), BUCKET, path.name)
    return [f"s3://{BUCKET}/{path.name}" for path in shards.paths], shards.tar_bytes


def one_round(
    args: argparse.Namespace,
    setting: str,
    urls: list[str],
    proxy: FaultProxy,
    work: Path,
    *,
    dataset: int,
) -> dict[str, Any]:
    """Start the nodes, let them prefetch at once, and measure at the store."""
    proxy.seen.clear()
    share = args.limit / args.nodes if setting == "share" else 0.0
    s3 = {"max_requests_per_s": share}
    daemons = [
        common.s3_daemon(
            work / f"{setting}-{time.monotonic_ns()}" / f"node{n}",
            proxy.endpoint_url,
            "4GiB",
            s3=s3,
        ).start()
        for n in range(args.nodes)
    ]
    try:
        shares = [urls[n :: args.nodes] for n in range(args.nodes)]
        started = time.monotonic()
        runs = [
            subprocess.Popen(
                [sys.executable, "-m", "cached", "prefetch", "--socket", d.socket, *share_urls],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for d, share_urls in zip(daemons, shares, strict=True)
        ]
        failed = 0
        for run in runs:
            _, err = run.communicate(timeout=600)
            failed += sum(1 for line in err.splitlines() if "gave up" in line)
        wall = time.monotonic() - started
    finally:
        for d in daemons:
            d.stop()
    load = proxy.limited_load()
    if setting == "bandwidth":
        return bandwidth_result(args, proxy, dataset, wall, failed) | {
            "most_in_1s": load.most_in_1s
        }
    allowed = load.answered / args.limit
    return {
        "setting": setting,
        "share_per_s": share,
        "answered": load.answered,
        "slowdowns": load.refused,
        "failed_reads": failed,
        "fill_s": load.span_s,
        "allowed_s": allowed,
        "ratio": load.span_s / allowed if allowed else None,
        "wall_s": wall,
        "most_in_1s": load.most_in_1s,
    }


def bandwidth_result(
    args: argparse.Namespace, proxy: FaultProxy, dataset: int, wall: float, failed: int
) -> dict[str, Any]:
    """A bandwidth-limited round of ``dataset`` bytes: the fill at the store against the
    model's."""
    first = min(s.at for s in proxy.seen)
    fill = proxy.link_done_at - first
    predicted = cluster_sim.model(
        cluster_sim.Cluster(
            nodes=args.nodes,
            ranks=1,
            workers=1,
            dataset=dataset,
            tier=dataset,
            shard=dataset / (args.nodes * args.shards_per_node),
            nic=float("inf"),  # loopback
            store_bw=args.store_mbps * 1e6,
            store_rps=float("inf"),
        ),
        epochs=1,
        sim_shards=args.nodes * args.shards_per_node,
        seed=0,
    )
    return {
        "setting": "bandwidth",
        "answered": len(proxy.seen),
        "slowdowns": 0,
        "failed_reads": failed,
        "fill_s": fill,
        "allowed_s": predicted.cold_fill_s,
        "ratio": fill / predicted.cold_fill_s,
        "wall_s": wall,
        "limited_by": predicted.limited_by,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    limited = "bandwidth" if args.store_mbps else "request"
    doc, started = common.start_run("budget", f"Many nodes, one store with a {limited} limit")
    with common.workdir("cached-budget-") as work, stores.s3_store(args.store, work) as store:
        common.log(store.describe())
        count = args.nodes * args.shards_per_node
        urls, dataset = upload(store.endpoint_url, work, count, args.shard_kb << 10)
        limit = (
            f"sends {args.store_mbps:g} MB/s in all"
            if args.store_mbps
            else f"answers SlowDown above {args.limit:g} requests/s in all (burst {args.nodes})"
        )
        common.log(
            f"{args.nodes} nodes x {args.shards_per_node} shards of {args.shard_kb} KiB; "
            f"the store {limit}"
        )
        rounds: list[dict[str, Any]] = []
        with FaultProxy.start(store.endpoint_url) as proxy:
            if args.store_mbps:
                proxy.rate_bps = args.store_mbps * 1e6
            else:
                proxy.max_requests_per_s = args.limit
                proxy.request_burst = args.nodes
            for r in range(args.repeats):
                for setting in settings(args) if r % 2 == 0 else settings(args)[::-1]:
                    result = one_round(args, setting, urls, proxy, work, dataset=dataset)
                    rounds.append(result)
                    common.log(
                        f"  round {r + 1} {setting:5}: fill {result['fill_s']:.2f} s "
                        f"({result['ratio']:.2f}x {against(args)}), "
                        f"{result['slowdowns']} SlowDowns, {result['failed_reads']} failed "
                        f"reads, at most {result['most_in_1s']} requests in a second"
                    )
    doc["store"] = store.kind
    doc["rounds"] = rounds
    common.log("\nmedians:")
    ok = True
    for setting in settings(args):
        mine = [r for r in rounds if r["setting"] == setting]
        med = {k: statistics.median(r[k] for r in mine) for k in ("fill_s", "ratio", "slowdowns")}
        failed = sum(r["failed_reads"] for r in mine)
        ok &= failed == 0
        common.log(
            f"  {setting:5} fill {med['fill_s']:.2f} s, {med['ratio']:.2f}x {against(args)}, "
            f"{med['slowdowns']:.0f} SlowDowns, {failed} failed reads"
        )
    common.finish_run("budget", doc, started, args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
