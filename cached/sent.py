"""Reply bytes handed to ZeroMQ that it has not written yet, per connection, per user and in
total, and the caps on them.

ZeroMQ queues up to ``SNDHWM`` (16) replies per connection, counted in messages, not bytes,
and a read is bounded in samples (``max_read_samples``), not bytes: a client that takes no
replies (or another user's 512 such connections) held 16 reads' payload each in the
daemon, out of any byte cap's sight (a shard's worth each, for large samples). So the last
payload frame of each large reply is tracked (pyzmq's ``MessageTracker``: done once libzmq
has written the message out and freed it, cached/hot/pread.py makes that frame), its
reply's bytes are counted until then, and a reply that would pass a cap waits in the
connection's backlog instead (cached/server/sendq.py), under the backlog's own byte caps and
``reply_timeout_s``. A scope that holds nothing takes a reply whatever its size, so the
bytes held are at most each cap and one reply more.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any


class Sent:
    """The bytes ZeroMQ holds for each connection. On the event loop only."""

    def __init__(self, per_client: int, per_user: int, total: int) -> None:
        self.per_client = per_client
        self.per_user = per_user
        self.total = total
        self._out: dict[bytes, deque[tuple[Any, int]]] = {}  # connection -> (tracker, bytes)
        self._user_of: dict[bytes, str] = {}
        self._client_sum: Counter[bytes] = Counter()
        self._user_sum: Counter[str] = Counter()
        self._total = 0
        self.waited = 0  # replies that waited for room here

    def held(self, client: bytes | None = None) -> int:
        """Bytes held: one connection's, or every connection's."""
        return self._client_sum[client] if client is not None else self._total

    def fits(self, client: bytes, user: str, nbytes: int) -> bool:
        """Whether a reply of ``nbytes`` may go to ZeroMQ now for ``client`` of ``user``:
        each scope (the connection, the user, everyone) takes it within its cap, or holds
        nothing yet (a reply larger than a cap goes alone)."""
        self._retire(client)
        held = self._client_sum[client]
        if held and held + nbytes > self.per_client:
            self.waited += 1
            return False
        if self._over(user, nbytes):
            self._retire_all()  # others' written replies may not be counted off yet
            if self._over(user, nbytes):
                self.waited += 1
                return False
        return True

    def _over(self, user: str, nbytes: int) -> bool:
        by_user = self._user_sum[user]
        return bool(
            (by_user and by_user + nbytes > self.per_user)
            or (self._total and self._total + nbytes > self.total)
        )

    def add(self, client: bytes, user: str, tracker: Any, nbytes: int) -> None:
        """A reply of ``nbytes`` went to ZeroMQ; ``tracker`` says when it is written."""
        if tracker is None or tracker.done:
            return
        self._out.setdefault(client, deque()).append((tracker, nbytes))
        self._user_of[client] = user
        self._client_sum[client] += nbytes
        self._user_sum[user] += nbytes
        self._total += nbytes

    def forget(self, client: bytes) -> None:
        """The connection went: libzmq drops what it queued for it."""
        out = self._out.pop(client, None)
        if out is None:
            return
        self._take(client, sum(n for _, n in out))
        del self._user_of[client]

    def _retire(self, client: bytes) -> None:
        out = self._out.get(client)
        if not out:
            return
        done = 0
        # Written in order: the first not done holds the ones behind it too.
        while out and out[0][0].done:
            done += out.popleft()[1]
        if done:
            self._take(client, done)
        if not out:
            del self._out[client]
            del self._user_of[client]

    def _retire_all(self) -> None:
        for client in list(self._user_of):
            self._retire(client)

    def _take(self, client: bytes, nbytes: int) -> None:
        user = self._user_of[client]
        self._client_sum[client] -= nbytes
        if not self._client_sum[client]:
            del self._client_sum[client]
        self._user_sum[user] -= nbytes
        if not self._user_sum[user]:
            del self._user_sum[user]
        self._total -= nbytes
