"""Whose is each name a client chooses: plans, streams (leases) and datasets are per user.

Plan keys, stream names and dataset ids are not secrets: they follow from the job, and a
listing shows them. So the daemon holds each under its user's name (``Peer.user``: ``uid
N`` for an ipc connection, from the kernel's credentials; a tcp connection is a user of its
own): a request under a name another user chose names that user's own plan, lease or
dataset, never the other one's. Another user can neither replace nor drop a reader's plan,
move its cursor (a read's ``plan`` and ``pos``), nor release its pins (a ``close`` or a
``release`` naming its stream). A session (a heartbeat's name for a connection) is checked
against its connection's user where it is used (``cached.server.sessions``).

``status`` shows each user its own plans; the daemon's own user and root see every plan
with the user that holds it. The admin HTTP ``/status`` knows no user (anyone on the node
who reaches its port may ask), so its plans carry no stream names nor users.

A job's name is a label, not something held: reports of every user under one name count
for one job (cached/jobs.py; docs/operations.md, "Security model").
"""

from __future__ import annotations

import os
from typing import Any

from .errors import ProtocolError

# Between a user and the name it chose in a key held for it. No user name holds it
# ("uid N", "connection HEX"); a client's name may, and is kept whole after the first.
SEP = "\x1f"
# The longest name a client may choose: each is kept while its plan, lease or dataset
# lives (65,536 leases of 100 MB stream names would be 6.4 TB); the client library's
# are some 30 characters.
MAX_NAME_CHARS = 256


def bounded(name: str) -> str:
    """``name``, a name a client chose (a plan key, stream, dataset or job name), if it is
    at most MAX_NAME_CHARS long; else :class:`ProtocolError` (``bad_request``)."""
    if len(name) > MAX_NAME_CHARS:
        raise ProtocolError(
            f"a plan key, stream, dataset or job name may be at most {MAX_NAME_CHARS} "
            f"characters, not {len(name)}"
        )
    return name


def scoped(user: str, name: str) -> str:
    """The key the daemon holds ``name`` (:func:`bounded`) under for ``user``; ``name``
    itself where there is no user (a caller of the planner with no connections, e.g.
    ``bench/cache_sim.py``)."""
    bounded(name)
    return f"{user}{SEP}{name}" if user else name


def name_of(key: str) -> str:
    """The client's own name in ``key`` (what :func:`scoped` was given)."""
    return key.partition(SEP)[2] if SEP in key else key


def owner_of(key: str) -> str:
    """The user ``key`` is held for; empty for an unscoped key."""
    return key.partition(SEP)[0] if SEP in key else ""


def sees_all(user: str, daemon_uid: int | None = None) -> bool:
    """Whether ``user`` may see every user's plans: root, and the daemon's own user."""
    uid = os.getuid() if daemon_uid is None else daemon_uid
    return user in ("uid 0", f"uid {uid}")


def for_viewer(status: dict[str, Any], user: str) -> dict[str, Any]:
    """``status`` as ``user`` may see it on the socket: its own plans only, unless it
    :func:`sees_all`, and each plan's ``user`` then."""
    plans = status.get("plans")
    if not isinstance(plans, list):
        return status
    if sees_all(user):
        return status
    own = [{k: v for k, v in p.items() if k != "user"} for p in plans if p.get("user") == user]
    return {**status, "plans": own, **_connections_of(status, user)}


def _connections_of(status: dict[str, Any], user: str | None) -> dict[str, Any]:
    """``status``'s descriptors with the connections by user cut to ``user``'s own (none
    for None): which uids use the daemon, and how much, is not every user's business."""
    fds = status.get("descriptors")
    if not isinstance(fds, dict) or "connections_by_user" not in fds:
        return {}
    mine = {u: n for u, n in fds["connections_by_user"].items() if u == user}
    return {"descriptors": {**fds, "connections_by_user": mine}}


def anonymous(status: dict[str, Any]) -> dict[str, Any]:
    """``status`` for a reader of unknown user (the admin HTTP endpoint): the plans' counts,
    jobs, cursors and rates, without their stream names or users."""
    plans = status.get("plans")
    if not isinstance(plans, list):
        return status
    hidden = ("stream", "user")
    shown = [{k: v for k, v in p.items() if k not in hidden} for p in plans]
    return {**status, "plans": shown, **_connections_of(status, None)}
