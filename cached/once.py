"""One task per key: callers asking for the same thing at once await one task; and a
future's failure marked seen where nobody may be left to await it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Hashable
from typing import Any, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


async def joined(
    tasks: dict[K, asyncio.Task[T]],
    key: K,
    start: Callable[[], Coroutine[Any, Any, T]],
    name: str,
) -> T:
    """The result of the task ``tasks[key]``, started with ``start()`` where none runs;
    it leaves ``tasks`` when it ends. Shielded: a caller cancelled stops waiting, not
    the task the others wait for."""
    task = tasks.get(key)
    if task is None:
        task = asyncio.get_running_loop().create_task(start(), name=name)
        tasks[key] = task
        task.add_done_callback(lambda _t: tasks.pop(key, None))
    return await asyncio.shield(task)


def seen(done: asyncio.Future[Any]) -> None:
    """Mark a failure as seen (a done callback): one that nobody awaits any more (every
    asker gone, or a request ended on purpose) was logged or handled where it happened,
    and must not come back as asyncio's "Future exception was never retrieved". Awaiters
    still get it."""
    if not done.cancelled():
        done.exception()
