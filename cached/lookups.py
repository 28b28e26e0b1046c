"""What the store says about each object (size, version), remembered for a while.

Every open needs the object's version: it is part of the shard's content address, so a
replaced object is a new shard. Asking the store (one HEAD) at every open would put a
round trip before every hit, so an answer is trusted for ``[s3] revalidate_s``; an open
after that asks again, and a new version is fetched and served from then on. Reads
(which follow an open) and the prefetcher take the answer as it is, whatever its age.
An answer is a HEAD's (:meth:`Lookups.get`) or the headers of the GET that fetches the
object (:meth:`Lookups.remember`, from the fetcher): a cold object costs no HEAD.

While the store is unreachable (:mod:`.store_health`) the hot tier's copy answers
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
from .once import joined
from .store_health import StoreHealth
from .stores.base import ObjectInfo
from .stores.retry import StoreUnavailable

log = logging.getLogger(__name__)

# How often an unreachable store is asked again, in the background.
PROBE_S = 2.0
# Answers remembered at most, least recently used dropped first: clients name the URLs, so
# this state must have a bound other than time (~100 MB at the bound). A dropped answer
# costs one request when the URL comes back.
# I62: the store's answers remembered stay bounded.
MAX_ANSWERS = 262_144


@dataclass(frozen=True)
class _Answer:
    info: ObjectInfo
    at: float  # time.monotonic() of the answer


# I19: versions are no older than revalidate_s.
class Lookups:
    """The store's answers (HEADs, deduplicated, and the fetcher's GETs' headers),
    remembered; resident copies stand in during an outage.

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
        self._answer_bytes = 0  # the sum of the remembered objects' sizes
        self._heads: dict[str, asyncio.Task[ObjectInfo]] = {}
        self._probe: asyncio.Task[None] | None = None

    async def get(self, url: str, *, revalidate: bool = False) -> ObjectInfo:
        """The object's size and version.

        An answer already known is reused; with ``revalidate`` (an open) only while it is
        younger than ``revalidate_s``. While the store is unreachable a resident copy
        answers without a HEAD. Raises what the HEAD raises when nothing can answer
        (:class:`ObjectNotFound` always: the store said so).
        """
        known = self.fresh(url, revalidate=revalidate)
        if known is not None:
            return known
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
        except StoreUnavailable:
            resident = self._offline(url)
            if resident is None:
                raise
            self.health.offline_opens += 1
            return resident
        return info

    def fresh(self, url: str, *, revalidate: bool = False) -> ObjectInfo | None:
        """The answer known about ``url`` if it may be used without asking: any, or with
        ``revalidate`` (an open) one younger than ``revalidate_s``. Keeps it among the
        most recently used."""
        known = self._answers.get(url)
        if known is None or (revalidate and time.monotonic() - known.at >= self.revalidate_s):
            return None
        self._answers.move_to_end(url)
        return known.info

    def remember(self, info: ObjectInfo) -> None:
        """The store described ``info`` (a HEAD, or a GET's headers): it answers, the
        answer is known from now on (see :meth:`fresh`), ``on_answer`` hears it, and a
        version that moved is logged."""
        self.health.answered()
        previous = self._answers.pop(info.url, None)
        if previous is not None:
            self._answer_bytes -= previous.info.size
            if previous.info.version != info.version:
                log.info(
                    "%s changed in the store (version %s -> %s): the new version is served "
                    "from now on",
                    info.url,
                    previous.info.version,
                    info.version,
                )
        self._answers[info.url] = _Answer(info, time.monotonic())
        self._answer_bytes += info.size
        while len(self._answers) > MAX_ANSWERS:
            _, dropped = self._answers.popitem(last=False)
            self._answer_bytes -= dropped.info.size
        if self._on_answer is not None:
            self._on_answer(info)

    def failed(self, url: str, error: CachedError) -> None:
        """A request about ``url`` failed before the store described it: the store is
        unreachable (:class:`StoreUnavailable`), or it answered no (404, 403)."""
        if isinstance(error, StoreUnavailable):
            self.unreachable(error, url)
        else:
            self.health.answered()

    def typical_size_bytes(self) -> int | None:
        """The mean size of the objects whose answers are known; None while none is."""
        return self._answer_bytes // len(self._answers) if self._answers else None

    def forget(self, url: str) -> None:
        """Drop what is known of ``url`` (a fetch of it failed, or it changed)."""
        known = self._answers.pop(url, None)
        if known is not None:
            self._answer_bytes -= known.info.size

    def unreachable(self, error: BaseException, url: str) -> None:
        """A request for ``url`` (HEAD or download) gave up on transient failures: that
        object's trouble, or with others' an outage (:meth:`StoreHealth.failed`)."""
        if self.health.failed(error, url) and self._probe is None:
            self._probe = asyncio.get_running_loop().create_task(self._probing(url))

    async def _ask(self, url: str) -> ObjectInfo:
        """One HEAD per URL at a time, however many ask."""
        return await joined(self._heads, url, lambda: self._head_once(url), f"head {url}")

    async def _head_once(self, url: str) -> ObjectInfo:
        """One HEAD; its answer is remembered (:meth:`remember`), its failure judged
        (:meth:`failed`)."""
        try:
            info = await self._head(url)
        except CachedError as exc:
            self.failed(url, exc)
            raise
        self.remember(info)
        return info

    async def _probing(self, url: str) -> None:
        """Ask the store every ``PROBE_S`` until it answers (any answer): about the
        object it last described, else ``url``. Not ``url`` first: an outage found by
        failures of some objects would last as long as the worst of them does."""
        try:
            while not self.health.reachable:
                await asyncio.sleep(PROBE_S)
                with contextlib.suppress(CachedError):
                    await self._ask(next(reversed(self._answers), url))
        finally:
            self._probe = None

    async def stop(self) -> None:
        """Cancel the HEADs and the probe under way (shutdown)."""
        tasks = [t for t in (*self._heads.values(), self._probe) if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
