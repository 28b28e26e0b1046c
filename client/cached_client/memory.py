"""glibc allocator tuning for the processes that read from the daemon.

A reader allocates and frees a few MiB of frames per reply (in ZeroMQ's I/O thread and in
Python). By default glibc hands that memory back to the kernel (trimming the heap,
unmapping large blocks, shrinking thread arenas) and the next reply page-faults it back
in: ~22 faults per 100 KB sample, a third of a reader's time in the kernel. Keeping the
freed memory cut the faults 15-fold on the fast path (docs/benchmarks.md).

The tuning is process-wide. ``$CACHED_CLIENT_MALLOC`` chooses it (docs/decisions.md D18
has the measurements):

- ``keep`` (default): keep up to 256 MiB of freed heap, serve blocks under 8 MiB from the
  heap. It also helps the training process's own threads, whose tensors glibc otherwise
  hands back to the kernel and faults in again;
- ``single-arena``: ``keep``, and one malloc arena for all threads. Measured no better in
  DataLoader workers and slower in a training process (its other threads contend for
  the one arena's lock); kept as an explicit choice;
- ``off``: leave the allocator alone.
"""

from __future__ import annotations

import ctypes
import os

from .errors import UsageError

ENV = "CACHED_CLIENT_MALLOC"
MODES = ("keep", "single-arena", "off")

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
    """``mode``, else ``$CACHED_CLIENT_MALLOC``, else ``keep``. Raises ``UsageError`` (a
    ``ValueError``) on an unknown name."""
    chosen = (mode or os.environ.get(ENV) or "keep").strip().lower()
    if chosen not in MODES:
        raise UsageError(f"{ENV}={chosen!r}: expected one of {', '.join(MODES)}")
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
