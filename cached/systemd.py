"""Talking to systemd: the sd_notify protocol (``READY=1``, ``STATUS=``, ``WATCHDOG=1``).

Outside systemd (no ``$NOTIFY_SOCKET``) every call is a no-op, so the daemon calls these
unconditionally. The protocol is one datagram per message on a unix socket; written here
rather than taken from a library because it is ten lines and the daemon must not depend on
libsystemd being installed.
"""

from __future__ import annotations

import contextlib
import os
import socket


class Notifier:
    """Sends state changes to systemd. Reads ``$NOTIFY_SOCKET`` and ``$WATCHDOG_USEC``
    (and ``$WATCHDOG_PID``, which names the process that must ping) once, at construction."""

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET", "")
        # "@name" is an abstract socket; its address starts with a NUL byte.
        self._address = "\0" + path[1:] if path.startswith("@") else path
        self._watchdog_s: float | None = None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self._watchdog_s = int(usec) / 1e6

    @property
    def enabled(self) -> bool:
        """Whether systemd listens (the process runs as a ``Type=notify`` service)."""
        return bool(self._address)

    @property
    def watchdog_interval_s(self) -> float | None:
        """How often to send ``WATCHDOG=1``: half of ``WatchdogSec=``, as sd_watchdog_enabled(3)
        advises; None when the unit sets no watchdog."""
        return None if self._watchdog_s is None else self._watchdog_s / 2

    def notify(self, *assignments: str) -> None:
        """Send ``KEY=VALUE`` lines in one datagram (e.g. ``"READY=1", "STATUS=serving"``).
        Errors are ignored: a lost status line must never stop the daemon."""
        if not self._address:
            return
        message = "\n".join(assignments).encode()
        with (
            contextlib.suppress(OSError),
            socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s,
        ):
            s.connect(self._address)
            s.sendall(message)
