"""Work a request hands to a worker thread: in a pool of its own, at most a few jobs of one
user at a time.

A request's work off the event loop (a large header decoded, a long plan or dataset
checked and indexed, a large read's checksums) ran in asyncio's default executor, beside
the fetch path's (MD5s, indexes, sidecars, unlinks). One user's burst of long plans queued
everyone's downloads behind it, and a held native open waits for those jobs (its body is
dropped past 5 s). So request work has its own threads (``THREADS``), and each user at most
``PER_USER`` jobs at once: the rest wait their turn on the event loop, each holding only its
request's slot, which ``[server] max_requests_per_client`` and the request bytes in flight
already bound.
"""

from __future__ import annotations

import asyncio
import functools
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

# Threads for requests' work; the default executor keeps the fetch path's.
THREADS = 4
# Jobs of one user running at once (the others wait on the event loop): a user's burst
# leaves THREADS - PER_USER threads to everyone else.
PER_USER = 2


class Offload:
    """The request pool. ``await offload.run(user, fn, *args)`` is ``fn(*args)`` in a worker
    thread once ``user`` has fewer than ``per_user`` jobs running."""

    def __init__(self, threads: int = THREADS, per_user: int = PER_USER) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="cached-request")
        self.per_user = per_user
        self._turns: dict[str, asyncio.Semaphore] = {}
        self._jobs: Counter[str] = Counter()  # running and waiting, per user

    def jobs(self, user: str | None = None) -> int:
        """Jobs running or waiting: ``user``'s, or everyone's."""
        return self._jobs[user] if user is not None else sum(self._jobs.values())

    async def run(self, user: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in the pool, in ``user``'s turn. Cancelled, a job not
        started is dropped; one running finishes in its thread (threads cannot be
        interrupted) while its turn is freed at once, so the pool holds at most ``threads``
        such jobs besides each user's ``per_user``."""
        turn = self._turns.get(user)
        if turn is None:
            turn = self._turns[user] = asyncio.Semaphore(self.per_user)
        self._jobs[user] += 1
        try:
            async with turn:
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(
                    self._pool, functools.partial(fn, *args, **kwargs)
                )
        finally:
            self._jobs[user] -= 1
            if not self._jobs[user]:
                del self._jobs[user]
                del self._turns[user]

    def close(self) -> None:
        """Stop the threads once their jobs end; queued ones are dropped."""
        self._pool.shutdown(wait=False, cancel_futures=True)
