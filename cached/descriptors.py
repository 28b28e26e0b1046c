"""The daemon's file descriptors as a budget: the limit raised to the hard one at start, a
share of it for each holder whose count a client can drive (connections, shard files kept
open for socket reads, admin HTTP connections), and a reserve that no share may use.

Why a reserve, and not a cap at the limit: libzmq's ipc listener asserts when ``accept``
fails with EMFILE (``src/ipc_listener.cpp``: "Too many open files"), and the daemon dies of
SIGABRT. libzmq cannot be asked to stop accepting, so connections past a cap are accepted
and then shut (cached/peers.py): between the two, a flood holds descriptors for the time
the daemon takes to see the accept. The reserve is that headroom, and the soft limit raised
to the hard one makes it large (65536 under the shipped unit: a reserve of about 16,000).
"""

from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass

from .errors import ConfigError

log = logging.getLogger(__name__)

# Never planned for: the flood's headroom (see above), at least this many.
MIN_RESERVE = 32
# The share of what is left after the fixed holders that the reserve takes.
RESERVE_SHARE = 0.25
# What the daemon itself may open besides the planned holders and the S3 client's pool (a
# figure of its own): the native client's connections, files being written, sidecars,
# eviction renames, event descriptors. Measured: a daemon fetching and serving 64 shards
# with 4 prefetches opened 19 besides its 24 at start, its shard files and its connections.
FIXED_OVERHEAD = 96
# The room left after the reserve, shared out where it holds less than the caps ask.
SHARES = {"connections": 0.5, "files": 0.4, "http": 0.1}
# With too few descriptors for this many connections and shard files, the daemon does not
# start: it could serve no one reliably.
MIN_CONNECTIONS = 8
MIN_SHARD_FILES = 8


@dataclass(frozen=True)
class Limits:
    """RLIMIT_NOFILE as the daemon runs with it, and the soft limit it found at start."""

    soft: int
    hard: int
    found_soft: int


def raise_soft_limit() -> Limits:
    """Raise the soft descriptor limit to the hard one (a no-op where they are equal, as
    under the shipped unit's ``LimitNOFILE=``); an infinite hard limit is capped at the
    kernel's ``nr_open``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else _nr_open()
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:  # a container that forbids it
            log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, target, exc)
            target = soft
    else:
        target = soft if soft != resource.RLIM_INFINITY else _nr_open()
    return Limits(
        soft=int(target),
        hard=int(hard if hard != resource.RLIM_INFINITY else target),
        found_soft=int(soft if soft != resource.RLIM_INFINITY else target),
    )


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20


def open_count() -> int:
    """Descriptors this process has open now (``/proc/self/fd``; -1 where there is none)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the listing's own
    except OSError:
        return -1


@dataclass(frozen=True)
class Budget:
    """The descriptor limit shared out. Each share is the configured cap, or less where the
    limit holds fewer (the daemon says so at start)."""

    limit: int
    reserve: int
    connections: int
    connections_per_user: int
    shard_files: int
    http_connections: int
    # Descriptor numbers from here up are the reserve: an accepted connection numbered at
    # or past it is shut at once, whatever the caps say (the kernel gives the lowest free
    # number, so such a number means this many are open).
    refuse_from: int

    @classmethod
    def plan(
        cls,
        limit: int,
        in_use: int,
        *,
        fixed: int,
        max_connections: int,
        max_connections_per_user: int,
        max_open_files: int,
        max_http_connections: int,
    ) -> Budget:
        """Share ``limit`` out, ``in_use`` being open already and ``fixed`` the sources'
        own. Raises :class:`ConfigError` where the limit leaves too little to serve."""
        free = limit - in_use - fixed
        reserve = max(MIN_RESERVE, int(free * RESERVE_SHARE))
        room = free - reserve
        # Where the room is short, each holder gets at most its share of it.
        connections = min(max_connections, int(room * SHARES["connections"]))
        files = min(max_open_files, int(room * SHARES["files"]))
        http = min(max_http_connections, max(1, int(room * SHARES["http"])))
        # A user keeps the same part of the connections as configured.
        per_user = min(
            max_connections_per_user,
            max(1, connections * max_connections_per_user // max_connections),
        )
        if connections < MIN_CONNECTIONS or files < min(MIN_SHARD_FILES, max_open_files):
            least = max(MIN_CONNECTIONS / SHARES["connections"], MIN_SHARD_FILES / SHARES["files"])
            need = in_use + fixed + int(max(least + MIN_RESERVE, least / (1 - RESERVE_SHARE))) + 1
            raise ConfigError(
                f"the descriptor limit ({limit}, {in_use} open already, {fixed} for the "
                f"store's connections and downloads) leaves room for {max(connections, 0)} "
                f"connections and {max(files, 0)} shard files: raise it to at least {need} "
                "(LimitNOFILE= in the systemd unit, the container runtime's nofile, or "
                "`ulimit -n`)"
            )
        return cls(
            limit=limit,
            reserve=reserve,
            connections=connections,
            connections_per_user=min(per_user, connections),
            shard_files=files,
            http_connections=http,
            refuse_from=limit - reserve // 2,
        )

    def scaled(self, max_connections: int, max_open_files: int) -> bool:
        """Whether the limit cut a share below its configured cap."""
        return self.connections < max_connections or self.shard_files < max_open_files
