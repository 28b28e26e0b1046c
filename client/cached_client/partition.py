"""Who reads what: the epoch's shard order and its split over ranks and DataLoader workers.

Pure functions of (seed, epoch, rank, world size, worker, workers): every process computes
the same global plan and takes its own part, so no coordination is needed.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from .errors import UsageError

T = TypeVar("T")


@dataclass(frozen=True)
class Part:
    """Samples ``start..stop`` of shard ``shard`` (an index into the URL list)."""

    shard: int
    start: int
    stop: int | None  # None: to the end of the shard


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit values, else ``torch.distributed`` when initialized, else ``RANK`` and
    ``WORLD_SIZE``, else 0 of 1. Raises ``UsageError`` (a ``ValueError``) on an impossible pair."""
    if rank is None or world_size is None:
        found = _from_distributed() or (
            int(os.environ.get("RANK", "0")),
            int(os.environ.get("WORLD_SIZE", "1")),
        )
        rank = found[0] if rank is None else rank
        world_size = found[1] if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise UsageError(f"rank {rank} is not in 0..{world_size - 1} (world_size {world_size})")
    return rank, world_size


def _from_distributed() -> tuple[int, int] | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def shard_order(n_shards: int, *, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The epoch's shard order: natural, or a permutation fixed by (seed, epoch)."""
    order = list(range(n_shards))
    if shuffle:
        random.Random(f"shards/{seed}/{epoch}").shuffle(order)
    return order


# I71: each sample once per epoch across every reader.
def reader_parts(
    n_shards: int,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
    stream: int,
    streams: int,
    lengths: Callable[[], Sequence[int]] | None = None,
) -> list[Part]:
    """What reader ``stream`` of ``streams`` reads in ``epoch``: whole shards round-robin
    (:func:`by_shard`), or with ``lengths`` (the shards' sample counts, asked for only
    here) an equal share of the samples (:func:`by_sample`). Both loaders split this way."""
    order = shard_order(n_shards, shuffle=shuffle, seed=seed, epoch=epoch)
    if lengths is None:
        return by_shard(order, stream, streams)
    return by_sample(order, lengths(), stream, streams)


def by_shard(order: Sequence[int], stream: int, streams: int) -> list[Part]:
    """Round-robin of whole shards over ``streams`` readers: each shard read once, whole.

    Readers may end up with different numbers of samples (uneven shards)."""
    return [Part(shard, 0, None) for shard in order[stream::streams]]


# I72: every reader gets batches of equal count.
def by_sample(
    order: Sequence[int],
    lengths: Sequence[int],
    stream: int,
    streams: int,
    *,
    each: int | None = None,
) -> list[Part]:
    """Equal parts: the epoch's samples, laid end to end in shard order, cut into ``streams``
    contiguous runs of exactly ``total // streams`` samples (or ``each``, at most that).
    The last ``total % streams`` samples of the epoch are left out (fewer than ``streams``;
    which ones moves with the shuffled order). Contiguous runs keep each shard with one or
    two readers."""
    total = sum(lengths[s] for s in order)
    if each is None:
        each = total // streams
    elif each * streams > total:
        raise UsageError(f"{streams} readers of {each} samples need more than {total}")
    lo, hi = stream * each, (stream + 1) * each
    parts: list[Part] = []
    pos = 0
    for shard in order:
        n = lengths[shard]
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            parts.append(Part(shard, a - pos, b - pos))
        pos += n
        if pos >= hi:
            break
    return parts


def buffered_shuffle(
    items: Iterable[T],
    size: int,
    rng: random.Random,
    initial: int = 100,
    early: Callable[[], bool] | None = None,
) -> Iterator[T]:
    """Shuffle a stream within a buffer of at most ``size`` items (memory stays bounded).

    Starts once ``min(initial, size)`` items are in, or earlier once ``early()`` is true
    (a reader: its first shard is all in, and waiting for more would wait for another
    download). At the start it gives out half of what it holds at once, then takes two
    items in per item out until it holds ``size``: every item is drawn from at least half
    of what has come in, and a cold epoch's first batch needs only the first shard (or
    ``initial`` items), not a full buffer. The order depends only on the items, ``rng``
    and where ``early`` turns true in the input, never on timing.
    """
    return ShuffleBuffer[T](size, rng, initial, early=early).run(items)


# I77, I78: the shuffle buffer is bounded and loses nothing.
class ShuffleBuffer(Generic[T]):
    """:func:`buffered_shuffle` with its state in the open, so that a reader can save it
    between two items and a new one continue with exactly the same order.

    The state at any point between two items is ``buffer`` (the items taken and not yet
    given, in their order), ``rng``'s state, ``started`` (the buffer has begun to give
    items out), ``owed`` (items still to give out before the next one is taken in: the
    start gives out half the buffer at once) and ``draining`` (the input has run out and
    the buffer was shuffled a last time: the rest comes out in order). A buffer built with
    those and run on the rest of the input yields what the first one would have.
    """

    def __init__(
        self,
        size: int,
        rng: random.Random,
        initial: int = 100,
        *,
        early: Callable[[], bool] | None = None,
        buffer: list[T] | None = None,
        started: bool = False,
        owed: int = 0,
        draining: bool = False,
    ) -> None:
        self.size = size
        self.rng = rng
        self.initial = max(1, min(initial, size))
        self.early = early
        self.buffer: list[T] = [] if buffer is None else buffer
        self.started = started
        self.owed = owed
        self.draining = draining

    def run(self, items: Iterable[T]) -> Iterator[T]:
        """Yield ``items`` shuffled, after what the buffer already holds."""
        buf = self.buffer
        if self.size <= 1:
            yield from buf
            buf.clear()
            yield from items
            return
        if not self.draining:
            yield from self._give()  # what a saved start still owed
            it = iter(items)
            for item in it:
                buf.append(item)
                if not self.started:
                    if not self._ready():
                        continue
                    self.started = True
                    self.owed = len(buf) - len(buf) // 2
                else:
                    if len(buf) < self.size:
                        for more in it:  # take a second one while growing
                            buf.append(more)
                            break
                    self.owed = 1
                yield from self._give()
            self.rng.shuffle(buf)
            # Given from the front; kept reversed so that each item leaves by pop() and the
            # buffer always holds exactly what is still to come.
            buf.reverse()
            self.draining = True
        while buf:
            yield buf.pop()

    def _ready(self) -> bool:
        """Whether the buffer may start giving out (it holds what a start needs)."""
        return len(self.buffer) >= self.initial or (self.early is not None and self.early())

    def _give(self) -> Iterator[T]:
        """The items owed, each drawn at random; ``owed`` counts down before each leaves,
        so a state saved between two of them resumes with the rest."""
        buf, rng = self.buffer, self.rng
        while self.owed and buf:
            self.owed -= 1
            i = rng.randrange(len(buf))
            buf[i], buf[-1] = buf[-1], buf[i]
            yield buf.pop()
