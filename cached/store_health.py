"""Whether the remote store answers: the daemon's view, for the log, ``/status`` and the
fetcher's choice to serve resident shards without asking the store.

A request that gives up on transient failures (:class:`StoreUnavailable`: 5xx, resets,
timeouts after the retry budget) may be about its object alone: one key that answers 500,
or whose connection is reset, every time. That fails reads of that object only. An outage
starts on evidence about the endpoint: a request that could not connect at all, one tied
to no object, or requests for ``OUTAGE_OBJECTS`` different objects giving up with no
answer from the store in between. It ends with the next answer of any kind, a 404
included. Each start and end is logged once.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger(__name__)

# Requests for this many different objects giving up in a row (no answer in between) make
# an outage; fewer are those objects' own trouble. Above 2: two bad keys read at once by a
# prefetcher must not stop the fetches of every healthy one.
OUTAGE_OBJECTS = 3


class StoreHealth:
    """Reachable or not, and since when (Unix time)."""

    def __init__(self) -> None:
        self.reachable = True
        self.since = time.time()
        self.last_error: str | None = None
        self._down_at = 0.0  # monotonic start of the outage
        self.offline_opens = 0  # opens answered from the hot tier during this outage
        # The objects whose requests gave up since the store last answered.
        self._failing: dict[str, None] = {}

    # I31: one object's failure is its own.
    def failed(self, error: BaseException, url: str | None = None) -> bool:
        """A request about ``url`` (None: about no object) gave up on transient failures;
        True if this starts an outage (see the module's docstring for when it does)."""
        if not self.reachable:
            self.last_error = str(error)
            return False
        if url is not None and not getattr(error, "no_connection", False):
            self._failing[url] = None
            if len(self._failing) < OUTAGE_OBJECTS:
                return False
            evidence = f"requests for {len(self._failing)} different objects gave up"
        else:
            evidence = "no connection to the endpoint" if url is not None else "a request gave up"
        self._failing.clear()
        self.last_error = str(error)
        self.reachable = False
        self.since = time.time()
        self._down_at = time.monotonic()
        self.offline_opens = 0
        log.warning(
            "the object store is unreachable: %s (%s). Serving the shards the hot tier "
            "holds, as they are, until it answers again; shards it lacks cannot be fetched",
            error,
            evidence,
        )
        return True

    def answered(self) -> None:
        """The store answered a request; ends an outage, and clears the failures of
        single objects counted towards one."""
        self._failing.clear()
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
