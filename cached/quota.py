"""Per-client caps on state that clients create by name (plans, leases).

Plans and leases are keyed by strings the client chooses, and were bounded only by their
timeouts: one client (a bug, or a hostile process on the node) could announce plans or pin
shards without end. Each client, a ZeroMQ connection (its routing id), may hold at most
``limit`` keys of a kind; a request past that gets ``limit_exceeded``, which names the cap
and the config key that raises it. Keys are forgotten when the state they stand for goes
(a plan expires, a lease is released), so the count is of live state only.
"""

from __future__ import annotations

from collections.abc import Hashable

from .errors import LimitExceeded


class PerClient:
    """Live keys of one kind, counted per client, with a cap."""

    def __init__(self, what: str, limit: int, config_key: str) -> None:
        self.what = what
        self.limit = limit
        self.config_key = config_key
        self._keys: dict[bytes, set[Hashable]] = {}
        self._owner: dict[Hashable, bytes] = {}

    def admit(self, client: bytes, key: Hashable) -> None:
        """Count ``key`` for ``client``; raises :class:`LimitExceeded` past the cap. A key
        the client already holds is always admitted (a plan replaced, a lease refreshed)."""
        keys = self._keys.setdefault(client, set())
        if key in keys:
            return
        if len(keys) >= self.limit:
            raise LimitExceeded(
                f"this client holds {len(keys)} {self.what}, the most one client may hold "
                f"({self.config_key} = {self.limit}); release some or raise the limit"
            )
        previous = self._owner.get(key)
        if previous is not None:  # the same name from a new connection (a reconnect)
            self._drop(previous, key)
        keys.add(key)
        self._owner[key] = client

    def forget(self, key: Hashable) -> None:
        """The state behind ``key`` is gone."""
        client = self._owner.pop(key, None)
        if client is not None:
            self._drop(client, key)

    def retain(self, live: set[Hashable]) -> None:
        """Forget every key not in ``live`` (state that expired elsewhere)."""
        for key in [k for k in self._owner if k not in live]:
            self.forget(key)

    def held(self, client: bytes) -> int:
        """How many keys ``client`` holds."""
        return len(self._keys.get(client, ()))

    def _drop(self, client: bytes, key: Hashable) -> None:
        keys = self._keys.get(client)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._keys[client]
