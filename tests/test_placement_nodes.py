"""Three nodes, each with its own daemon and hot tier, reading one bucket: with
``placement="node"`` the shards stay where they were cached, so the store sees the dataset
once, in the first epoch; with ``"global"`` every epoch moves shards to other nodes and
the tiers (each 0.45 of the dataset, together 1.35) refetch them.

Real parts: 3 daemons per placement (each on its own loop in this process, with its own
socket and tier), 6 gloo ranks in spawned processes with torchrun's variables (2 per
node), the ``bucket`` fixture's S3 server. Every rank records its samples per epoch and,
on each node's first rank, the node daemon's fetched bytes after each epoch.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch.multiprocessing as tmp

pytestmark = pytest.mark.slow  # a minute: 6 spawned ranks, 6 daemons, 6 epochs

if TYPE_CHECKING:  # the spawned ranks import this module: keep it light
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


@dataclass(frozen=True)
class Job:
    """What the ranks are told (plain values: pickled into spawned processes)."""

    pattern: str
    sockets: dict[str, list[str]]  # per placement, per node
    init_file: str
    out: str


def _rank_main(rank: int, job: Job) -> None:
    """One training process under torchrun's variables: for each placement, 3 epochs
    through its node's daemon; the node's first rank reads the daemon's fetched bytes
    after every epoch (all ranks of the job past a barrier, so the epoch is over)."""
    import torch
    import torch.distributed as dist
    from cached_client import CachedDataset
    from cached_client.protocol import Op
    from cached_client.transport import Connection

    node, local = divmod(rank, LOCAL)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(local),
        LOCAL_WORLD_SIZE=str(LOCAL),
        GROUP_RANK=str(node),
        GLOO_SOCKET_IFNAME="lo",
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{job.init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    result: dict[str, Any] = {}
    try:
        for placement in PLACEMENTS:
            socket = job.sockets[placement][node]
            ds = CachedDataset(
                job.pattern, socket=socket, shuffle=True, seed=3, placement=placement
            )
            assert (ds.rank, ds.world_size, ds.local_world_size) == (
                rank,
                WORLD,
                LOCAL if placement == "node" else None,
            )
            epochs: list[dict[str, Any]] = []
            for epoch in range(EPOCHS):
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
            init_file=str(tmp_path / "init"),
            out=str(tmp_path),
        )
        ctx = tmp.start_processes(
            _rank_main, args=(job,), nprocs=WORLD, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    pytest.fail(f"the ranks did not finish within {JOIN_TIMEOUT_S}s (a hang)")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(10)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]

    fetched: dict[str, list[float]] = {}  # per placement, per epoch: bytes from the store
    for placement in PLACEMENTS:
        for epoch in range(EPOCHS):
            # Every sample exactly once per epoch across all ranks.
            seen = Counter(k for r in ranks for k in r[placement][epoch]["keys"])
            assert seen == Counter(keys), (placement, epoch)
        totals = [
            sum(ranks[node * LOCAL][placement][e]["fetched"] for node in range(NODES))
            for e in range(EPOCHS)
        ]
        fetched[placement] = [b - a for a, b in zip([0.0, *totals], totals, strict=False)]
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
