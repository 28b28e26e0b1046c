"""Three nodes, each with its own daemon and hot tier, reading one bucket: with
``placement="node"`` the shards stay where they were cached, so the store sees the dataset
once, in the first epoch; with ``"global"`` every epoch moves shards to other nodes and
the tiers (each 0.45 of the dataset, together 1.35) refetch them.

Real parts: 3 daemons per placement (each on its own loop in this process, with its own
socket and tier), 6 gloo ranks in spawned processes with torchrun's variables (2 per
node; ``bench/cluster_egress.py``'s ranks, which measures the same at 4 and more nodes
against each node's MIN), the ``bucket`` fixture's S3 server. Every rank records its
samples per epoch and, on each node's first rank, the node daemon's fetched bytes after
each epoch.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from bench.cluster_egress import Job, exactly_once, fetched_per_epoch, run_ranks

pytestmark = pytest.mark.slow  # a minute: 6 spawned ranks, 6 daemons, 6 epochs

if TYPE_CHECKING:
    from tests.s3server import S3Server

NODES = 3
LOCAL = 2  # gloo ranks per node
WORLD = NODES * LOCAL
EPOCHS = 3
SHARDS = 60
PER_SHARD = 8
PAYLOAD = 12_000
TIER_SHARE = 0.45  # of the dataset, per node
PLACEMENTS = ("node", "global")
JOIN_TIMEOUT_S = 150


def test_node_placement_fetches_the_dataset_once(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    from tests.daemon import daemon_config, dataset_shards, thread_daemon

    shards = dataset_shards(SHARDS, PER_SHARD, payload=PAYLOAD, prefix="p")
    for i, body in enumerate(shards):
        s3_server.put(bucket, f"nodes-{i:04d}.tar", body)
    dataset_bytes = sum(len(b) for b in shards)
    keys = [f"p{s:04d}-{i:05d}" for s in range(SHARDS) for i in range(PER_SHARD)]
    with ExitStack() as stack:
        daemons = {
            placement: [
                stack.enter_context(
                    thread_daemon(
                        daemon_config(
                            tmp_path / f"{placement}{n}",
                            s3_server.endpoint_url,
                            **{
                                "cache.capacity": str(int(TIER_SHARE * dataset_bytes)),
                                "server.max_pinned_share_per_user": 1.0,
                            },
                        )
                    )
                )
                for n in range(NODES)
            ]
            for placement in PLACEMENTS
        }
        job = Job(
            pattern=f"s3://{bucket}/nodes-{{0000..{SHARDS - 1:04d}}}.tar",
            sockets={p: [d.socket for d in ds] for p, ds in daemons.items()},
            local=LOCAL,
            epochs=EPOCHS,
            init_file=str(tmp_path / "init"),
            out=str(tmp_path),
        )
        ranks = run_ranks(job, WORLD, timeout_s=JOIN_TIMEOUT_S)

    fetched: dict[str, list[float]] = {}  # per placement, per epoch: bytes from the store
    for placement in PLACEMENTS:
        # Every sample exactly once per epoch across all ranks.
        assert exactly_once(ranks, placement, keys), placement
        fetched[placement] = fetched_per_epoch(ranks, placement, NODES, LOCAL)
    report = {
        p: [f"{b / dataset_bytes:.2f}x" for b in per_epoch] for p, per_epoch in fetched.items()
    }
    print(f"store bytes per epoch, as a share of the dataset ({dataset_bytes} B): {report}")

    node, spread = fetched["node"], fetched["global"]
    assert node[0] >= dataset_bytes  # the cold epoch fetches everything once
    assert node[0] < 1.1 * dataset_bytes
    assert node[1] + node[2] <= 0.05 * dataset_bytes, report  # (nearly) nothing after it
    # What node placement saves: "global" moves shards between nodes and refetches.
    assert spread[1] + spread[2] >= 0.5 * dataset_bytes, report
    # Each node read only its own shards: a node's samples are the same set every epoch.
    for n in range(NODES):
        per_epoch = [
            {
                k.split("-")[0]
                for r in (n * LOCAL, n * LOCAL + 1)
                for k in ranks[r]["node"][e]["keys"]
            }
            for e in range(EPOCHS)
        ]
        assert per_epoch[0] == per_epoch[1] == per_epoch[2]
