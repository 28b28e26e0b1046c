"""Elastic resume through the real loaders and a real daemon: states saved by a job of
2 nodes x 2 ranks (``placement="node"``), merged with ``elastic_state``, resumed by a job
of 3 nodes x 1 rank. The rest of the saved epoch is read exactly once by the new ranks,
a resumed share resumes exactly, and the next epoch follows the new job's own placement.

One ``cached serve`` stands in for every node (placement is arithmetic; which daemon
serves a node changes no sample), the ranks run one after another in this process.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from cached_client import CachedDataset, FastLoader, UsageError
from cached_client.elastic import elastic_state
from cached_client.placement import epoch_owners, equal_share, owners
from torchdata.stateful_dataloader import StatefulDataLoader

from tests.daemon import ProcessDaemon, dataset_shards, isolate_env, serve_config
from tests.s3server import S3Server

pytestmark = [pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")]

COUNTS = [9, 14, 5, 11, 8, 13, 6, 10, 12, 7, 9, 4]  # 108 samples over 12 shards
KEYS = [f"e{s:04d}-{i:05d}" for s, n in enumerate(COUNTS) for i in range(n)]


@pytest.fixture(scope="module")
def pattern_and_socket(
    s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    bucket = s3_server.new_bucket("elastic")
    for i, body in enumerate(dataset_shards(len(COUNTS), COUNTS, payload=64, prefix="e")):
        s3_server.put(bucket, f"el-{i:04d}.tar", body)
    with pytest.MonkeyPatch.context() as mp:
        isolate_env(mp)  # module scope runs before the autouse env fixture
        config, socket = serve_config(tmp_path_factory.mktemp("elastic"), s3_server.endpoint_url)
        daemon = ProcessDaemon(config, socket).start()
    try:
        yield f"s3://{bucket}/el-{{0000..0011}}.tar", socket
    finally:
        assert daemon.stop() == 0, daemon.log_tail()


def fast(where: tuple[str, str], rank: int, world: int, local: int, **kw: Any) -> FastLoader:
    pattern, socket = where
    return FastLoader(
        pattern,
        batch_size=3,
        socket=socket,
        shuffle=True,
        seed=9,
        rank=rank,
        world_size=world,
        placement="node",
        local_world_size=local,
        **kw,
    )


@pytest.mark.parametrize("equal", [False, True], ids=["default", "equal_batches"])
def test_fast_loader_saved_on_two_nodes_finishes_on_three(
    pattern_and_socket: tuple[str, str], equal: bool
) -> None:
    # The old job: 2 nodes x 2 ranks, each stopped after a different number of batches.
    states, head = [], []
    for rank, stop in zip(range(4), [0, 1, 2, 99], strict=True):
        loader = fast(pattern_and_socket, rank, 4, 2, equal_batches=equal)
        loader.set_epoch(2)
        it = iter(loader)
        for _ in range(stop):
            batch = next(it, None)
            if batch is None:
                break
            head += batch.keys
        states.append(json.loads(json.dumps(loader.state_dict())))
        del it
    merged = json.loads(json.dumps(elastic_state(states)))

    # A single rank's state still resumes only that rank.
    with pytest.raises(UsageError, match=r"world_size: saved 4, here 3.*elastic_state"):
        fast(pattern_and_socket, 0, 3, 1, equal_batches=equal).load_state_dict(states[0])

    # The new job: 3 nodes x 1 rank. Rank 1 stops part-way and resumes from its own state.
    tail: list[list[str]] = []
    for rank in range(3):
        loader = fast(pattern_and_socket, rank, 3, 1, equal_batches=equal)
        loader.load_state_dict(merged)
        assert loader.epoch == 2 and loader.state_dict() == merged  # not started yet
        keys: list[str] = []
        it = iter(loader)
        if rank == 1:
            keys += next(it).keys
            saved = loader.state_dict()
            del it
            loader = fast(pattern_and_socket, rank, 3, 1, equal_batches=equal)
            loader.load_state_dict(saved)
            it = iter(loader)
        keys += [k for batch in it for k in batch.keys]
        tail.append(keys)
    seen = Counter(head + [k for t in tail for k in t])
    assert max(seen.values()) == 1  # nothing twice
    if equal:
        assert len({len(t) for t in tail}) == 1  # the rest cut equally
        # Left out: the old job's equal-batches trim, and under 3 of the rest.
        each = equal_share(owners(len(COUNTS), 2, 9, COUNTS), COUNTS, 2, 2)
        assert 0 <= len(KEYS) - len(seen) - (len(KEYS) - 4 * each) < 3
    else:
        assert set(seen) == set(KEYS)  # everything once
        # Each new node reads the rest of the shards it owns in the new job (rank = node
        # here), so what it reads now is what it caches from the next epoch on.
        mine = owned(3, 2)
        strays = [sorted({shard(k) for k in tail[node]} - set(mine[node])) for node in range(3)]
        assert strays == [[], [], []]  # other nodes' shards each new node read

    # Epoch 3 on the new job: every sample once, each node its own shards.
    nxt = []
    for rank in range(3):
        loader = fast(pattern_and_socket, rank, 3, 1, equal_batches=equal)
        loader.set_epoch(3)
        nxt.append([k for batch in loader for k in batch.keys])
    flat = [k for keys in nxt for k in keys]
    assert len(flat) == len(set(flat))
    if not equal:
        assert sorted(flat) == sorted(KEYS)
        assert [sorted({shard(k) for k in keys}) for keys in nxt] == owned(3, 3)


def test_cached_dataset_from_dataloader_workers_to_another_shape(
    pattern_and_socket: tuple[str, str],
) -> None:
    """StatefulDataLoader states (2 nodes of one rank x 2 workers) merged and resumed by
    3 nodes of one rank, on plain DataLoaders."""
    from torch.utils.data import DataLoader

    pattern, socket = pattern_and_socket

    def dataset(rank: int, world: int) -> CachedDataset:
        return CachedDataset(
            pattern,
            socket=socket,
            shuffle=True,
            seed=9,
            shuffle_buffer=8,
            rank=rank,
            world_size=world,
            placement="node",
            local_world_size=1,
        )

    states, head = [], []
    for rank, stop in ((0, 3), (1, 5)):
        ds = dataset(rank, 2)
        ds.set_epoch(1)
        loader = StatefulDataLoader(ds, batch_size=2, num_workers=2, collate_fn=_keys, timeout=30)
        it = iter(loader)
        for _ in range(stop):
            head += next(it)
        states.append(loader.state_dict())
        del it, loader
    merged = elastic_state(states)
    assert len(merged["readers"]) == 4

    tail = []
    for rank in range(3):  # 3 nodes of one rank; rank 1 in a DataLoader worker
        ds = dataset(rank, 3)
        ds.load_state_dict(merged)
        assert ds.epoch == 1
        workers = 1 if rank == 1 else 0
        loader = DataLoader(
            ds, batch_size=2, num_workers=workers, collate_fn=_keys, timeout=30 * workers
        )
        tail += [k for batch in loader for k in batch]
    seen = Counter(head + tail)
    assert max(seen.values()) == 1 and set(seen) == set(KEYS)


def shard(key: str) -> int:
    """The shard a sample's key names (``e{shard}-{i}``)."""
    return int(key[1:].partition("-")[0])


def owned(nodes: int, epoch: int) -> list[list[int]]:
    """The shards each of ``nodes`` nodes owns in ``epoch`` (seed 9, no mix)."""
    owner = epoch_owners(len(COUNTS), nodes, 9, epoch)
    return [[s for s in range(len(COUNTS)) if owner[s] == node] for node in range(nodes)]


def _keys(samples: list[dict[str, Any]]) -> list[str]:
    return [s["__key__"] for s in samples]
