"""Who may connect to the ipc socket: ``[server] socket_mode`` and ``socket_group``.

Connecting to a unix socket needs write permission on the socket file. ZeroMQ's bind
creates it ``0777 & ~umask``, so without this module the daemon's umask alone would decide
who may connect (and a permissive umask for the socket's sake would loosen every other
file the daemon writes). The daemon sets the mode and group explicitly right after bind,
whatever the umask. Before that moment the socket has the umask's mode; with a
restrictive umask (the shipped unit's ``UMask=0077``) that is narrower, never wider.
"""

from __future__ import annotations

import grp
import os

from .errors import CachedError


def parse_mode(mode: str) -> int:
    """``"0660"`` -> ``0o660`` (the config has checked the digits)."""
    return int(mode, 8)


def resolve_group(group: str | None) -> int | None:
    """The gid of ``[server] socket_group`` (a name or a number); None keeps the daemon's
    group. Raises :class:`CachedError` for a group this system does not know."""
    if group is None:
        return None
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise CachedError(
            f"[server] socket_group {group!r}: no such group on this system; create it "
            "(groupadd), or give its number, or leave socket_group unset for the daemon's group"
        ) from None


def apply(path: str, mode: str, gid: int | None, group: str | None) -> None:
    """Give the socket at ``path`` its group (if ``gid`` is set), then its mode. Raises
    :class:`CachedError` with what to do when the daemon may not."""
    if gid is not None:
        try:
            # -1: the owner stays the daemon's user.
            os.chown(path, -1, gid)
        except OSError as exc:
            raise CachedError(
                f"cannot give the socket {path} to group {group} ([server] socket_group): "
                f"{exc.strerror or exc}; the daemon's user must be a member of that group "
                "(under systemd: Group= or SupplementaryGroups=), or leave socket_group unset"
            ) from exc
    try:
        os.chmod(path, parse_mode(mode))
    except OSError as exc:
        raise CachedError(
            f"cannot set the mode of the socket {path} to {mode} ([server] socket_mode): "
            f"{exc.strerror or exc}"
        ) from exc
