"""Download slots: a bounded number of downloads at once, demand misses first.

:class:`PrioritySlots` is the fetcher's semaphore. Its waiters are keyed (a shard id, or
a URL while its GET has not answered), so that a prefetch a reader comes to wait for can
be promoted, and queued prefetches go in order of need.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass

# A reader waits for it: first in line, and one slot is kept for these.
DEMAND = 0
# Ahead of the readers: behind every demand, in order of need.
PREFETCH = 1


@dataclass
class _Waiter:
    priority: int
    seq: int
    key: str
    fut: asyncio.Future[None]


# I23, I24: demand before prefetch, one slot kept for demand.
class PrioritySlots:
    """A semaphore for downloads: demand misses first (in arrival order), then prefetches,
    the most urgent first (``urgency(key)``: seconds until a reader needs it; arrival
    order without it).

    ``keep`` slots are kept for ``DEMAND``: a prefetch gets a slot only while more than
    ``keep`` are free, so however many prefetches queue, a demand miss (a reader waiting)
    never waits for a download to finish before its own starts.
    """

    def __init__(
        self, slots: int, keep: int = 0, urgency: Callable[[str], float] | None = None
    ) -> None:
        self._free = slots
        self._keep = min(keep, slots - 1)
        self._urgency = urgency
        self._waiters: list[_Waiter] = []  # short (a few per download slot): scanned
        self._seq = itertools.count()

    @property
    def free(self) -> int:
        """Slots free now."""
        return self._free

    async def acquire(self, priority: int, key: str = "") -> None:
        """Wait for a slot. ``key`` names the waiter for :meth:`promote` and ``urgency``."""
        waiter = _Waiter(priority, next(self._seq), key, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self._dispatch()
        try:
            await waiter.fut
        except asyncio.CancelledError:
            if waiter.fut.done() and not waiter.fut.cancelled():
                self.release()  # the slot was handed over as we were cancelled
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def promote(self, key: str, priority: int) -> None:
        """Move waiter ``key`` up to ``priority`` (a prefetch that a reader now waits for)."""
        for waiter in self._waiters:
            if waiter.key == key and waiter.priority > priority:
                waiter.priority = priority
        self._dispatch()

    def release(self) -> None:
        """Give a slot back, to the most urgent waiter that may have it."""
        self._free += 1
        self._dispatch()

    def _dispatch(self) -> None:
        while self._free > 0:
            waiting = [w for w in self._waiters if not w.fut.done()]
            if not waiting:
                return
            demand = [w for w in waiting if w.priority == DEMAND]
            if demand:
                chosen = min(demand, key=lambda w: w.seq)
            elif self._free > self._keep:
                urgency = self._urgency
                chosen = min(waiting, key=lambda w: (urgency(w.key) if urgency else 0.0, w.seq))
            else:
                return
            self._waiters.remove(chosen)
            self._free -= 1
            chosen.fut.set_result(None)


# I25: a slot is held for a GET, not for the local work after it.
class Held:
    """One download's hold on a slot of ``slots``, taken before it is made: given back
    with :meth:`give_back` (at most once per take), and taken again with :meth:`take`
    for another GET."""

    __slots__ = ("_held", "_slots")

    def __init__(self, slots: PrioritySlots) -> None:
        self._slots = slots
        self._held = True

    async def take(self, priority: int, key: str = "") -> None:
        """Hold a slot again, if it was given back (``acquire``'s arguments)."""
        if not self._held:
            await self._slots.acquire(priority, key)
            self._held = True

    def give_back(self) -> None:
        """Release the slot, unless it is not held."""
        if self._held:
            self._held = False
            self._slots.release()
