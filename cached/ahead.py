"""What a reader's open ahead waits for: the shard, or the store's answer about its
URL, that someone else (the prefetcher) is bringing. Nothing here sends a request or
starts a download; the fetcher asks as a demand would once these give up.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass

from .hot.tier import HotTier, Shard
from .lookups import Lookups
from .stores.base import ObjectInfo

# How often a reader's open ahead looks whether the prefetcher started on its shard (or
# on the GET that asks for its version).
AHEAD_POLL_S = 0.25


@dataclass
class Opening:
    """A GET of a URL whose version is not known yet, shared by all who ask for the URL
    meanwhile. ``info`` is set from its headers; its task then goes on to download the
    shard from that body, unless the hot tier has it or another download brings it."""

    # The most urgent asker's: the download slot and the reservation follow it.
    priority: int
    info: asyncio.Future[ObjectInfo]
    task: asyncio.Task[Shard | None] | None = None


async def answered_soon(
    lookups: Lookups,
    openings: Mapping[str, Opening],
    hot: HotTier,
    url: str,
    deadline: float,
    *,
    revalidate: bool,
) -> ObjectInfo | None:
    """The store's answer about ``url`` once someone else's GET has it, or None at
    ``deadline``. Sends nothing; raises what that GET raised (not found...)."""
    while (left := deadline - time.monotonic()) > 0:
        known = lookups.fresh(url, revalidate=revalidate)
        if known is not None:
            return known
        opening = openings.get(url)
        if opening is None:
            await hot.changed(min(left, AHEAD_POLL_S))
            continue
        try:
            return await asyncio.wait_for(asyncio.shield(opening.info), left)
        except TimeoutError:
            return None
    return None


async def resident_soon(
    hot: HotTier, downloads: Mapping[str, asyncio.Task[Shard]], sid: str, timeout_s: float
) -> Shard | None:
    """The shard once someone else brings it into the hot tier, or None after
    ``timeout_s``. Starts no download."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        shard = hot.get(sid)
        if shard is not None:
            return shard
        task = downloads.get(sid)
        if task is not None and not task.done():
            # Its failure (not admitted, not found) is for its own callers to see.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(task), left)
        else:
            await hot.changed(min(left, AHEAD_POLL_S))
    return None
