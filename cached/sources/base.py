"""The interface every remote tier implements (warm: S3/MinIO; file://; later cold tiers)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

# Receives the object's bytes in order, exactly once each; may apply back-pressure by awaiting.
Sink = Callable[[bytes], Awaitable[None]]


@dataclass(frozen=True)
class ObjectInfo:
    """What a source knows of an object before fetching it.

    ``version`` is the content identity used for the cache address: the ETag for S3,
    ``"<size>-<mtime_ns>"`` for files.
    """

    url: str
    endpoint: str
    size: int
    version: str
    etag: str | None = None


class Source(Protocol):
    """A remote tier: look an object up, then stream it in order into a sink."""

    async def head(self, url: str) -> ObjectInfo:
        """Return the object's size and version. Raises ``ObjectNotFound`` or ``FetchError``."""
        ...

    async def fetch(self, info: ObjectInfo, sink: Sink) -> None:
        """Stream the object's bytes, in order, into ``sink``; verify size and checksum.

        Retries transient failures within a bounded budget. Raises ``VerifyError`` on a
        size or checksum mismatch, ``FetchTimeout`` when the budget runs out,
        ``ObjectNotFound`` when the object disappeared, ``FetchError`` otherwise.
        """
        ...
