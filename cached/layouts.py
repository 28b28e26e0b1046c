"""What a read's reply says of its samples: the members a read asked for, and a local
read's layout as one packed frame (docs/protocol.md, "Local reads"; D34, D41).

A local reader reads the members from the shard file itself, so its reply carries, per
member, the extension, size, offset and checksum, and no payload. That layout is the
only one local replies have; its codec is ``cached_wire.layouts`` (``pack``, and the
Python reader's ``unpacked``; the compiled reader is ``_gather.c`` ``layout_packed``).
A whole shard's layout is made once and kept with its index, for a few extension lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cached_wire.layouts import pack as wire_pack

from .hot.index import Member, Sample, ShardIndex

# Whole-shard layouts kept per resident shard (one per extension list asked for, the
# last few): a client may ask for any number of lists, and each layout is about the size
# of the shard's index.
# I63: whole-shard layouts kept stay bounded.
MAX_KEPT_LAYOUTS = 4


def chosen(sample: Sample, wanted: frozenset[str] | None) -> list[Member]:
    """The sample's members a read asked for (``exts``; None: all)."""
    return [m for m in sample.members if wanted is None or m.ext in wanted]


@dataclass(frozen=True)
class Packed:
    """A local read's layout as one frame, and the names of the extensions its members
    refer to by index."""

    frame: bytes
    exts: list[str]


def packed_layout(
    index: ShardIndex, wanted: frozenset[str] | None, start: int, stop: int
) -> tuple[Packed, int]:
    """The packed layout of samples ``start..stop`` (their members in ``wanted``) and
    their payload bytes. A whole shard's is made once and kept with the index: a local
    reader asks for whole shards, every epoch, and listing each member was most of what
    the daemon still spent on serving it."""
    whole = start == 0 and stop == len(index.samples)
    if whole and wanted in index.memo:
        kept: tuple[Packed, int] = index.memo[wanted]
        return kept
    made = pack(index.samples[start:stop], wanted)
    if whole:
        while len(index.memo) >= MAX_KEPT_LAYOUTS:
            del index.memo[next(iter(index.memo))]
        index.memo[wanted] = made
    return made


def pack(samples: Sequence[Sample], wanted: frozenset[str] | None) -> tuple[Packed, int]:
    """The packed layout of ``samples`` (their members in ``wanted``) and their payload
    bytes."""
    frame, exts, nbytes = wire_pack((sample.key, chosen(sample, wanted)) for sample in samples)
    return Packed(frame, exts), nbytes
