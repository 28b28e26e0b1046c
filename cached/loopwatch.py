"""How long the event loop stalls: a task sleeps a short tick and measures how late it wakes.

Everything the daemon does runs on one event loop, so any blocking work there (a large
unlink, a long plan parsed in place, a slow scan) delays every client at once. The lateness
of a periodic wake-up is that delay, measured from inside, all the time, for the cost of one
timer per tick. It feeds ``cached_event_loop_lag_seconds`` and ``/status`` ("loop").
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from prometheus_client import Histogram

# The tick: short enough to see a stall of a few ms, long enough to cost nothing.
TICK_S = 0.025
# The "recent" worst covers this long.
WINDOW_S = 60.0


class LoopWatch:
    """Run :meth:`run` as a task on the loop to watch."""

    def __init__(self, histogram: Histogram, tick_s: float = TICK_S) -> None:
        self.histogram = histogram
        self.tick_s = tick_s
        self.worst_s = 0.0
        self._recent: deque[tuple[float, float]] = deque()  # (when, lag), lags > 1 ms only

    async def run(self) -> None:
        """Tick until cancelled."""
        while True:
            start = time.monotonic()
            await asyncio.sleep(self.tick_s)
            now = time.monotonic()
            self.record(now, max(0.0, now - start - self.tick_s))

    def record(self, now: float, lag: float) -> None:
        """Count one wake-up that came ``lag`` seconds late."""
        self.histogram.observe(lag)
        self.worst_s = max(self.worst_s, lag)
        if lag > 0.001:
            self._recent.append((now, lag))
        while self._recent and self._recent[0][0] < now - WINDOW_S:
            self._recent.popleft()

    def recent_worst_s(self) -> float:
        """The worst lag of the last minute."""
        horizon = time.monotonic() - WINDOW_S
        return max((lag for when, lag in self._recent if when >= horizon), default=0.0)
