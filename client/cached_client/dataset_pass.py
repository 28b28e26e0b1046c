"""One reader's pass over one epoch of a :class:`~cached_client.CachedDataset`: what it
has taken so far (the position, the shuffle buffer and its random state), as a state dict,
and how a saved state resumes (the parts it reads, the shuffle buffer refilled).

It knows nothing of the dataset or the daemon: the dataset hands it the reads
(:meth:`EpochPass.shuffled`'s ``source``) and what a pass's parts depend on
(:meth:`EpochPass.begin`).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from . import elastic, partition, resume
from .errors import UsageError
from .placement import Reader
from .resume import Position, Ref

Sample = dict[str, Any]


class EpochPass:
    """One reader's pass over one epoch: what it has taken so far, for ``state_dict``."""

    def __init__(self, epoch: int, saved: Mapping[str, Any] | None) -> None:
        self.epoch = epoch
        # A merged state: this pass reads its share of the rest of the saved epoch.
        self.elastic = saved if saved is not None and saved.get("elastic") else None
        self.lengths: str | None = None if saved is None else saved.get("lengths")
        if self.elastic is not None:
            saved = None
        self.saved = saved
        self.position = Position(epoch) if saved is None else Position.saved(saved)
        self.shuffle: partition.ShuffleBuffer[tuple[Ref, Sample]] | None = None
        # The parts of a pass that is a share of an epoch's rest (not the epoch's plan).
        own = None if saved is None else saved.get("own")
        self.own = None if own is None else elastic.parts_from(own)

    def state(self) -> dict[str, Any]:
        """This pass's fields of a state dict (see ``CachedDataset.state_dict``)."""
        shuffle = self.shuffle
        if shuffle is not None:
            buffer = [[part, offset] for (part, offset), _ in shuffle.buffer]
            rng: list[Any] | None = resume.rng_state(shuffle.rng)
            started, owed, draining = shuffle.started, shuffle.owed, shuffle.draining
        elif self.saved is not None:  # not started: the state it was loaded from
            buffer = [list(ref) for ref in self.saved.get("buffer") or []]
            rng, (started, owed, draining) = self.saved.get("rng"), _buffer_phase(self.saved)
        else:
            buffer, rng, started, owed, draining = [], None, False, 0, False
        return {
            **self.position.state(),
            "buffer": buffer,
            "rng": rng,
            "started": started,
            "owed": owed,
            "draining": draining,
            "lengths": self.lengths,
            "own": None if self.own is None else elastic.parts_state(self.own),
        }

    def _buffered(self) -> list[Ref]:
        if self.saved is None:
            return []
        try:
            return [(int(part), int(offset)) for part, offset in self.saved.get("buffer") or []]
        except (TypeError, ValueError):
            raise UsageError("cannot resume CachedDataset: a damaged shuffle buffer") from None

    def begin(
        self,
        *,
        lengths: Callable[[], list[int]] | None,
        reader: Callable[[], Reader],
        n_shards: int,
        seed: int,
        plan: Callable[[int], list[partition.Part]],
    ) -> list[partition.Part]:
        """The parts this pass reads, its position started on them: the epoch's plan
        (``plan(epoch)``), or this reader's share of a merged state's rest. ``lengths``
        (with ``equal_batches``) gives every shard's sample count, which must be those
        the state was saved with."""
        if lengths is not None:
            counts = resume.fingerprint(lengths())
            if self.lengths is not None and self.lengths != counts:
                raise UsageError(
                    "cannot resume CachedDataset: the shards' sample counts changed since "
                    "the state was saved (equal_batches splits by them)"
                )
            self.lengths = counts
        if self.elastic is not None and self.own is None:
            self.own = elastic.resumed_share(
                self.elastic,
                reader(),
                n_shards=n_shards,
                seed=seed,
                epoch=self.epoch,
                lengths=lengths() if lengths is not None else None,
            )
        parts = self.own if self.own is not None else plan(self.epoch)
        self.position.start(parts, "CachedDataset")
        return parts

    def shuffled(
        self,
        source: Callable[[list[Ref]], Iterator[tuple[Ref, Sample]]],
        *,
        seed: int,
        size: int,
        stream: int,
    ) -> Iterator[tuple[Ref, Sample]]:
        """The pass's samples through a shuffle buffer of ``size``, restored if resumed.
        ``source(picks)``: the buffer's saved samples (``picks``), then the rest of the
        pass from its position."""
        picks = self._buffered()
        samples = source(picks)
        # The buffer's samples come back first, read by index; the buffer then holds them
        # in its saved order, and the shuffle goes on as if never interrupted.
        back = dict(itertools.islice(samples, len(picks)))
        if set(back) != set(picks):
            raise UsageError(
                "cannot resume CachedDataset: samples of the saved shuffle buffer are not in "
                "the shards any more (did the shards change?)"
            )
        saved = self.saved
        if saved is not None and saved.get("rng") is not None:
            rng = resume.rng_from(saved["rng"])
        else:
            rng = random.Random(f"samples/{seed}/{self.epoch}/{stream}")
        started, owed, draining = _buffer_phase(saved) if saved is not None else (False, 0, False)
        position = self.position
        self.shuffle = partition.ShuffleBuffer(
            size,
            rng,
            # Start once the first part is all in: its last sample moves the position to
            # part 1 before the buffer takes it. Waiting for more would wait for the next
            # shard's download; where it starts is a function of the data, not of timing.
            early=lambda: position.part > 0,
            buffer=[(ref, back[ref]) for ref in picks],
            started=started,
            owed=owed,
            draining=draining,
        )
        return self.shuffle.run(samples)


def _buffer_phase(saved: Mapping[str, Any]) -> tuple[bool, int, bool]:
    """``(started, owed, draining)`` of a saved shuffle buffer. A version 1 state has no
    ``started`` or ``owed``: it was saved between two items given out (so the buffer had
    started, and owed nothing) or before the first (an empty buffer, not started)."""
    draining = bool(saved.get("draining"))
    if "started" not in saved:
        return bool(saved.get("buffer")) or draining, 0, draining
    try:
        return bool(saved["started"]), int(saved.get("owed") or 0), draining
    except (TypeError, ValueError):
        raise UsageError("cannot resume CachedDataset: a damaged shuffle buffer") from None
