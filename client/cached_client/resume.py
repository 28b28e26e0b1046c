"""Resume mid-epoch without replay: a reader's position as a plain dict, and the checks
that a saved position belongs to the reader that loads it.

A reader (a rank's :class:`~cached_client.FastLoader`, or one DataLoader worker of a
rank's :class:`~cached_client.CachedDataset`) reads its parts of the epoch in order; the
parts are a pure function of (shard URLs, seed, epoch, rank, world size, worker, workers)
and, with ``equal_batches``, the shards' sample counts (:func:`partition.reader_parts`).
So a position is small: the next sample the reader takes, ``(part, offset)`` (an index
into its parts and a sample offset into that part), and for a shuffling
``CachedDataset`` the samples it has read but not yet given out (its shuffle buffer, by
the same coordinates) with the shuffle's random state.

Resuming reads only what remains: the buffer's samples back by index (they were never
given out), then the rest from the position. The daemon serves samples by ``(url,
index)``, so this needs nothing new on the wire.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .errors import UsageError
from .partition import Part
from .reader import Span

# Bumped when the meaning of a field changes. 2: the shuffle buffer's start ("started",
# "owed"; D28). A state of version 1 resumes exactly too: it was saved at a point where
# the buffer had started or was fresh, which is what it says without those fields.
STATE_VERSION = 2
READABLE_VERSIONS = (1, 2)

# A sample of a reader's epoch: (index into its parts, offset from the part's start).
Ref = tuple[int, int]

# What must match for a state to be resumed, and how a mismatch is named in the error.
_LABELS = {
    "loader": "loader",
    "shards": "number of shards",
    "urls": "shard URLs (digest)",
    "world_size": "world_size",
    "rank": "rank",
    "workers": "DataLoader workers per rank (num_workers=0 counts as 1)",
    "worker": "DataLoader worker",
    "shuffle": "shuffle",
    "seed": "seed",
    "equal_batches": "equal_batches",
    "shuffle_buffer": "shuffle_buffer",
    "placement": "placement",
    "local_world_size": "ranks per node (local_world_size)",
    "placement_mix": "placement_mix",
}
# What a state saved before a field existed holds: its default.
_DEFAULTS = {"placement": "global", "local_world_size": None, "placement_mix": 0.0}


def fingerprint(items: Iterable[object]) -> str:
    """A short digest of a list (shard URLs, sample counts): equal lists, equal digests."""
    digest = hashlib.sha256()
    for item in items:
        digest.update(str(item).encode())
        digest.update(b"\n")
    return digest.hexdigest()[:16]


# I75: a state saved by another job is refused.
def check(state: Any, identity: Mapping[str, Any]) -> None:
    """Raise :class:`UsageError` unless ``state`` is a position saved by the reader that
    ``identity`` describes (same loader kind, shards, seed, shuffle, rank, world size and
    DataLoader workers): another reader's position would silently read other samples."""
    loader = identity["loader"]
    if not isinstance(state, Mapping) or "epoch" not in state:
        raise UsageError(f"cannot resume {loader}: {type(state).__name__} is not its state_dict()")
    if state.get("version") not in READABLE_VERSIONS:
        raise UsageError(
            f"cannot resume {loader}: the state has format version {state.get('version')!r}, "
            f"this client reads versions {', '.join(map(str, READABLE_VERSIONS))}"
        )
    diffs = [
        f"{_LABELS.get(key, key)}: saved {state.get(key, _DEFAULTS.get(key))!r}, here {value!r}"
        for key, value in identity.items()
        if key != "version" and state.get(key, _DEFAULTS.get(key)) != value
    ]
    if diffs:
        raise UsageError(
            f"cannot resume {loader} from this state: it was saved by another reader ("
            + "; ".join(diffs)
            + "). A state resumes only the reader that saved it: the same shard URLs, seed, "
            "shuffle, rank, world_size and DataLoader workers. To resume on another number "
            "of nodes, ranks or workers, load cached_client.elastic.elastic_state(every "
            "rank's state)"
        )
    for key in ("epoch", "part", "offset"):
        if not isinstance(state[key], int) or state[key] < 0:
            raise UsageError(f"cannot resume {loader}: bad {key} {state[key]!r} in the state")


def done(state: Mapping[str, Any]) -> bool:
    """Whether a saved position is at the end of its epoch (nothing left to read)."""
    if state.get("elastic"):
        return bool(state.get("done"))
    parts = state.get("parts")
    return parts is not None and state["part"] >= parts and not state.get("buffer")


def for_epoch(state: Any, epoch: int, who: str, how: str) -> Any:
    """``state`` if it resumes ``epoch``; None if it was saved at the exact end of an
    earlier epoch (the new one starts afresh); else :class:`UsageError`. ``who`` names the
    loader, ``how`` says how the epoch was set, for the message."""
    if state is None or state["epoch"] == epoch:
        return state
    if done(state) and state["epoch"] < epoch:
        return None
    raise UsageError(
        f"cannot resume {who}: the state is part-way through epoch {state['epoch']}, but "
        f"{how}; finish epoch {state['epoch']} first (set_epoch({state['epoch']}))"
    )


class Position:
    """Where a reader is in its epoch: the next sample it takes, ``(part, offset)``.

    Moved by :meth:`took` as samples leave the read pipeline (into the shuffle buffer, or
    into a batch), so it never counts what is still in flight from the daemon.
    """

    __slots__ = ("epoch", "offset", "part", "parts")

    def __init__(self, epoch: int, part: int = 0, offset: int = 0) -> None:
        self.epoch = epoch
        self.part = part
        self.offset = offset
        self.parts: int | None = None  # known once the pass has computed its parts

    @classmethod
    def saved(cls, state: Mapping[str, Any]) -> Position:
        """The position a checked state holds."""
        position = cls(state["epoch"], state["part"], state["offset"])
        position.parts = state.get("parts")
        return position

    def took(self, ref: Ref, last: bool) -> None:
        """Sample ``ref`` was taken; ``last``: it was its part's final one."""
        part, offset = ref
        self.part, self.offset = (part + 1, 0) if last else (part, offset + 1)

    def finish(self) -> None:
        """The pass has read everything (a dropped last batch included)."""
        if self.parts is not None:
            self.part, self.offset = self.parts, 0

    def state(self) -> dict[str, Any]:
        """The position's fields of a state dict."""
        return {"epoch": self.epoch, "parts": self.parts, "part": self.part, "offset": self.offset}

    def start(self, parts: Sequence[Part], loader: str) -> None:
        """Check a resumed position against the pass's parts (computed afresh: with
        ``equal_batches`` they depend on the shards' sample counts)."""
        if self.parts is not None and self.parts != len(parts):
            raise UsageError(
                f"cannot resume {loader}: the state was saved over {self.parts} parts of "
                f"epoch {self.epoch}, this reader has {len(parts)} (did the shards change?)"
            )
        if self.part > len(parts):
            raise UsageError(f"cannot resume {loader}: part {self.part} is past the epoch's end")
        self.parts = len(parts)


# I74: a resume continues at the exact next sample.
def resume_spans(
    urls: Sequence[str], parts: Sequence[Part], position: Position, picks: Iterable[Ref] = ()
) -> tuple[list[Span], list[int]]:
    """What a reader at ``position`` reads: the samples ``picks`` (a shuffle buffer's,
    all before the position) first, then the rest of its parts. Returns the spans and,
    for each span, the index of its part. A shard's picks and its rest share one span
    (one open, one pin), and a fresh pass is just its parts."""
    by_part: dict[int, list[int]] = {}
    for part, offset in picks:
        if not (part, offset) < (position.part, position.offset) or part >= len(parts):
            raise UsageError(
                f"cannot resume: a buffered sample {(part, offset)} is not before the "
                f"position {(position.part, position.offset)} (a damaged state)"
            )
        by_part.setdefault(part, []).append(parts[part].start + offset)
    spans: list[Span] = []
    owners: list[int] = []
    for part in sorted(by_part):
        if part < position.part:  # only its buffered samples are left of this part
            chosen = tuple(sorted(by_part[part]))
            spans.append(Span(urls[parts[part].shard], chosen[-1] + 1, chosen[-1] + 1, chosen))
            owners.append(part)
    for part in range(position.part, len(parts)):
        p = parts[part]
        start = p.start + (position.offset if part == position.part else 0)
        chosen = tuple(sorted(by_part.get(part, ()))) if part == position.part else ()
        spans.append(Span(urls[p.shard], start, p.stop, chosen))
        owners.append(part)
    return spans, owners


def rng_state(rng: random.Random) -> list[Any]:
    """A ``random.Random``'s state as plain lists (it survives JSON as well as pickle)."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def rng_from(state: Sequence[Any]) -> random.Random:
    """The generator that :func:`rng_state` saved."""
    rng = random.Random()
    try:
        rng.setstate((state[0], tuple(state[1]), state[2]))
    except (TypeError, ValueError, IndexError) as exc:
        raise UsageError(f"cannot resume: a damaged shuffle state ({exc})") from None
    return rng
