"""One daemon per hot tier: an exclusive ``flock`` on ``<cache dir>/.lock``, holding the PID.

Two daemons sharing a directory would delete each other's work: each removes the other's
``*.partial`` downloads at start and evicts the other's shards to fit its own capacity. The
lock is taken before anything in the directory is touched. It is a ``flock`` because the
kernel drops it with the process, however it dies: a SIGKILLed daemon's successor starts
without anyone cleaning up. The file itself stays (removing a lock file races with the next
daemon opening it); the hot tier's scan leaves it alone (it is neither a ``.tar``, an
``.idx`` nor a ``.partial``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path
from types import TracebackType

from .errors import CachedError

LOCK_NAME = ".lock"


class DirectoryInUse(CachedError):
    """Another daemon holds the hot tier directory's lock."""


class DirLock:
    """An exclusive, non-blocking lock on a directory; a context manager (release on exit).

    ``what`` names the directory in messages (e.g. ``"[cache] dir"``).
    """

    def __init__(self, directory: Path, what: str = "[cache] dir") -> None:
        self.directory = directory
        self.path = directory / LOCK_NAME
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, creating the directory and the lock file if needed.

        Raises :class:`DirectoryInUse` naming the directory and the holder's PID, or
        :class:`CachedError` when the directory or the lock file cannot be used.
        """
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # Not O_TRUNC: the holder's PID must survive until we know we hold the lock.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise CachedError(
                f"cannot use the hot tier directory {self.directory} ({self.what}): "
                f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
            ) from exc
        try:
            # I70: one daemon per tier.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_pid(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise CachedError(
                    f"cannot lock the hot tier directory {self.directory} ({self.what}): "
                    f"{exc.strerror or exc}: {self.path}"
                ) from exc
            who = f"PID {holder}" if holder else "a process whose PID is not recorded yet"
            raise DirectoryInUse(
                f"another cached daemon ({who}) is already serving from the hot tier "
                f"directory {self.directory} ({self.what}); each daemon needs its own: stop "
                f"that one, or choose another {self.what}"
            ) from exc
        # Ours now: record who holds it, for the message above in the next daemon.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (closing the descriptor releases the flock)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DirLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    """The PID the holder wrote, or None (an empty file: it has not written it yet)."""
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).decode().strip())
    return None
