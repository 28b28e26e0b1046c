"""Sessions and what a connection leaves behind: a hello's session name bound to its
connection, heartbeats (from a socket of the client's own) renewing what that connection
holds, a gone connection's leases released at once and its plans after a grace, and the
sweep that lapses quiet streams' leases, plans and datasets."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, cast

from cached_wire.protocol import Header

from ..errors import ProtocolError
from ..metrics import Metrics
from ..peers import Peer
from ..planner import Plan
from .checks import text
from .holdings import Holdings

log = logging.getLogger(__name__)

# A session name: what a client calls its connection in its hello.
_SESSION = re.compile(r"[0-9A-Za-z_-]{8,64}")


class Sessions:
    """Connections by the session their hello named (one each), and the holdings of
    connections that went. :meth:`close` cancels what is scheduled."""

    def __init__(
        self, holdings: Holdings, metrics: Metrics, *, plan_grace_s: float, instance: str
    ) -> None:
        self.holdings = holdings
        self.metrics = metrics
        # A gone connection's plans stay this long ([prefetch] plan_grace_s), see release_held.
        self.plan_grace_s = plan_grace_s
        self.instance = instance
        self._sessions: dict[str, Peer] = {}
        self._graces: set[asyncio.TimerHandle] = set()
        # Work for peers that went away (their plans dropped under the plans lock).
        self.chores: set[asyncio.Task[None]] = set()

    def close(self) -> None:
        """Stop the graces waiting (their plans stay, with the daemon that goes)."""
        for handle in self._graces:
            handle.cancel()

    # I34: a session is never bound across uids.
    def session_of(self, header: Header, client: Peer) -> Header:
        """A hello that names a session binds it to this connection (again after a
        restart of ours, or a reconnect of the client's)."""
        session = header.get("session")
        if session is None:
            return {}
        if not isinstance(session, str) or not _SESSION.fullmatch(session):
            raise ProtocolError("request field 'session' must be 8-64 letters, digits, - or _")
        held = self._sessions.get(session)
        if held is not None and held is not client and held.user != client.user:
            raise ProtocolError("that session belongs to another user's connection")
        if client.session and self._sessions.get(client.session) is client:
            del self._sessions[client.session]  # one session per connection
        self._sessions[session] = client
        client.session = session
        return {"session": session}

    # I33, I34: a heartbeat keeps its connection's leases and plans, a same-uid one only.
    def heartbeat(self, header: Header, client: Peer) -> Header:
        """A client's heartbeat, from a socket of its own: the connection its session names
        keeps its leases and plans however long its reader reads without a request, or
        pauses. ``known`` false: no connection of ours has that session (we restarted,
        or the client has yet to say hello again)."""
        session = text(header, "session")
        peer = self._sessions.get(session)
        known = peer is not None and not peer.gone and peer.user == client.user
        if known:
            assert peer is not None
            held = self.holdings
            held.leases.renew_client(peer.ident)
            # The plans of its connection, and those its heartbeat told us again after a
            # restart of ours (on the heartbeat's socket, until the reader sends them).
            owners = (peer.ident, client.ident)
            held.planner.touch([cast(str, k) for o in owners for k in held.plan_quota.keys_of(o)])
        return {"instance": self.instance, "known": known}

    # I35, I36: a gone connection's pins go at once, its plans after plan_grace_s.
    def gone(self, peer: Peer) -> None:
        """``peer`` went away: its session name is free, and what it holds goes."""
        if peer.session and self._sessions.get(peer.session) is peer:
            del self._sessions[peer.session]
        self.release_held(peer)

    def release_held(self, peer: Peer) -> None:
        """Drop what ``peer``, gone, still holds: again when its last request ends (one
        under way when it went may have taken a lease or installed a plan since)."""
        released = self.holdings.leases.release_client(peer.ident)
        if released:
            log.info(
                "released %d leases of a client that went away (%s)", released, peer.describe()
            )
        # Its plans go a little later ([prefetch] plan_grace_s): a DataLoader worker that
        # ends with its epoch leaves the next epoch's plan, which the prefetcher follows
        # until the next workers announce theirs.
        if self.plan_grace_s > 0:
            handle: asyncio.TimerHandle | None = None

            def later() -> None:
                assert handle is not None
                self._graces.discard(handle)
                self._drop_plans(peer)

            handle = asyncio.get_running_loop().call_later(self.plan_grace_s, later)
            self._graces.add(handle)
        else:
            self._drop_plans(peer)

    def _drop_plans(self, peer: Peer) -> None:
        """Drop the plans of ``peer``, gone. Only its own: one its reader has sent again on
        a new connection (a reconnect) belongs to that connection now, and stays."""
        held = self.holdings
        keys = [cast(str, key) for key in held.plan_quota.keys_of(peer.ident)]
        if not keys:
            return
        dropped = held.planner.drop(keys)
        for key in keys:
            held.plan_quota.forget(key)
            held.plan_urls.forget(key)
            held.memory.plans.forget(key)
        if dropped:
            log.info(
                "dropped %d plans of a client that went away (%s)", len(dropped), peer.describe()
            )
            chore = asyncio.create_task(self._unindex(dropped))
            self.chores.add(chore)
            chore.add_done_callback(self.chores.discard)

    async def _unindex(self, dropped: list[Plan]) -> None:
        async with self.holdings.plans_lock:  # one install or expiry at a time
            for _ in self.holdings.planner.unindexing(dropped):
                await asyncio.sleep(0)

    # I32: a lease lapses 1 to 1.25 x lease_timeout_s after its last renewal (the sweep).
    async def expire(self) -> None:
        """Release lapsed leases and drop quiet plans periodically, until cancelled."""
        held = self.holdings
        leases, planner = held.leases, held.planner
        while True:
            await asyncio.sleep(max(0.05, min(leases.timeout_s, planner.timeout_s) / 4))
            if leases.expire():
                log.info("released leases of streams that went quiet")
            async with held.plans_lock:
                dropped = planner.drop_lapsed()
                for _ in planner.unindexing(dropped):
                    await asyncio.sleep(0)
            if dropped:
                log.info("dropped the plans of streams that went quiet")
                live: set[Any] = {plan.key for plan in planner.plans()}
                held.plan_quota.retain(live)
                held.plan_urls.retain(live)
                counted = held.memory.plans.keys()  # and the plans being built
                held.memory.plans.retain(live | {k for k in counted if isinstance(k, tuple)})
            if held.datasets.drop_unnamed({plan.dataset for plan in planner.plans()}):
                ids: set[Any] = held.datasets.ids()
                held.dataset_urls.retain(ids)
                held.memory.datasets.retain(ids)
            self.metrics.streams.set(leases.streams())
