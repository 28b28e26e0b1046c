"""Compact plans (issue 24, item 5; docs/protocol.md, "Datasets"): a dataset's URL list goes
to the daemon once, and each plan names its shards by their positions in that list.

A plan of 12,500 + 12,500 URLs is 1.3 MB of JSON, sent by every reader at every epoch; as
positions it is 133 KB (4 bytes each, base64). The list is named by a digest of its
contents (:func:`catalog_id`), which the daemon computes again, so no client can make a
name stand for other URLs; two jobs reading the same dataset share one copy in the daemon.

Standard library only: the daemon decodes indices with the same code.
"""

from __future__ import annotations

import base64
import hashlib
import sys
from array import array
from collections.abc import Sequence

# Positions are unsigned 32-bit, little-endian: a dataset of up to 4 billion shards.
INDEX_TYPECODE = "I"
# A digest of 128 bits: a collision between two datasets is not a concern at any scale.
_DIGEST_BYTES = 16


def catalog_id(urls: Sequence[str]) -> str:
    """The name of a dataset's URL list: a digest of the URLs in order, each length-prefixed
    (so no two lists share a name by where their URLs split)."""
    digest = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    for url in urls:
        data = url.encode()
        digest.update(len(data).to_bytes(4, "little"))
        digest.update(data)
    return digest.hexdigest()


def encode_index(positions: Sequence[int]) -> str:
    """``positions`` as the ``index`` field of a plan: base64 of unsigned 32-bit integers,
    little-endian."""
    packed = array(INDEX_TYPECODE, positions)
    if packed.itemsize != 4:  # pragma: no cover - every platform CPython runs on has it
        raise RuntimeError("array('I') is not 32-bit on this platform")
    if sys.byteorder == "big":  # pragma: no cover - no big-endian machine here
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def decode_index(text: str) -> array[int]:
    """The positions an ``index`` field names; ``ValueError`` for anything else."""
    try:
        data = base64.b64decode(text.encode("ascii"), validate=True)
    except (UnicodeEncodeError, ValueError) as exc:
        raise ValueError("a plan's 'index' must be base64") from exc
    if len(data) % 4:
        raise ValueError("a plan's 'index' must hold 4-byte positions")
    positions = array(INDEX_TYPECODE)
    positions.frombytes(data)
    if sys.byteorder == "big":  # pragma: no cover - no big-endian machine here
        positions.byteswap()
    return positions


class Catalog:
    """One dataset's URL list, its name, and where each URL is in it (built at first use:
    a DataLoader worker builds its own once, after the dataset is pickled to it)."""

    def __init__(self, urls: Sequence[str]) -> None:
        # The caller's own list where it is one: pickled with it, it is stored once.
        self.urls = urls if isinstance(urls, list) else list(urls)
        self._id: str | None = None
        self._positions: dict[str, int] | None = None

    @property
    def id(self) -> str:
        """:func:`catalog_id` of the list."""
        if self._id is None:
            self._id = catalog_id(self.urls)
        return self._id

    def index(self, urls: Sequence[str]) -> str | None:
        """``urls`` as an encoded index into this list, or None if one is not in it."""
        if self._positions is None:
            # The first position of a URL the list names twice: either serves a plan.
            self._positions = {}
            for pos, url in enumerate(self.urls):
                self._positions.setdefault(url, pos)
        try:
            return encode_index([self._positions[url] for url in urls])
        except KeyError:
            return None

    def __getstate__(self) -> dict[str, object]:
        # Pickled to DataLoader workers with its dataset: the list only, not the index.
        return {"urls": self.urls, "_id": self._id, "_positions": None}
