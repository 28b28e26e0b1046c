"""Node-aware placement and elastic resume: the arithmetic, no daemon.

Who reads what must hold for every shape of job: each sample read exactly once per epoch
across nodes x ranks x DataLoader workers, a node's shards the same in every epoch, and
the rest of an epoch saved on N nodes read exactly once on M.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from cached_client import UsageError
from cached_client.elastic import elastic_state, rest, share
from cached_client.partition import Part
from cached_client.placement import (
    Reader,
    epoch_owners,
    owners,
    plan,
    resolve_local_world_size,
)

SEED = 11


def readers(
    nodes: int, local: int, workers: int, placement: str = "node", mix: float = 0.0
) -> list[Reader]:
    world = nodes * local
    return [
        Reader(rank, world, worker, workers, placement, local, mix)
        for rank in range(world)
        for worker in range(workers)
    ]


def samples(parts: Sequence[Part], lengths: Sequence[int]) -> Iterator[tuple[int, int]]:
    for p in parts:
        stop = lengths[p.shard] if p.stop is None else p.stop
        for i in range(p.start, stop):
            yield p.shard, i


def uneven(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 60) for _ in range(n)]


def epoch_plans(
    rs: Sequence[Reader], lengths: list[int], epoch: int, equal: bool, shuffle: bool = True
) -> list[list[Part]]:
    return [
        plan(
            len(lengths),
            r,
            shuffle=shuffle,
            seed=SEED,
            epoch=epoch,
            lengths=(lambda: lengths) if equal else None,
        )
        for r in rs
    ]


SHAPES = [  # (nodes, ranks per node, workers per rank, shards)
    (3, 2, 2, 40),
    (2, 8, 1, 64),
    (4, 2, 3, 7),  # fewer shards than readers: some read nothing
    (3, 1, 1, 2),  # fewer shards than nodes
    (1, 4, 2, 13),
    (5, 3, 2, 101),
]


@pytest.mark.parametrize(("nodes", "local", "workers", "n"), SHAPES)
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_sample_once_per_epoch_across_nodes_ranks_and_workers(
    nodes: int, local: int, workers: int, n: int, shuffle: bool
) -> None:
    lengths = uneven(n, n)
    rs = readers(nodes, local, workers)
    everything = Counter((s, i) for s in range(n) for i in range(lengths[s]))
    for epoch in range(4):
        plans = epoch_plans(rs, lengths, epoch, equal=False, shuffle=shuffle)
        assert Counter(x for p in plans for x in samples(p, lengths)) == everything
        assert all(p.start == 0 and p.stop is None for parts in plans for p in parts)


@pytest.mark.parametrize(("nodes", "local", "workers", "n"), SHAPES)
def test_a_node_reads_the_same_shards_every_epoch_in_another_order(
    nodes: int, local: int, workers: int, n: int
) -> None:
    lengths = uneven(n, 1)
    rs = readers(nodes, local, workers)

    def per_node(epoch: int) -> list[list[int]]:
        plans = epoch_plans(rs, lengths, epoch, equal=False)
        out: list[list[int]] = [[] for _ in range(nodes)]
        for r, parts in zip(rs, plans, strict=True):
            out[r.node] += [p.shard for p in parts]
        return out

    first = per_node(0)
    for epoch in (1, 2, 5):
        now = per_node(epoch)
        assert [sorted(x) for x in now] == [sorted(x) for x in first]
    # The order within a node moves with the epoch (where there is an order to move).
    big = [i for i in range(nodes) if len(first[i]) >= 5]
    assert all(per_node(1)[i] != first[i] for i in big)
    # Under "global", the same shard lands on another node in some epoch.
    g = readers(nodes, local, workers, "global")
    if nodes > 1 and n >= nodes * 4:
        homes = [
            {
                s: r.node
                for r, ps in zip(g, epoch_plans(g, lengths, e, False), strict=True)
                for s in (p.shard for p in ps)
            }
            for e in range(3)
        ]
        assert any(homes[0][s] != homes[1][s] for s in range(n))


def test_ownership_is_balanced_and_fixed_by_seed_and_node_count() -> None:
    for n, nodes in [(100, 3), (7, 4), (64, 8), (2, 3), (1000, 7)]:
        owner = owners(n, nodes, SEED)
        counts = Counter(owner)
        assert max(counts.values(), default=0) - min(counts.get(k, 0) for k in range(nodes)) <= 1
        assert owner == owners(n, nodes, SEED)
        assert n < 8 or owner != owners(n, nodes, SEED + 1)
        # By samples when the lengths are known: within one (the biggest) shard.
        lengths = uneven(n, n)
        by = owners(n, nodes, SEED, lengths)
        load = [sum(lengths[s] for s in range(n) if by[s] == k) for k in range(nodes)]
        if n >= nodes:
            assert max(load) - min(load) <= max(lengths)
    # One big shard and many small ones: the small ones go to the other node.
    lopsided = owners(41, 2, SEED, [40] + [1] * 40)
    assert sorted(Counter(lopsided).values()) == [1, 40]  # not by count ...
    weight: Counter[int] = Counter()
    for shard, node in enumerate(lopsided):
        weight[node] += 40 if shard == 0 else 1
    assert abs(weight[0] - weight[1]) <= 1  # ... by samples


@pytest.mark.parametrize(("nodes", "local", "workers", "n"), [*SHAPES[:3], SHAPES[4], SHAPES[5]])
def test_equal_batches_is_the_same_count_for_every_reader_of_the_job(
    nodes: int, local: int, workers: int, n: int
) -> None:
    lengths = uneven(n, 7)
    rs = readers(nodes, local, workers)
    owner = owners(n, nodes, SEED, lengths)
    per_node = [sum(lengths[s] for s in range(n) if owner[s] == k) for k in range(nodes)]
    each = min(per_node) // (local * workers)  # the trim is global: the poorest node sets it
    for epoch in range(3):
        plans = epoch_plans(rs, lengths, epoch, equal=True)
        got = [list(samples(p, lengths)) for p in plans]
        assert [len(g) for g in got] == [each] * len(rs)
        flat = [x for g in got for x in g]
        assert len(flat) == len(set(flat))
        # Each reader reads only its own node's shards.
        assert all(owner[s] == r.node for r, g in zip(rs, got, strict=True) for s, _ in g)
    # What is left out: under a node's share of the biggest shard plus its readers.
    assert sum(lengths) - each * len(rs) <= nodes * (max(lengths) + local * workers)


def test_equal_batches_with_a_node_that_owns_nothing_says_so() -> None:
    with pytest.raises(UsageError, match="node 2 owns 0 samples"):
        epoch_plans(readers(3, 1, 1), [5, 9], 0, equal=True)


@pytest.mark.parametrize("mix", [0.05, 0.1, 0.3])
def test_mix_moves_about_that_fraction_of_shards_each_epoch(mix: float) -> None:
    n, nodes = 400, 4
    base = owners(n, nodes, SEED)
    moved_sets = []
    for epoch in range(6):
        now = epoch_owners(n, nodes, SEED, epoch, mix=mix)
        moved = {s for s in range(n) if now[s] != base[s]}
        assert abs(len(moved) - mix * n) <= 0.02 * n, (epoch, len(moved))
        assert Counter(now) == Counter(base)  # each node keeps its number of shards
        assert now == epoch_owners(n, nodes, SEED, epoch, mix=mix)  # fixed by (seed, epoch)
        moved_sets.append(moved)
    assert len({frozenset(m) for m in moved_sets}) == 6  # other shards every epoch
    # And every sample is still read once.
    lengths = uneven(n, 3)
    rs = readers(nodes, 2, 2, mix=mix)
    plans = epoch_plans(rs, lengths, 1, equal=False)
    want = Counter((s, i) for s in range(n) for i in range(lengths[s]))
    assert Counter(x for p in plans for x in samples(p, lengths)) == want


# -- elastic: N nodes -> M nodes ---------------------------------------------------------


def saved_states(
    rs: Sequence[Reader],
    lengths: list[int],
    epoch: int,
    equal: bool,
    *,
    rng: random.Random,
    loader: str = "CachedDataset",
) -> tuple[list[dict[str, Any]], set[tuple[int, int]]]:
    """Every reader stopped part-way (some at the start, some at the end), holding some
    samples in its shuffle buffer; returns the states and the samples given out."""
    given: set[tuple[int, int]] = set()
    states = []
    plans = epoch_plans(rs, lengths, epoch, equal)
    for r, parts in zip(rs, plans, strict=True):
        flat = [
            (k, off)
            for k, p in enumerate(parts)
            for off in range((lengths[p.shard] if p.stop is None else p.stop) - p.start)
        ]
        cut = rng.choice([0, len(flat), rng.randint(0, len(flat))])
        before = flat[:cut]
        buffer = rng.sample(before, min(len(before), rng.randint(0, 6)))
        for k, off in before:
            if (k, off) not in buffer:
                given.add((parts[k].shard, parts[k].start + off))
        part, offset = flat[cut] if cut < len(flat) else (len(parts), 0)
        states.append(
            {
                "loader": loader,
                "version": 2,
                "shards": len(lengths),
                "urls": "u",
                "world_size": r.world_size,
                "rank": r.rank,
                "workers": r.workers,
                "worker": r.worker,
                "shuffle": True,
                "seed": SEED,
                "equal_batches": equal,
                "placement": r.placement,
                "local_world_size": r.local_world_size if r.placement == "node" else None,
                "placement_mix": r.mix,
                "epoch": epoch,
                "parts": len(parts),
                "part": part,
                "offset": offset,
                "buffer": [list(b) for b in buffer],
                "lengths": None,
            }
        )
    return states, given


ELASTIC = [  # (old nodes, local, workers, placement) -> (new ...)
    ((3, 2, 2, "node"), (2, 2, 2, "node")),
    ((2, 4, 1, "node"), (5, 1, 3, "node")),
    ((4, 2, 2, "node"), (1, 8, 2, "global")),
    ((1, 4, 2, "global"), (3, 2, 1, "node")),
    ((2, 2, 1, "node"), (2, 2, 1, "node")),  # the same shape
]


@pytest.mark.parametrize(("old", "new"), ELASTIC)
@pytest.mark.parametrize("equal", [False, True], ids=["default", "equal_batches"])
def test_an_epoch_saved_on_n_nodes_finishes_exactly_once_on_m(
    old: tuple[int, int, int, str], new: tuple[int, int, int, str], equal: bool
) -> None:
    n = 53
    lengths = uneven(n, 5)
    for trial in range(5):
        rng = random.Random(trial)
        states, given = saved_states(readers(*old), lengths, 3, equal, rng=rng)
        rng.shuffle(states)  # any order; nested as a StatefulDataLoader would nest them
        merged = elastic_state([{"_snapshot": {"worker_0": {"dataset_state": s}}} for s in states])
        runs = rest(merged, n, lengths if equal else None)
        news = readers(*new)
        shares = [
            share(runs, r, n_shards=n, seed=SEED, epoch=3, lengths=lengths if equal else None)
            for r in news
        ]
        got = [list(samples(s, lengths)) for s in shares]
        flat = [x for g in got for x in g]
        assert len(flat) == len(set(flat))
        assert not set(flat) & given  # nothing read twice
        left = {(s, i) for s in range(n) for i in range(lengths[s])} - given
        if equal:
            # The old readers' equal-batches trim stays out; the rest is cut equally.
            old_plans = epoch_plans(readers(*old), lengths, 3, True)
            planned = {x for p in old_plans for x in samples(p, lengths)}
            left &= planned
            assert len({len(g) for g in got}) == 1
            assert len(left) - len(flat) < len(news)
            assert set(flat) <= left
        else:
            assert set(flat) == left
        if not equal and new[3] == "node":  # a node reads what it owns from now on
            owner = epoch_owners(n, new[0], SEED, 3)
            assert all(owner[s] == r.node for r, g in zip(news, got, strict=True) for s, _ in g)


def test_elastic_state_wants_every_reader_of_one_job_in_one_epoch() -> None:
    lengths = uneven(20)
    states, _ = saved_states(readers(2, 2, 2), lengths, 1, False, rng=random.Random(0))
    with pytest.raises(UsageError, match=r"1 of the job's 8 readers have no state \(rank 3"):
        elastic_state(states[:-1])
    other = dict(states[0], seed=12)
    with pytest.raises(UsageError, match="different jobs: seed"):
        elastic_state([*states[1:], other])
    with pytest.raises(UsageError, match="no loader state"):
        elastic_state([{"x": 1}])
    # A reader that finished epoch 0 and has not begun epoch 1: all its share is left.
    done = dict(states[0], epoch=0, part=states[0]["parts"], offset=0, buffer=[])
    merged = elastic_state([done, *states[1:]])
    assert merged["epoch"] == 1 and merged["readers"][0]["part"] == 0
    with pytest.raises(UsageError, match="part-way through epoch 0"):
        elastic_state([dict(states[0], epoch=0, part=0), *states[1:]])


def test_the_node_comes_from_torchruns_variables() -> None:
    env = {"LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "LOCAL_RANK": "2"}
    assert resolve_local_world_size(6, 8, env=env) == 4
    assert resolve_local_world_size(6, 8, local_world_size=2, node=3, env={}) == 2
    assert resolve_local_world_size(0, 1, env={}) == 1
    with pytest.raises(UsageError, match="LOCAL_WORLD_SIZE"):
        resolve_local_world_size(0, 2, env={})
    with pytest.raises(UsageError, match="not a whole number of nodes"):
        resolve_local_world_size(0, 6, env={"LOCAL_WORLD_SIZE": "4"})
    with pytest.raises(UsageError, match="rank 5 is not rank 2 of node 1"):
        resolve_local_world_size(5, 8, env=env)
    with pytest.raises(UsageError, match=r"node 2 is not in 0\.\.1"):
        resolve_local_world_size(6, 8, env={**env, "GROUP_RANK": "2"})
    with pytest.raises(UsageError, match="LOCAL_RANK 3"):
        resolve_local_world_size(6, 8, env={"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "3"})
    # An explicit node wins over GROUP_RANK (and is checked all the same).
    assert resolve_local_world_size(2, 8, node=0, env={**env, "LOCAL_RANK": "2"}) == 4
