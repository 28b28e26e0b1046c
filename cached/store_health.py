"""Whether the remote store answers: the daemon's view, for the log, ``/status`` and the
fetcher's choice to serve resident shards without asking the store.

An outage starts when a request to the store gives up on transient failures (connections
refused or reset, timeouts, 5xx after the retry budget: :class:`StoreUnavailable`) and
ends with the next answer of any kind, a 404 included. Each start and end is logged once.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger(__name__)


class StoreHealth:
    """Reachable or not, and since when (Unix time)."""

    def __init__(self) -> None:
        self.reachable = True
        self.since = time.time()
        self.last_error: str | None = None
        self._down_at = 0.0  # monotonic start of the outage
        self.offline_opens = 0  # opens answered from the hot tier during this outage

    def failed(self, error: BaseException) -> bool:
        """The store did not answer; True if this starts an outage."""
        self.last_error = str(error)
        if not self.reachable:
            return False
        self.reachable = False
        self.since = time.time()
        self._down_at = time.monotonic()
        self.offline_opens = 0
        log.warning(
            "the object store is unreachable: %s. Serving the shards the hot tier holds, as "
            "they are, until it answers again; shards it lacks cannot be fetched",
            error,
        )
        return True

    def answered(self) -> None:
        """The store answered a request; ends an outage."""
        if self.reachable:
            return
        self.reachable = True
        self.since = time.time()
        log.warning(
            "the object store answers again after %.1fs unreachable; %d opens were served "
            "from the hot tier meanwhile",
            time.monotonic() - self._down_at,
            self.offline_opens,
        )

    def down_s(self) -> float:
        """Seconds the current outage has lasted (0 while reachable)."""
        return 0.0 if self.reachable else time.monotonic() - self._down_at

    def status(self) -> dict[str, Any]:
        """For ``/status``: ``{"reachable": bool, "since": unix_time, "last_error": str|None}``."""
        return {
            "reachable": self.reachable,
            "since": round(self.since, 3),
            "last_error": None if self.reachable else self.last_error,
        }
