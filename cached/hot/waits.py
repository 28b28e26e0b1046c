"""The hot tier's waits, each held to a deadline and reported.

A reservation waits for two things: room (readers' pins to go, downloads under way to
settle, the disk to free up) and evicted files to leave the disk (their worker thread's
unlink: slow on a busy disk, or while the worker pool is busy with MD5 and index jobs).
Neither waits past its deadline, and each reports what it waited for, how long, and
whether the deadline ran out (``cached_hot_wait_seconds{wait}``,
``cached_hot_wait_timeouts_total{wait}``; docs/observability.md).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Final

# What a wait was for: a metric label.
ROOM: Final = "room"
UNLINK: Final = "unlink"
WAITS: Final = (ROOM, UNLINK)

# ``on_wait(wait, seconds, timed_out)``: one call per kind of wait a reservation made.
OnWait = Callable[[str, float, bool], None]


class Waits:
    """One reservation's waits, each kind until its deadline (``time.monotonic()``),
    reported to the listeners ``listeners()`` gives once the reservation ends (:meth:`done`)."""

    def __init__(self, deadlines: dict[str, float], listeners: Callable[[], list[OnWait]]) -> None:
        self._deadlines = deadlines
        self._listeners = listeners
        self._spent: dict[str, float] = {}

    def left(self, wait: str) -> float:
        """Seconds until the deadline of ``wait`` (0 or less: it has passed)."""
        return self._deadlines[wait] - time.monotonic()

    async def wait(
        self, wait: str, changed: Callable[[float], Awaitable[None]], step: float
    ) -> None:
        """Wait for ``changed`` (a wake-up, or ``step`` seconds at most, never past the
        deadline of ``wait``), counted as time spent on ``wait``."""
        started = time.monotonic()
        await changed(max(0.0, min(self.left(wait), step)))
        self._spent[wait] = self._spent.get(wait, 0.0) + time.monotonic() - started

    def done(self, timed_out: str | None = None) -> None:
        """The reservation ended: report each kind it waited for (``timed_out``: the one
        whose deadline ran out, reported even when it had not waited)."""
        if timed_out is not None:
            self._spent.setdefault(timed_out, 0.0)
        for listener in self._listeners():
            for wait, seconds in self._spent.items():
                listener(wait, seconds, wait == timed_out)
