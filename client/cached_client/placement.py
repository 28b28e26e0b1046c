"""Which node reads which shard: ``placement="global"`` spreads every epoch's shards over
all readers; ``placement="node"`` gives each node a fixed set of shards, so that a shard
stays on the node whose daemon caches it (docs/placement.md).

Pure arithmetic, like :mod:`.partition`: every process computes the same ownership from
(seed, node count) and the same epoch plan from (seed, epoch, node), so no coordination
is needed. Node ``n`` holds ranks ``n * local_world_size ..`` (torchrun's numbering);
each rank's DataLoader workers are its readers.
"""

from __future__ import annotations

import heapq
import os
import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .errors import UsageError
from .partition import Part, by_sample, by_shard, reader_parts

PLACEMENTS = ("global", "node")


@dataclass(frozen=True)
class Reader:
    """One reader's place in the job: DataLoader worker ``worker`` of ``workers`` in rank
    ``rank`` of ``world_size``; with ``placement="node"``, ranks come ``local_world_size``
    to a node."""

    rank: int
    world_size: int
    worker: int = 0
    workers: int = 1
    placement: str = "global"
    local_world_size: int = 1
    mix: float = 0.0

    @property
    def stream(self) -> int:
        """This reader's index among all readers of the job."""
        return self.rank * self.workers + self.worker

    @property
    def streams(self) -> int:
        return self.world_size * self.workers

    @property
    def node(self) -> int:
        return self.rank // self.local_world_size

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def local_stream(self) -> int:
        """This reader's index among its node's readers."""
        return (self.rank % self.local_world_size) * self.workers + self.worker

    @property
    def local_streams(self) -> int:
        return self.local_world_size * self.workers


def check_placement(placement: str, mix: float) -> None:
    """Raise :class:`UsageError` unless ``placement`` and ``placement_mix`` make sense."""
    if placement not in PLACEMENTS:
        raise UsageError(f"placement must be 'global' or 'node', not {placement!r}")
    if not 0.0 <= mix <= 1.0:
        raise UsageError(f"placement_mix must be between 0 and 1, not {mix!r}")
    if mix and placement != "node":
        raise UsageError("placement_mix moves shards between nodes: it needs placement='node'")


def resolve_local_world_size(
    rank: int,
    world_size: int,
    *,
    node: int | None = None,
    local_world_size: int | None = None,
    env: Mapping[str, str] | None = None,
) -> int:
    """Ranks per node, for ``placement="node"``: ``local_world_size`` if given, else
    torchrun's ``LOCAL_WORLD_SIZE``; 1 for a job of one rank.

    The node is then ``rank // local_world_size``; ``node`` (else ``GROUP_RANK``) and
    ``LOCAL_RANK`` (else ``rank % local_world_size``) are checked against it. Raises
    :class:`UsageError` when they cannot all hold: the node would read another node's
    shards, or two readers the same ones."""
    env = os.environ if env is None else env
    if local_world_size is None:
        found = env.get("LOCAL_WORLD_SIZE")
        if found is None:
            if world_size == 1:
                return 1
            raise UsageError(
                "placement='node' needs the number of ranks per node: run under torchrun "
                "(which sets LOCAL_WORLD_SIZE and GROUP_RANK) or pass local_world_size="
            )
        local_world_size = _int(found, "LOCAL_WORLD_SIZE")
    if local_world_size < 1 or world_size % local_world_size:
        raise UsageError(
            f"world_size {world_size} is not a whole number of nodes of {local_world_size} "
            "ranks (local_world_size): placement='node' needs the same ranks on every node"
        )
    nodes = world_size // local_world_size
    if node is None and "GROUP_RANK" in env:
        node = _int(env["GROUP_RANK"], "GROUP_RANK")
    local_rank = _int(env["LOCAL_RANK"], "LOCAL_RANK") if "LOCAL_RANK" in env else None
    if node is not None and not 0 <= node < nodes:
        raise UsageError(f"node {node} is not in 0..{nodes - 1} ({nodes} nodes)")
    if local_rank is not None and not 0 <= local_rank < local_world_size:
        raise UsageError(f"LOCAL_RANK {local_rank} is not in 0..{local_world_size - 1}")
    if node is not None:
        local = rank % local_world_size if local_rank is None else local_rank
        if node * local_world_size + local != rank:
            raise UsageError(
                f"rank {rank} is not rank {local} of node {node} with {local_world_size} "
                "ranks per node: placement='node' needs ranks numbered node by node "
                "(rank = node * local_world_size + local rank, as torchrun does)"
            )
    elif local_rank is not None and rank % local_world_size != local_rank:
        raise UsageError(
            f"rank {rank} with LOCAL_RANK {local_rank} and {local_world_size} ranks per node: "
            "placement='node' needs ranks numbered node by node (as torchrun does)"
        )
    return local_world_size


def _int(value: str, name: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"${name} is {value!r}, not a number") from None


# I73: a node's shards are fixed by seed and node count.
def owners(n_shards: int, nodes: int, seed: int, lengths: Sequence[int] | None = None) -> list[int]:
    """The node that owns each shard, the same in every epoch: a permutation fixed by
    (seed, nodes) dealt round-robin (node shard counts differ by at most one); with
    ``lengths``, the biggest shard first to the node with the fewest samples so far
    (node sample counts differ by at most the biggest shard)."""
    order = list(range(n_shards))
    random.Random(f"owners/{seed}/{nodes}").shuffle(order)
    owner = [0] * n_shards
    if lengths is None:
        for i, shard in enumerate(order):
            owner[shard] = i % nodes
        return owner
    loads = [(0, 0, node) for node in range(nodes)]  # (samples, shards, node): a heap
    for shard in sorted(order, key=lambda s: -lengths[s]):  # stable: ties in seeded order
        samples, count, node = heapq.heappop(loads)
        owner[shard] = node
        heapq.heappush(loads, (samples + lengths[shard], count + 1, node))
    return owner


def epoch_owners(
    n_shards: int,
    nodes: int,
    seed: int,
    epoch: int,
    *,
    mix: float = 0.0,
    lengths: Sequence[int] | None = None,
) -> list[int]:
    """The owners in ``epoch``: :func:`owners`, with ``round(mix * n_shards)`` shards
    (chosen by (seed, epoch)) handed between nodes. The chosen shards, grouped by owner,
    take the owner of the shard a biggest group further on: each node keeps its number of
    shards, and every chosen shard changes node unless one node holds more than half of
    them."""
    owner = owners(n_shards, nodes, seed, lengths)
    moved = round(mix * n_shards)
    if nodes < 2 or moved < 2:
        return owner
    chosen = random.Random(f"mix/{seed}/{nodes}/{epoch}").sample(range(n_shards), moved)
    chosen.sort(key=lambda s: owner[s])  # stable: in random order within a node
    shift = max(Counter(owner[s] for s in chosen).values())
    mixed = list(owner)
    for i, shard in enumerate(chosen):
        mixed[shard] = owner[chosen[(i + shift) % moved]]
    return mixed


def node_order(
    owner: Sequence[int], node: int, *, shuffle: bool, seed: int, epoch: int
) -> list[int]:
    """The shards ``node`` reads in ``epoch``, in order: shuffled by (seed, epoch, node)."""
    mine = [shard for shard, n in enumerate(owner) if n == node]
    if shuffle:
        random.Random(f"node-shards/{seed}/{epoch}/{node}").shuffle(mine)
    return mine


def equal_share(
    owner: Sequence[int], lengths: Sequence[int], nodes: int, local_streams: int
) -> int:
    """Samples per reader with ``equal_batches``: the same for every reader of the job, so
    the node with the fewest samples per reader sets it (the other nodes leave the tail of
    their epoch order out)."""
    per_node = [0] * nodes
    for shard, n in enumerate(lengths):
        per_node[owner[shard]] += n
    each = min(per_node) // local_streams
    if each == 0 and any(per_node):
        poorest = per_node.index(min(per_node))
        raise UsageError(
            f"equal_batches with placement='node': node {poorest} owns {per_node[poorest]} "
            f"samples for its {local_streams} readers, so every reader would get none; "
            "use fewer DataLoader workers, more shards, or placement='global'"
        )
    return each


def plan(
    n_shards: int,
    reader: Reader,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
    lengths: Callable[[], Sequence[int]] | None = None,
) -> list[Part]:
    """What ``reader`` reads in ``epoch``. ``"global"``: :func:`partition.reader_parts`.
    ``"node"``: its node's shards (:func:`epoch_owners`, :func:`node_order`) split over the
    node's readers, whole shards round-robin, or with ``lengths`` (asked for only here)
    :func:`equal_share` samples each. Either way every shard's samples are read exactly
    once per epoch across the job (less the equal-batches trim)."""
    if reader.placement == "global":
        return reader_parts(
            n_shards,
            shuffle=shuffle,
            seed=seed,
            epoch=epoch,
            stream=reader.stream,
            streams=reader.streams,
            lengths=lengths,
        )
    counts = lengths() if lengths is not None else None
    owner = epoch_owners(n_shards, reader.nodes, seed, epoch, mix=reader.mix, lengths=counts)
    order = node_order(owner, reader.node, shuffle=shuffle, seed=seed, epoch=epoch)
    if counts is None:
        return by_shard(order, reader.local_stream, reader.local_streams)
    each = equal_share(owner, counts, reader.nodes, reader.local_streams)
    return by_sample(order, counts, reader.local_stream, reader.local_streams, each=each)
