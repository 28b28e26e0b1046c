"""Where the daemon listens, and why it gave no handshake there.

:func:`resolve_endpoint` picks the endpoint (an argument, ``$CACHED_SOCKET``, the default).
:func:`explain_unreachable` is the hint in a :class:`DaemonUnavailable` message: ZeroMQ's
``connect`` never fails (it retries in the background), so an unreadable socket, a missing
one and a stopped daemon all look alike (no answer). For an ``ipc://`` endpoint a plain
unix-socket connect tells them apart by its errno, which is what a user needs to know: a
permission problem is fixed by an administrator, not by starting the daemon.

The lowest floor of the receive layer: the transport, the loaders and ``cached diagnose``
import it; it imports only the protocol's names.
"""

from __future__ import annotations

import grp
import os
import pwd
import socket
import stat

from cached_wire.protocol import DEFAULT_SOCKET, SOCKET_ENV

_NOT_RUNNING = "is `cached serve` running?"


def resolve_endpoint(socket: str | None) -> str:
    """``socket`` if given, else ``$CACHED_SOCKET``, else the daemon's default endpoint."""
    return socket or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET


def explain_unreachable(endpoint: str) -> str:
    """A short reason, with what to do, for an endpoint that gave no handshake."""
    if not endpoint.startswith("ipc://"):
        return f"{_NOT_RUNNING} (or set ${SOCKET_ENV} to where it listens)"
    path = endpoint[len("ipc://") :]
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except PermissionError:
        return (
            f"permission denied on {path}{_owner(path)}: connecting needs write permission on "
            "the socket and search permission on its directory; ask the administrator to add "
            "you to the socket's group (docs/operations.md, 'Permissions for training users')"
        )
    except FileNotFoundError:
        parent = os.path.dirname(path)
        where = f"{parent} does not exist" if not os.path.isdir(parent) else f"no socket at {path}"
        return f"{where}; {_NOT_RUNNING} (or set ${SOCKET_ENV} to where it listens)"
    except ConnectionRefusedError:
        return f"nothing listens on {path} (a socket left by a daemon that stopped); {_NOT_RUNNING}"
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}; {_NOT_RUNNING}"
    finally:
        probe.close()
    return (
        f"{path} accepts connections but no cached daemon answered in time "
        "(another program's socket, or a daemon too busy to answer?)"
    )


def _owner(path: str) -> str:
    """`` (srwxrwx--- cached:cached)`` when the socket can be looked at, else ``""``."""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    try:
        user = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        user = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f" ({stat.filemode(st.st_mode)} {user}:{group})"
