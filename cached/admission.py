"""Which accepted connections the daemon keeps: a cap per local user, one in total, and the
descriptor reserve (cached/descriptors.py), decided as each accept is reported.

libzmq accepts every connection its listener is offered and cannot be told to refuse one
(and its ipc listener aborts the process on EMFILE). So a connection past a cap is shut
(``shutdown(2)`` on libzmq's own descriptor) the moment the socket monitor reports it: the
peer reads end-of-file, libzmq sees it too and closes the descriptor, and the monitor
reports the disconnection. A shut connection's messages are never handled (cached/peers.py
treats its descriptor as not accepted). The user is the uid from ``SO_PEERCRED`` on the
accepted socket: an ipc peer's kernel credentials, which a client cannot choose; a tcp
connection counts against the total only.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")  # pid, uid, gid
# A user's refusals are logged at most this often (a flood is one line a minute).
LOG_EVERY_S = 60.0


@dataclass(frozen=True)
class ConnectionCaps:
    """The caps: connections per local user, in total, and the descriptor number from
    which every accept is refused (the reserve)."""

    per_user: int
    total: int
    refuse_from: int


def peer_uid(fd: int) -> int | None:
    """The uid of the process at the other end of the unix socket ``fd`` (None for a tcp
    socket). Raises OSError where ``fd`` is no longer a socket."""
    sock = socket.socket(fileno=fd)
    try:
        if sock.family != socket.AF_UNIX:
            return None
        _, uid, _ = _UCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
        return int(uid)
    finally:
        sock.detach()  # libzmq's descriptor: never closed here


def shut(fd: int) -> None:
    """End the connection on libzmq's descriptor ``fd`` without closing it: libzmq reads
    end-of-file and closes it itself."""
    sock = socket.socket(fileno=fd)
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # it went already: libzmq closes it
    finally:
        sock.detach()


class Admission:
    """Counts the connections kept, by user; :meth:`accepted` says whether to keep a new
    one (and shuts it if not), :meth:`closed` forgets one. Thread-safe: accepts are taken
    in a thread of their own (cached/peers.py), status reads on the event loop."""

    def __init__(
        self, caps: ConnectionCaps, on_refused: Callable[[str], None] = lambda reason: None
    ) -> None:
        self.caps = caps
        self._on_refused = on_refused
        self._user_of: dict[int, str] = {}  # kept descriptor -> user ("" for tcp)
        self._per_user: Counter[str] = Counter()
        self._logged: dict[str, float] = {}
        self._lock = threading.Lock()
        self.refused = 0

    def __len__(self) -> int:
        return len(self._user_of)

    def accepted(self, fd: int) -> bool:
        """A connection accepted on ``fd``: True if it is kept, False if it was shut (a cap,
        or the reserve)."""
        try:
            uid = peer_uid(fd)
        except OSError:
            return False  # closed before we looked: nothing to keep
        with self._lock:
            return self._admit(fd, "" if uid is None else f"uid {uid}")

    def _admit(self, fd: int, user: str) -> bool:
        refusal = self._refusal(fd, user)
        if refusal is None:
            self._user_of[fd] = user
            self._per_user[user] += 1
            return True
        shut(fd)
        self.refused += 1
        self._on_refused(refusal[0])
        self._log(user or "a tcp client", refusal[1])
        return False

    def _refusal(self, fd: int, user: str) -> tuple[str, str] | None:
        """(reason, why) where a new connection on ``fd`` from ``user`` passes a bound."""
        caps = self.caps
        if fd >= caps.refuse_from:
            return "descriptors", (
                f"descriptor {fd} is in the reserve (from {caps.refuse_from}): the daemon "
                "keeps it for what it opens itself"
            )
        if len(self._user_of) >= caps.total:
            return "total", (
                f"{len(self._user_of)} connections are open, the most the daemon keeps "
                f"([server] max_connections = {caps.total}, or what the descriptor limit "
                "allows)"
            )
        if user and self._per_user[user] >= caps.per_user:
            return "user", (
                f"{user} has {self._per_user[user]} connections open, the most one user may "
                f"have ([server] max_connections_per_user = {caps.per_user})"
            )
        return None

    def closed(self, fd: int) -> None:
        """The connection on ``fd`` closed (kept or not)."""
        with self._lock:
            user = self._user_of.pop(fd, None)
            if user is None:
                return
            self._per_user[user] -= 1
            if not self._per_user[user]:
                del self._per_user[user]

    def by_user(self) -> dict[str, int]:
        """Connections kept per user (tcp ones under "tcp")."""
        with self._lock:
            return {user or "tcp": n for user, n in self._per_user.items()}

    def _log(self, user: str, why: str) -> None:
        now = time.monotonic()
        if now - self._logged.get(user, -LOG_EVERY_S) < LOG_EVERY_S:
            return
        self._logged[user] = now
        if len(self._logged) > 4096:  # one entry per user seen refusing: bounded anyway
            self._logged.clear()
        log.warning(
            "a new connection from %s was shut: %s (%d refused so far; logged once a minute)",
            user,
            why,
            self.refused,
        )
