"""The ``<id>.idx`` sidecar of a hot-tier shard: where the shard came from, its checksum
and its sample index, so that a restarted daemon can serve and check it without asking
the store.

The file is one JSON line, then the serialized :class:`ShardIndex` (whose
``checksums`` column holds the members' checksums). The line::

    {"url": "s3://b/k.tar", "version": "<etag>", "published": 1764570000.5,
     "checksum": "xxh3_64:9c2f6e1b0d4a7f31",
     "info": {"url": ..., "endpoint": ..., "size": ..., "version": ..., "etag": ...,
              "tier": "warm", "source_url": null}}

Sidecars written before checksums have only ``url`` and ``version``: they load with no
checksum and no origin, and the hot tier checks such a shard before serving it (see
:meth:`Checks.verify`), then writes the sidecar again in this form. So do sidecars
whose checksums were made with another algorithm than :data:`verify.ALGORITHM`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from ..errors import CacheError
from ..stores.base import ObjectInfo
from .index import ShardIndex
from .verify import ALGORITHM

_STR = ("url", "endpoint", "version", "tier")
_OPTIONAL_STR = ("etag", "source_url", "checksum")


@dataclass(frozen=True)
class Sidecar:
    """What the hot tier keeps beside a shard's data file."""

    url: str
    version: str
    index: ShardIndex
    info: ObjectInfo | None = None  # the object as the store described it; None: unknown
    checksum: int | None = None  # of the whole data file (ALGORITHM); None: not known
    published: float = 0.0  # Unix time the shard was published (0: unknown)

    def to_bytes(self) -> bytes:
        """The file's contents; :meth:`from_bytes` reads them back."""
        head: dict[str, Any] = {
            "url": self.url,
            "version": self.version,
            "published": self.published,
        }
        if self.checksum is not None:
            head["checksum"] = f"{ALGORITHM}:{self.checksum:016x}"
        if self.info is not None:
            head["info"] = dataclasses.asdict(self.info)
        return json.dumps(head).encode() + b"\n" + self.index.to_bytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> Sidecar:
        """Parse a sidecar, old or new; raises :class:`CacheError` if it is corrupt."""
        line, sep, body = data.partition(b"\n")
        if not sep:
            raise CacheError("index sidecar has no header line")
        try:
            head = json.loads(line)
        except ValueError as exc:
            raise CacheError(f"index sidecar header is not JSON: {exc}") from None
        if not isinstance(head, dict):
            raise CacheError("index sidecar header is not an object")
        url, version = head.get("url"), head.get("version")
        if not isinstance(url, str) or not isinstance(version, str):
            raise CacheError("index sidecar header lacks url or version")
        checksum = _checksum(head.get("checksum"))
        published = head.get("published", 0.0)
        if type(published) not in (int, float):
            raise CacheError(f"index sidecar has a bad published time {published!r}")
        info = _info(head.get("info"))
        if info is not None and (info.url != url or info.version != version):
            raise CacheError("index sidecar's origin names another object")
        index = ShardIndex.from_bytes(body)
        if checksum is None or index.algorithm != ALGORITHM:
            checksum, index = None, index.without_checksums()  # to be re-hashed
        return cls(url, version, index, info, checksum, float(published))


def _checksum(value: object) -> int | None:
    """``"<algorithm>:<hex>"`` as an int if it is of :data:`ALGORITHM`, else None."""
    if value is None:
        return None
    algorithm, _, digits = str(value).partition(":")
    try:
        number = int(digits, 16)
    except ValueError:
        raise CacheError(f"index sidecar has a bad checksum {value!r}") from None
    return number if algorithm == ALGORITHM else None


def _info(doc: object) -> ObjectInfo | None:
    """The stored :class:`ObjectInfo`; None if absent; CacheError if malformed."""
    if doc is None:
        return None
    ok = (
        isinstance(doc, dict)
        and all(isinstance(doc.get(k), str) for k in _STR)
        and all(doc.get(k) is None or isinstance(doc.get(k), str) for k in _OPTIONAL_STR)
        and type(doc.get("size")) is int
        and doc["size"] >= 0
    )
    if not ok:
        raise CacheError("index sidecar has a malformed origin")
    assert isinstance(doc, dict)
    return ObjectInfo(
        url=doc["url"],
        endpoint=doc["endpoint"],
        size=doc["size"],
        version=doc["version"],
        etag=doc.get("etag"),
        tier=doc["tier"],
        source_url=doc.get("source_url"),
        checksum=doc.get("checksum"),
    )
