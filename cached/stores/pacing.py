"""The node's share of the store's request rate: one paced budget for every request.

A store limits requests per second (S3: about 5,500 GETs per prefix, less while it
scales; Ceph RGW and MinIO as their operators set them) and answers 503 SlowDown
beyond. N nodes starting cold together each fetch as fast as they can; without a budget
they all run into SlowDown and, after a few retries, fail their reads.

:class:`RequestPacer` is a token bucket whose rate follows AIMD, as TCP's window does:

- ``[s3] max_requests_per_s`` is the ceiling, this node's share (the store's limit over
  the nodes). 0 sets none: the pacer lets every request go until the store first says
  SlowDown, and from then on paces at half the rate it was sending at;
- a SlowDown halves the rate (multiplicative decrease), once per round: the answers to
  requests sent before the last decrease were already counted by it. The rate stays
  above a floor (1/64 of the ceiling; 1 request/s without one), where a SlowDown counts
  against the request's attempts again;
- each request that succeeds adds ``step / rate`` (additive increase: ``step`` requests/s
  per second of full use), up to the ceiling;
- the bucket holds at most one token, so the pace is even (no burst beyond one request
  and the parts of one GET), and it starts at a random fraction of one, so that nodes
  started together send their first requests spread over one interval, not at once.

A request of ``n`` parts (awscrt sends a GET's parts at once) takes ``n`` tokens: it
waits for one, and leaves the bucket in debt for the rest, which the next request waits
out. Waiters go first come, first served.
"""

from __future__ import annotations

import asyncio
import collections
import math
import random
import time
from collections.abc import Callable

# The rate never drops below this fraction of the ceiling: a floor that still makes
# progress. At the floor a SlowDown counts against the request's attempts.
_FLOOR_SHARE = 1 / 64
# With no ceiling, the floor in requests/s: the daemon does not know how many nodes
# share the store; should this many per node still be too many, the operator sets each
# node's share ([s3] max_requests_per_s).
_OPEN_FLOOR = 1.0
# Additive increase per second of full use, as a fraction of the ceiling (or of the rate
# first throttled at): back to the ceiling about 4 s after a halving.
_STEP_SHARE = 1 / 8
# The window over which the sent rate is measured, for the first decrease without a
# ceiling, and the shortest span it is measured over.
_WINDOW_S = 1.0
_MIN_SPAN_S = 0.1


# I29, I30: nodes start at the rate the store allows; without shares no read fails.
class RequestPacer:
    """A request budget shared by every request to one S3 endpoint.

    ``ceiling``: requests per second this node may send, at most; 0: no ceiling (the
    pacer stays open until the first SlowDown). Call :meth:`acquire` before sending,
    then :meth:`succeeded` or :meth:`throttled` with what it returned.
    """

    def __init__(
        self,
        ceiling: float = 0.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if not ceiling >= 0 or math.isinf(ceiling):
            raise ValueError(f"max_requests_per_s must be a finite number >= 0, not {ceiling}")
        self.ceiling = ceiling
        self._clock = clock
        self._turn = asyncio.Lock()
        # While open: (when, how many) of the last second's requests.
        self._sent_at: collections.deque[tuple[float, int]] = collections.deque()
        self._stamp = clock()
        # A random start: nodes started together spread their first requests.
        self._tokens = (rng or random).random()
        self._last_decrease = -math.inf
        self.rate = ceiling or math.inf
        self._floor = ceiling * _FLOOR_SHARE
        self._step = ceiling * _STEP_SHARE
        self.requests = 0
        self.throttles = 0
        self.decreases = 0
        self.waited_s = 0.0

    @property
    def paced(self) -> bool:
        """Whether requests wait for the budget (a ceiling is set, or the store throttled)."""
        return not math.isinf(self.rate)

    async def acquire(self, n: int = 1) -> float:
        """Wait until ``n`` requests may go; returns the moment they go (for
        :meth:`throttled`). ``n`` = 0 takes nothing and does not wait."""
        if n <= 0:
            return self._clock()
        if not self.paced:
            return self._sent(n)
        async with self._turn:
            started = self._clock()
            while True:
                now = self._refill()
                if self._tokens >= 1.0:
                    break
                await asyncio.sleep((1.0 - self._tokens) / self.rate)
            self.waited_s += now - started
            self._tokens -= n
            return self._sent(n)

    def _refill(self) -> float:
        now = self._clock()
        if self.paced:
            self._tokens = min(1.0, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        return now

    def _sent(self, n: int) -> float:
        now = self._clock()
        self.requests += n
        if not self.paced:
            # Kept only while open: the rate to halve at the first SlowDown.
            self._sent_at.append((now, n))
            while self._sent_at[0][0] < now - _WINDOW_S:
                self._sent_at.popleft()
        return now

    def succeeded(self, n: int = 1) -> None:
        """``n`` requests were answered (not throttled): raise the rate a little."""
        if self.paced:
            self._refill()
            rate = self.rate + self._step * n / self.rate
            self.rate = min(self.ceiling, rate) if self.ceiling else rate

    def throttled(self, sent_at: float) -> bool:
        """A request sent at ``sent_at`` was answered SlowDown (or 503, 429): halve the
        rate, unless a decrease since it was sent already did. Returns whether the
        request may be retried at no cost to its attempts: True while the rate is above
        its floor (the budget slows down instead), False at the floor."""
        self.throttles += 1
        now = self._refill()
        if sent_at < self._last_decrease:
            return True  # that round's decrease covers it
        if not self.paced:
            recent = [(t, n) for t, n in self._sent_at if t >= now - _WINDOW_S]
            self._sent_at.clear()
            # Over the time it took to send them: a cold start's burst is a high rate.
            span = max(_MIN_SPAN_S, now - recent[0][0]) if recent else _WINDOW_S
            self.rate = max(_OPEN_FLOOR, sum(n for _, n in recent) / span)
            self._floor = _OPEN_FLOOR
            self._step = self.rate * _STEP_SHARE
        at_floor = self.rate <= self._floor
        self.rate = max(self._floor, self.rate / 2)
        self._tokens = min(self._tokens, 0.0)
        self._last_decrease = now
        self.decreases += 1
        return not at_floor
