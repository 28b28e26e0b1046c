"""The last minutes of the daemon's numbers, for the dashboard at ``/`` (``GET /history``).

Every ``interval_s`` one sample of cumulative figures is taken from the daemon's
``status()`` and kept for ``keep_s``. Samples are cumulative on purpose: the page derives
rates (bytes/s) and per-interval wait fractions from the differences of neighbours, and a
sample that is lost or late changes nothing but the resolution.

It runs on the daemon's event loop, so a sample costs what one ``/status`` costs, and no
more: a few dict lookups on the dict ``status()`` already built.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

INTERVAL_S = 2.0
KEEP_S = 600.0


def sample_of(status: dict[str, Any], t: float) -> dict[str, Any]:
    """One sample from a ``/status`` dict, taken at Unix time ``t``.

    ``{"t", "hot_used_bytes", "hot_capacity_bytes", "hits", "misses", "demand_misses",
    "fetched_bytes", "served_bytes", "served_samples", "lead_s", "store_reachable",
    "jobs": {name: {"wait_s", "loop_s", "batches"}}}``; every figure is cumulative except
    the hot tier's bytes, ``lead_s`` (None: everything planned is resident) and
    ``store_reachable``.
    """
    hot = status.get("hot") or {}
    counters = status.get("counters") or {}
    prefetch = status.get("prefetch") or {}
    store = status.get("store")
    return {
        "t": round(t, 3),
        "hot_used_bytes": hot.get("used_bytes", 0),
        "hot_capacity_bytes": hot.get("capacity_bytes", 0),
        "hits": counters.get("hits", 0.0),
        "misses": counters.get("misses", 0.0),
        "demand_misses": counters.get("demand_misses", 0.0),
        "fetched_bytes": counters.get("fetched_bytes", 0.0),
        "served_bytes": counters.get("served_bytes", 0.0),
        "served_samples": counters.get("served_samples", 0.0),
        "lead_s": prefetch.get("lead_s"),
        # No fetcher yet (None): nothing has failed, so nothing says it is unreachable.
        "store_reachable": bool(store.get("reachable", True)) if store else True,
        "jobs": {
            str(job["job"]): {
                "wait_s": job.get("wait_s", 0.0),
                "loop_s": job.get("loop_s", 0.0),
                "batches": job.get("batches", 0),
            }
            for job in status.get("jobs") or ()
        },
    }


class History:
    """Samples of ``status()`` every ``interval_s``, the last ``keep_s`` of them.

    ``await history.run()`` samples until cancelled; :meth:`snapshot` is what
    ``GET /history`` answers.
    """

    def __init__(
        self,
        status: Callable[[], dict[str, Any]],
        interval_s: float = INTERVAL_S,
        keep_s: float = KEEP_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.status = status
        self.interval_s = interval_s
        self.keep_s = keep_s
        self.clock = clock
        # Bounded by count, so memory is fixed whatever the clock does (+1: both ends of
        # the window).
        self.samples: deque[dict[str, Any]] = deque(maxlen=math.ceil(keep_s / interval_s) + 1)
        self._failing = False

    def sample(self) -> dict[str, Any]:
        """Take one sample now and keep it."""
        taken = sample_of(self.status(), self.clock())
        self.samples.append(taken)
        return taken

    async def run(self) -> None:
        """Sample every ``interval_s`` until cancelled."""
        while True:
            try:
                self.sample()
                if self._failing:
                    log.info("the dashboard's history samples again")
                self._failing = False
            except Exception:
                # The dashboard must never take the daemon down: a task that dies ends
                # serve_until. Say so once, keep the samples there are, and try again.
                if not self._failing:
                    log.exception("cannot sample the dashboard's history; retrying")
                self._failing = True
            await asyncio.sleep(self.interval_s)

    def snapshot(self) -> dict[str, Any]:
        """``{"interval_s", "keep_s", "samples": [...]}``, oldest sample first (JSON-able)."""
        return {"interval_s": self.interval_s, "keep_s": self.keep_s, "samples": list(self.samples)}
