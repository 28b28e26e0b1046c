"""Caps on state that clients create by name (plans, leases): per connection, per local
user, and in total.

Plans and leases are keyed by strings the client chooses, and were bounded only by their
timeouts: one client (a bug, or a hostile process on the node) could announce plans or pin
shards without end, and a cap per connection alone is no bound for a user who opens many
connections. Each key belongs to one connection (its ZeroMQ routing id) and to the user
behind it (the uid the kernel gives for an ipc connection; a tcp connection is a user of
its own), and weighs something (1 for a count, the URLs of a plan, the bytes of a pinned
shard). A request that would take a scope past its cap gets ``limit_exceeded``, which names
the cap and the config key that raises it. Keys are forgotten when the state they stand
for goes (a plan expires, a lease is released, the connection closes), so the sums are of
live state only.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

from .errors import LimitExceeded

K = TypeVar("K", bytes, str)


@dataclass(frozen=True)
class Cap:
    """A most, and the config key that sets it (named in the refusal)."""

    limit: int
    config_key: str
    # What a refusal says of the cap, where "KEY = LIMIT" does not say it well.
    says: str = ""


def _count(n: int) -> str:
    return str(n)


# I54, I60: plans and pins capped per connection, uid and in total; datasets count.
class Quota:
    """Live keys of one kind, each owned by a connection and a user, with caps on the
    weight one connection, one user, and everyone together may hold."""

    def __init__(
        self,
        what: str,
        *,
        per_client: Cap | None = None,
        per_user: Cap | None = None,
        total: Cap | None = None,
        show: Callable[[int], str] = _count,
        advice: str = "release some, wait for them to lapse, or raise the limit",
    ) -> None:
        self.what = what
        self.per_client = per_client
        self.per_user = per_user
        self.total = total
        self._show = show
        self._advice = advice  # what a refusal tells the client to do next
        self._owner: dict[Hashable, tuple[bytes, str, int]] = {}  # key -> client, user, weight
        self._keys: dict[bytes, set[Hashable]] = {}
        self._client_sum: dict[bytes, int] = {}
        self._user_sum: dict[str, int] = {}
        self._total = 0

    def admit(self, client: bytes, key: Hashable, weight: int = 1, user: str = "") -> None:
        """Count ``key`` (of ``weight``) for ``client`` and ``user`` (empty: the client is a
        user of its own). Raises :class:`LimitExceeded` where a scope's sum would pass its
        cap; a key held again with no more weight (a lease refreshed, a plan replaced by
        one as long) is always admitted. A key another connection held (a reconnect) moves
        to this one."""
        self.check(client, key, weight, user)
        self._remove(key)
        user = user or client.hex()
        self._owner[key] = (client, user, weight)
        self._keys.setdefault(client, set()).add(key)
        self._client_sum[client] = self._client_sum.get(client, 0) + weight
        self._user_sum[user] = self._user_sum.get(user, 0) + weight
        self._total += weight

    def check(self, client: bytes, key: Hashable, weight: int = 1, user: str = "") -> None:
        """Raise :class:`LimitExceeded` if :meth:`admit` would; changes nothing."""
        user = user or client.hex()
        old_client, old_user, old_weight = self._owner.get(key, (b"", "", 0))
        scopes = (
            (self.per_client, self._client_sum.get(client, 0), client == old_client, "c"),
            (self.per_user, self._user_sum.get(user, 0), user == old_user, "u"),
            (self.total, self._total, True, "t"),
        )
        for cap, held, same, scope in scopes:
            replaced = old_weight if same else 0
            if cap is None or weight <= replaced or held - replaced + weight <= cap.limit:
                continue
            show = self._show
            if scope == "c" or (scope == "u" and user == client.hex()):
                who = f"this client holds {show(held)} {self.what}, the most one client may hold"
            elif scope == "u":
                who = (
                    f"{user} holds {show(held)} {self.what} across its connections, the most "
                    "one user may hold"
                )
            else:
                who = f"the daemon holds {show(held)} {self.what} for all its clients, its most"
            extra = f" (this request adds {show(weight)})" if weight != 1 else ""
            raise LimitExceeded(
                f"{who} ({cap.says or f'{cap.config_key} = {show(cap.limit)}'}){extra}; "
                f"{self._advice}"
            )

    def forget(self, key: Hashable) -> None:
        """The state behind ``key`` is gone."""
        self._remove(key)

    def retain(self, live: set[Hashable]) -> None:
        """Forget every key not in ``live`` (state that expired elsewhere)."""
        for key in [k for k in self._owner if k not in live]:
            self._remove(key)

    def keys(self) -> list[Hashable]:
        """Every key counted."""
        return list(self._owner)

    def held(self, client: bytes) -> int:
        """The weight ``client`` holds."""
        return self._client_sum.get(client, 0)

    def held_by_user(self, user: str) -> int:
        """The weight ``user`` holds across its connections."""
        return self._user_sum.get(user, 0)

    def keys_of(self, client: bytes) -> list[Hashable]:
        """The keys ``client`` holds (to release when it goes away)."""
        return list(self._keys.get(client, ()))

    @property
    def total_held(self) -> int:
        """The weight every client holds together."""
        return self._total

    def _remove(self, key: Hashable) -> None:
        old = self._owner.pop(key, None)
        if old is None:
            return
        client, user, weight = old
        keys = self._keys.get(client)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._keys[client]
        _take(self._client_sum, client, weight)
        _take(self._user_sum, user, weight)
        self._total -= weight


def _take(sums: dict[K, int], scope: K, weight: int) -> None:
    """Take ``weight`` off ``scope``'s sum; a sum that reaches 0 goes."""
    left = sums.get(scope, 0) - weight
    if left > 0:
        sums[scope] = left
    else:
        sums.pop(scope, None)
