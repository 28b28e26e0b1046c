"""What the store says about each object (size, version), remembered for a while.

Every open needs the object's version: it is part of the shard's content address, so a
replaced object is a new shard. Asking the store (one HEAD) at every open would put a
round trip before every hit, so an answer is trusted for ``[s3] revalidate_s``; an open
after that asks again, and a new version is fetched and served from then on. Reads
(which follow an open) and the prefetcher take the answer as it is, whatever its age.

While the store is unreachable (:class:`StoreUnavailable`) the hot tier's copy answers
for itself, from its sidecar: a resident shard is served as it is, without a HEAD per
open, and a URL the hot tier lacks fails at once rather than after another retry budget
(readers and the prefetcher would otherwise queue HEADs behind a dead endpoint). A
background probe asks the store every ``PROBE_S`` until it answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from .errors import CachedError
from .sources.base import ObjectInfo
from .sources.retry import StoreUnavailable
from .store_health import StoreHealth

log = logging.getLogger(__name__)

# How often an unreachable store is asked again, in the background.
PROBE_S = 2.0
# Answers remembered at most, least recently used dropped first: clients name the URLs, so
# this state must have a bound other than time (~100 MB at the bound). A dropped answer
# costs one HEAD when the URL comes back.
MAX_ANSWERS = 262_144


@dataclass(frozen=True)
class _Answer:
    info: ObjectInfo
    at: float  # time.monotonic() of the HEAD


class Lookups:
    """HEADs, deduplicated and remembered; resident copies stand in during an outage.

    ``head(url)`` asks the store; ``offline(url)`` is the resident shard's info, if the
    hot tier holds the URL and knows its origin; ``on_answer(info)`` hears every answer.
    """

    def __init__(
        self,
        head: Callable[[str], Coroutine[Any, Any, ObjectInfo]],
        offline: Callable[[str], ObjectInfo | None],
        *,
        revalidate_s: float,
        on_answer: Callable[[ObjectInfo], None] | None = None,
    ) -> None:
        self._head = head
        self._offline = offline
        self.revalidate_s = revalidate_s
        self._on_answer = on_answer
        self.health = StoreHealth()
        self._answers: OrderedDict[str, _Answer] = OrderedDict()
        self._heads: dict[str, asyncio.Task[ObjectInfo]] = {}
        self._probe: asyncio.Task[None] | None = None

    async def get(self, url: str, *, revalidate: bool = False) -> ObjectInfo:
        """The object's size and version.

        An answer already known is reused; with ``revalidate`` (an open) only while it is
        younger than ``revalidate_s``. While the store is unreachable a resident copy
        answers without a HEAD. Raises what the HEAD raises when nothing can answer
        (:class:`ObjectNotFound` always: the store said so).
        """
        known = self._answers.get(url)
        if known is not None and (
            not revalidate or time.monotonic() - known.at < self.revalidate_s
        ):
            self._answers.move_to_end(url)
            return known.info
        if not self.health.reachable:
            resident = self._offline(url)
            if resident is None:
                raise StoreUnavailable(
                    f"{url}: not in the hot tier, and the object store has been unreachable "
                    f"for {self.health.down_s():.0f}s (last error: {self.health.last_error})"
                )
            self.health.offline_opens += 1
            return resident
        try:
            info = await self._ask(url)
        except StoreUnavailable as exc:
            self.unreachable(exc, url)
            resident = self._offline(url)
            if resident is None:
                raise
            self.health.offline_opens += 1
            return resident
        return info

    def forget(self, url: str) -> None:
        """Drop what is known of ``url`` (a fetch of it failed, or it changed)."""
        self._answers.pop(url, None)

    def unreachable(self, error: BaseException, url: str) -> None:
        """A request for ``url`` found the store unreachable (HEAD or download)."""
        if self.health.failed(error) and self._probe is None:
            self._probe = asyncio.get_running_loop().create_task(self._probing(url))

    async def _ask(self, url: str) -> ObjectInfo:
        """One HEAD per URL at a time, however many ask."""
        task = self._heads.get(url)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._head_once(url), name=f"head {url}")
            self._heads[url] = task
            task.add_done_callback(lambda _t: self._heads.pop(url, None))
        return await asyncio.shield(task)

    async def _head_once(self, url: str) -> ObjectInfo:
        """One HEAD; its answer is remembered, reported and logged if the version moved."""
        try:
            info = await self._head(url)
        except StoreUnavailable:
            raise
        except CachedError:
            self.health.answered()  # a 404 or 403 is an answer
            raise
        self.health.answered()
        previous = self._answers.get(url)
        if previous is not None and previous.info.version != info.version:
            log.info(
                "%s changed in the store (version %s -> %s): the new version is served from now on",
                url,
                previous.info.version,
                info.version,
            )
        self._answers[url] = _Answer(info, time.monotonic())
        self._answers.move_to_end(url)
        while len(self._answers) > MAX_ANSWERS:
            self._answers.popitem(last=False)
        if self._on_answer is not None:
            self._on_answer(info)
        return info

    async def _probing(self, url: str) -> None:
        """Ask the store about ``url`` every ``PROBE_S`` until it answers (any answer)."""
        try:
            while not self.health.reachable:
                await asyncio.sleep(PROBE_S)
                with contextlib.suppress(CachedError):
                    await self._ask(url)
        finally:
            self._probe = None

    async def stop(self) -> None:
        """Cancel the HEADs and the probe under way (shutdown)."""
        tasks = [t for t in (*self._heads.values(), self._probe) if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
