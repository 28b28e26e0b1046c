"""What a read's reply says of its samples: the members a read asked for, and a local
read's layout as one packed frame (docs/protocol.md, "Local reads"; D34, D41).

A local reader reads the members from the shard file itself, so its reply carries, per
member, the extension, size, offset and checksum, and no payload. That layout is the
only one local replies have: the compiled reader (``_gather.c`` ``layout_packed``) and
the Python one (``cached_client.layouts.unpacked``) both take it. A whole shard's layout
is made once and kept with its index, for a few extension lists.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from cached_client.protocol import PACKED_MEMBER

from .tiers.index import Member, Sample, ShardIndex

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
    exts: dict[str, int] = {}
    first, key_start = [0], [0]
    records: list[bytes] = []
    keys = bytearray()
    nbytes = 0
    for sample in samples:
        members = chosen(sample, wanted)
        for m in members:
            e = exts.setdefault(m.ext, len(exts))
            has = m.checksum is not None
            records.append(PACKED_MEMBER.pack(e, int(has), m.size, m.offset, m.checksum or 0))
            nbytes += m.size
        first.append(first[-1] + len(members))
        keys += sample.key.encode()
        key_start.append(len(keys))
    count = len(first) - 1
    tables = struct.pack(f"<II{count + 1}I{count + 1}I", count, first[-1], *first, *key_start)
    return Packed(b"".join((tables, *records, bytes(keys))), list(exts)), nbytes
