"""Distributed training over two "nodes": 4 gloo processes, 2 ``cached serve`` daemons.

Ranks 0 and 1 read through daemon A, ranks 2 and 3 through daemon B (each daemon with its
own socket and hot tier), each rank with a DataLoader of 2 worker processes. The shards
are uneven, so without ``equal_batches`` the ranks get different numbers of samples; with
it, every rank gets the same number of batches and DDP's gradient all-reduce never waits
for a rank that has run out (which would hang until the collective times out).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from cached_client import CachedDataset
from torch.utils.data import DataLoader

if TYPE_CHECKING:  # the spawned ranks import this module: keep it light
    from tests.daemon import ProcessDaemon
    from tests.s3server import S3Server

pytestmark = pytest.mark.slow

WORLD = 4
FAST_WORLD = 3  # FastLoader ranks: one reader each, no DataLoader workers
WORKERS = 2
BATCH = 4
COUNTS = [5, 40, 12, 7, 33, 21, 9]  # uneven: 127 samples
TOTAL = sum(COUNTS)
JOIN_TIMEOUT_S = 100  # a hung collective must fail the test, never hang CI


@dataclass(frozen=True)
class Cluster:
    """Two daemons ("nodes") and the dataset they serve."""

    daemons: tuple[ProcessDaemon, ProcessDaemon]
    pattern: str
    keys: list[str]

    def socket_of(self, rank: int) -> str:
        return self.daemons[rank // 2].socket

    def served(self) -> list[float]:
        """Samples each daemon has served so far."""
        return [d.status()["counters"]["served_samples"] for d in self.daemons]


def start_daemon(directory: Path, endpoint_url: str) -> ProcessDaemon:
    from tests.daemon import ProcessDaemon, serve_config

    return ProcessDaemon(*serve_config(directory, endpoint_url)).start()


@pytest.fixture(scope="module")
def cluster(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from tests.daemon import dataset_shards, isolate_env

    bucket = s3_server.new_bucket("ddp")
    for i, body in enumerate(dataset_shards(len(COUNTS), COUNTS)):
        s3_server.put(bucket, f"train-{i:04d}.tar", body)
    keys = [f"s{s:04d}-{i:05d}" for s, n in enumerate(COUNTS) for i in range(n)]
    dirs = [tmp_path_factory.mktemp("nodeA"), tmp_path_factory.mktemp("nodeB")]
    with pytest.MonkeyPatch.context() as mp:
        # Module scope runs before the autouse env fixture: give the daemons a clean env.
        isolate_env(mp)
        with ThreadPoolExecutor(2) as pool:  # both start at once: seconds each
            a, b = pool.map(lambda d: start_daemon(d, s3_server.endpoint_url), dirs)
    try:
        yield Cluster((a, b), f"s3://{bucket}/train-{{0000..0006}}.tar", keys)
    finally:
        codes = [d.stop() for d in (a, b)]
        assert codes == [0, 0], [d.log.read_text() for d in (a, b)]


# -- what every rank runs (in a spawned process) ----------------------------------------------


@dataclass(frozen=True)
class Job:
    """What the ranks are told (plain values: it is pickled into spawned processes)."""

    pattern: str
    sockets: list[str]  # per rank: its node's daemon
    init_file: str
    out: str
    equal: bool


@contextmanager
def process_group(rank: int, world: int, init_file: str) -> Iterator[None]:
    """This process as ``rank`` of a gloo group of ``world``; a barrier on the way out."""
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _rank_main(rank: int, job: Job) -> None:
    """One training process: read an epoch through this node's daemon; in equal mode, a
    DDP forward/backward per batch. Writes what it saw to ``out/rank{rank}.json``."""
    with process_group(rank, WORLD, job.init_file):
        # rank and world_size come from torch.distributed.
        ds = CachedDataset(
            job.pattern,
            socket=job.sockets[rank],
            shuffle=True,
            seed=17,
            equal_batches=job.equal,
        )
        assert (ds.rank, ds.world_size) == (rank, WORLD)
        ds.set_epoch(1)
        # Forked workers, as under torchrun (a spawned rank would spawn its workers too,
        # each importing torch again: seconds apiece on a small machine).
        loader = DataLoader(
            ds,
            batch_size=BATCH,
            num_workers=WORKERS,
            multiprocessing_context="fork",
            timeout=60,
        )
        keys: list[str] = []
        batches = 0
        result: dict[str, Any] = {"rank": rank}
        if job.equal:
            torch.manual_seed(0)
            model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for batch in loader:
                x = torch.tensor([list(b[:4]) for b in batch["bin"]], dtype=torch.float32)
                loss = model(x / 255).square().mean()
                opt.zero_grad()
                loss.backward()  # all-reduce: waits for every rank's batch
                opt.step()
                batches += 1
                keys.extend(batch["__key__"])
            # Every step was all-reduced: the replicas are still identical.
            result["weights"] = [p.detach().flatten().tolist() for p in model.parameters()]
        else:
            for batch in loader:
                batches += 1
                keys.extend(batch["__key__"])
            everyone: list[Any] = [None] * WORLD
            dist.all_gather_object(everyone, keys)
            result["gathered"] = everyone
        result.update(batches=batches, keys=keys)
        Path(job.out, f"rank{rank}.json").write_text(json.dumps(result))


def _fast_rank_main(rank: int, job: Job) -> None:
    """One training process on the fast path: ``FastLoader(equal_batches=True)`` with rank
    and world size from torch.distributed, a DDP step per batch."""
    from cached_client import FastLoader

    with process_group(rank, FAST_WORLD, job.init_file):
        loader = FastLoader(
            job.pattern,
            batch_size=BATCH,
            exts=["bin"],
            socket=job.sockets[rank],
            shuffle=True,
            seed=17,
            equal_batches=job.equal,
        )
        loader.set_epoch(1)
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        keys: list[str] = []
        digests: dict[str, str] = {}
        batches = 0
        for batch in loader:
            x = batch.view("bin")[:, :4].to(torch.float32)
            loss = model(x / 255).square().mean()
            opt.zero_grad()
            loss.backward()  # all-reduce: waits for every rank's batch
            opt.step()
            batches += 1
            keys.extend(batch.keys)
            data, offs = batch.data["bin"].numpy(), batch.offsets["bin"]
            for i, key in enumerate(batch.keys):
                digests[key] = hashlib.sha256(data[offs[i] : offs[i + 1]]).hexdigest()
        result = {
            "rank": rank,
            "batches": batches,
            "keys": keys,
            "digests": digests,
            "length": len(loader),
            "weights": [p.detach().flatten().tolist() for p in model.parameters()],
        }
        Path(job.out, f"rank{rank}.json").write_text(json.dumps(result))


def run_ranks(
    cluster: Cluster, tmp_path: Path, *, equal: bool, fast: bool = False
) -> list[dict[str, Any]]:
    """Spawn the ranks (4 DataLoader ranks, or 3 FastLoader ranks); fail (after killing
    them) if they do not all finish in time."""
    world = FAST_WORLD if fast else WORLD
    ctx = tmp.start_processes(
        _fast_rank_main if fast else _rank_main,
        args=(
            Job(
                pattern=cluster.pattern,
                sockets=[cluster.socket_of(r) for r in range(world)],
                init_file=str(tmp_path / "init"),
                out=str(tmp_path),
                equal=equal,
            ),
        ),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        # join() raises if a rank failed (with its traceback) and then ends the others.
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"the ranks did not finish within {JOIN_TIMEOUT_S}s (a hang)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(10)
    assert [p.exitcode for p in ctx.processes] == [0] * world
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


# -- the tests -------------------------------------------------------------------------------


def test_ddp_equal_batches(cluster: Cluster, tmp_path: Path) -> None:
    before = cluster.served()
    ranks = run_ranks(cluster, tmp_path, equal=True)
    after = cluster.served()

    each = TOTAL // (WORLD * WORKERS)  # per (rank, worker) reader
    per_worker_batches = -(-each // BATCH)
    assert [r["batches"] for r in ranks] == [WORKERS * per_worker_batches] * WORLD
    assert [len(r["keys"]) for r in ranks] == [WORKERS * each] * WORLD
    # Disjoint across ranks, all distinct, only the remainder left out.
    seen = [k for r in ranks for k in r["keys"]]
    assert len(seen) == len(set(seen)) == TOTAL - TOTAL % (WORLD * WORKERS)
    assert set(seen) <= set(cluster.keys)
    for a in range(WORLD):
        for b in range(a + 1, WORLD):
            assert not set(ranks[a]["keys"]) & set(ranks[b]["keys"])
    # Every optimizer step was all-reduced over all 4 ranks: identical replicas.
    assert all(r["weights"] == ranks[0]["weights"] for r in ranks)
    # Ranks 0,1 read through daemon A and ranks 2,3 through daemon B, nothing else.
    served = [after[i] - before[i] for i in range(2)]
    assert served == [
        len(ranks[0]["keys"]) + len(ranks[1]["keys"]),
        len(ranks[2]["keys"]) + len(ranks[3]["keys"]),
    ]


def test_ddp_default_mode_exactly_once(cluster: Cluster, tmp_path: Path) -> None:
    ranks = run_ranks(cluster, tmp_path, equal=False)

    # Every rank gathered the same lists, and their union is the dataset, once each.
    gathered = ranks[0]["gathered"]
    assert all(r["gathered"] == gathered for r in ranks)
    assert [r["keys"] for r in ranks] == gathered
    assert Counter(k for keys in gathered for k in keys) == Counter(cluster.keys)
    # Whole shards per reader: with these uneven shards the ranks get unequal numbers of
    # samples and batches. A DDP step per batch would leave the longest ranks waiting
    # in the all-reduce; that is what equal_batches (the test above) prevents.
    counts = [len(r["keys"]) for r in ranks]
    assert len(set(counts)) > 1, counts
    assert len({r["batches"] for r in ranks}) > 1
    assert sum(counts) == TOTAL


def test_ddp_fast_loader_equal_batches(cluster: Cluster, tmp_path: Path) -> None:
    """3 FastLoader ranks over uneven shards: equal batch counts, DDP steps in lockstep,
    every sample intact and read once, only the remainder (< 3 samples) left out."""
    from tests.daemon import dataset_shards

    ranks = run_ranks(cluster, tmp_path, equal=True, fast=True)

    each = TOTAL // FAST_WORLD
    batches = -(-each // BATCH)
    assert [r["batches"] for r in ranks] == [batches] * FAST_WORLD
    assert [r["length"] for r in ranks] == [batches] * FAST_WORLD  # len(loader) agrees
    assert [len(r["keys"]) for r in ranks] == [each] * FAST_WORLD
    seen = [k for r in ranks for k in r["keys"]]
    assert len(seen) == len(set(seen)) == TOTAL - TOTAL % FAST_WORLD
    assert all(r["weights"] == ranks[0]["weights"] for r in ranks)
    # Content: every member's bytes as written.
    shards = dataset_shards(len(COUNTS), COUNTS)
    expected = {
        key: hashlib.sha256(body).hexdigest() for shard in shards for key, body in _bins(shard)
    }
    for r in ranks:
        assert r["digests"].keys() == set(r["keys"])  # every sample it read was checked
        assert all(expected[k] == d for k, d in r["digests"].items())


def test_ddp_fast_loader_uneven_without_equal_batches(cluster: Cluster, tmp_path: Path) -> None:
    """The failure equal_batches prevents: whole shards per rank give unequal counts."""
    counts = []
    for rank in range(FAST_WORLD):
        from cached_client import FastLoader

        loader = FastLoader(
            cluster.pattern,
            batch_size=BATCH,
            exts=["bin"],
            socket=cluster.socket_of(rank),
            shuffle=True,
            seed=17,
            rank=rank,
            world_size=FAST_WORLD,
        )
        loader.set_epoch(1)
        counts.append(sum(len(b) for b in loader))
    assert sum(counts) == TOTAL
    assert len(set(counts)) > 1, counts


def _bins(shard: bytes) -> Iterator[tuple[str, bytes]]:
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(shard)) as tar:
        for member in tar:
            if member.name.endswith(".bin"):
                fh = tar.extractfile(member)
                assert fh is not None
                yield member.name.split(".")[0], fh.read()
