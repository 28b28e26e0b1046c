"""glibc allocator tuning for the processes that read from the daemon.

A reader allocates and frees a few MiB of frames per reply (in ZeroMQ's I/O thread and in
Python). By default glibc hands that memory back to the kernel (trimming the heap,
unmapping large blocks, shrinking thread arenas) and the next reply page-faults it back
in: ~22 faults per 100 KB sample, a third of a reader's time in the kernel. Keeping the
freed memory cut the faults 15-fold on the fast path (docs/benchmarks.md).

The tuning is process-wide, so it is chosen per kind of process (``$CACHED_CLIENT_MALLOC``
overrides it; docs/decisions.md D18 has the measurements):

- ``keep``: keep up to 256 MiB of freed heap, serve blocks under 8 MiB from the heap;
- ``single-arena``: ``keep``, and one malloc arena for all threads (ZeroMQ's I/O thread
  then reuses the main arena's freed frames). Only for processes that do nothing but
  read: a training process's other threads (autograd, NCCL, pin-memory) would contend
  for that one arena's lock;
- ``off``: leave the allocator alone;
- ``auto`` (default): ``single-arena`` in a DataLoader worker, ``keep`` elsewhere.
"""

from __future__ import annotations

import ctypes
import os
import sys

from .errors import UsageError

ENV = "CACHED_CLIENT_MALLOC"
MODES = ("auto", "keep", "single-arena", "off")

# glibc <malloc.h> parameter numbers.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

_KEEP = ((_M_TRIM_THRESHOLD, 256 << 20), (_M_MMAP_THRESHOLD, 8 << 20))
_SETTINGS: dict[str, tuple[tuple[int, int], ...]] = {
    "keep": _KEEP,
    "single-arena": (*_KEEP, (_M_ARENA_MAX, 1)),
    "off": (),
}

_tuned: tuple[int, str] | None = None  # (pid, mode applied)


def resolve_mode(mode: str | None = None) -> str:
    """The concrete mode for this process: ``mode``, else ``$CACHED_CLIENT_MALLOC``, else
    ``auto``; ``auto`` becomes ``single-arena`` in a DataLoader worker, else ``keep``.
    Raises ``UsageError`` (a ``ValueError``) on an unknown name."""
    chosen = (mode or os.environ.get(ENV) or "auto").strip().lower()
    if chosen not in MODES:
        raise UsageError(f"{ENV}={chosen!r}: expected one of {', '.join(MODES)}")
    if chosen == "auto":
        return "single-arena" if _in_dataloader_worker() else "keep"
    return chosen


def tune_malloc(mode: str | None = None) -> str:
    """Apply the allocator tuning once per process (before ZeroMQ starts its threads);
    returns the mode in force. A no-op off glibc."""
    global _tuned
    pid = os.getpid()
    if _tuned is not None and _tuned[0] == pid:
        return _tuned[1]
    chosen = resolve_mode(mode)
    _tuned = (pid, chosen)
    try:
        libc = ctypes.CDLL("libc.so.6")
        for param, value in _SETTINGS[chosen]:
            libc.mallopt(param, value)
    except (OSError, AttributeError):
        pass
    return chosen


def _in_dataloader_worker() -> bool:
    # Without torch loaded there is no DataLoader (and the daemon, which shares the
    # transport, must not pay for importing torch).
    data = sys.modules.get("torch.utils.data")
    return data is not None and data.get_worker_info() is not None
