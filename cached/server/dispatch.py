"""One request, from its frame to its reply: decoded (off the event loop when large),
checked against ``[server] allow``, routed to its op's handler, its failure turned into an
error reply with its code, counted, and handed to the send queue."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from cached_wire.protocol import PROTOCOL_VERSION, ErrorCode, Header, Op, decode, encode, error
from cached_wire.protocol import ProtocolError as WireProtocolError

from .. import __version__
from ..access import Access
from ..bounds import Bounds
from ..errors import CachedError, ProtocolError, VersionMismatch
from ..jobs import JobBoard, Report
from ..metrics import Metrics
from ..offload import Offload
from ..owners import for_viewer
from ..peers import Peer
from .checks import DECODE_OFFLOAD_BYTES, MAX_REQUEST_DEPTH, op_of, released, request_id, url_of
from .checks import valid as valid_url
from .plans import Plans
from .reads import Reads, stream_of
from .sendq import SendQueue
from .sessions import Sessions

log = logging.getLogger(__name__)

# What this daemon understands beyond protocol v1's first form, told in the hello reply:
# "release": an open or read may carry the URLs whose pins the stream gives back, which
# saves a local reader one ``close`` request per shard (D26). "whole": a read of all of a
# shard's samples, which may ask to be answered only if the shard is resident (D33).
# "packed": a local read's layout is one binary frame (D34), the only form it has.
# "heartbeat": a client's heartbeat (its own socket, naming its connection's session)
# renews the connection's leases and plans and carries the instance (issue 21).
# "datasets": a dataset's URL list is told once, and plans name positions in it (issue 24).
FEATURES = ("release", "whole", "packed", "heartbeat", "datasets")


class Dispatch:
    """Handles requests (:meth:`handle`, one task each). Knows which of its tasks are
    opens ahead (:attr:`hints`, not worth a wait at shutdown) and plan installs
    (:attr:`installs`, finished even when their client goes)."""

    def __init__(
        self,
        *,
        reads: Reads,
        plans: Plans,
        sessions: Sessions,
        sendq: SendQueue,
        access: Access,
        jobs: JobBoard,
        metrics: Metrics,
        offload: Offload,
        bounds: Bounds,
        status: Callable[[], dict[str, Any]],
        instance: str,
        heartbeat_s: float,
    ) -> None:
        self.reads, self.plans, self.sessions, self.sendq = reads, plans, sessions, sendq
        self.access, self.jobs, self.metrics, self.offload = access, jobs, metrics, offload
        self.bounds = bounds
        self._status = status
        self.instance = instance
        self.heartbeat_s = heartbeat_s
        self.hints: set[asyncio.Task[Any]] = set()
        self.installs: set[asyncio.Task[Any]] = set()

    def forget(self, task: asyncio.Task[Any]) -> None:
        """A request's task is done."""
        self.hints.discard(task)
        self.installs.discard(task)

    async def handle(self, peer: Peer, body: bytes) -> None:
        """Answer one request frame from ``peer``; a cancel (shutdown) is answered
        ``shutting_down`` and raised again."""
        rid: Any = None
        op = "?"
        payload: list[Any] = []
        cancelled = False
        try:
            # A plan of a million URLs is a 40 MB header: parsed off the event loop.
            if len(body) > DECODE_OFFLOAD_BYTES:
                header = await self.offload.run(
                    peer.user, decode, body, max_depth=MAX_REQUEST_DEPTH
                )
            else:
                header = decode(body, max_depth=MAX_REQUEST_DEPTH)
            rid = request_id(header)
            op = op_of(header)
            if header.get("ahead"):
                task = asyncio.current_task()
                if task is not None:  # a hint: not worth a wait at shutdown (see drain)
                    self.hints.add(task)
            elif op == Op.PLAN:
                task = asyncio.current_task()
                if task is not None:
                    self.installs.add(task)
            await self._check_access(op, header)
            reply, payload = await self._dispatch(op, header, peer)
            reply["id"] = rid
            reply["ok"] = True
            result = "ok"
        except asyncio.CancelledError:
            # Shutdown: the client must not wait for an answer that never comes, nor take
            # this for a failure. It re-sends the request to the next daemon.
            message = "the cached daemon is shutting down before it could answer"
            reply, result = error(rid, ErrorCode.SHUTTING_DOWN, message), "shutting_down"
            cancelled = True
        except CachedError as exc:
            reply, result = error(rid, exc.code, str(exc)), exc.code.value
            if exc.lasting:
                reply["lasting"] = True  # the client does not ask again
        except (WireProtocolError, ValueError) as exc:
            reply, result = error(rid, ErrorCode.BAD_REQUEST, str(exc)), "bad_request"
        except Exception as exc:
            log.exception("request %s failed", op)
            reply, result = error(rid, ErrorCode.INTERNAL, f"internal error: {exc}"), "internal"
        if op not in Op.__members__.values():
            op = "unknown"
        self.metrics.requests.labels(op, result).inc()
        self.sendq.deliver(peer, [peer.ident, encode(reply), *payload], rid)
        if cancelled:
            raise asyncio.CancelledError

    async def _check_access(self, op: str, header: Header) -> None:
        """``[server] allow``: every URL the request names, before anything is fetched.
        Fields of the wrong type are left to the op's own checks (``bad_request``)."""
        if op in (Op.PLAN, Op.DATASET):
            named = header.get("urls")  # a plan naming a dataset's positions: none here
        elif op in (Op.OPEN, Op.READ, Op.CLOSE):
            release = header.get("release")
            named = [header.get("url"), *(release if isinstance(release, list) else [])]
            for url in named:
                if isinstance(url, str) and url:
                    valid_url(url)  # a URL no store allows is refused before it is remembered
        else:
            return
        # An oversized plan is refused by its handler (bad_request) without this costly walk.
        if isinstance(named, list) and len(named) <= self.plans.max_plan_shards:
            urls = [u for u in named if isinstance(u, str)]
            listing = op in (Op.PLAN, Op.DATASET)
            if listing or not self.access.settled(urls):
                await self.access.check(urls, remember=not listing)

    def _hello(self, header: Header, client: Peer) -> Header:
        version = header.get("v")
        if version != PROTOCOL_VERSION:
            raise VersionMismatch(
                f"client speaks protocol v{version}, this daemon speaks "
                f"v{PROTOCOL_VERSION}; upgrade cached-client or the daemon"
            )
        return {
            "v": PROTOCOL_VERSION,
            "server": f"cached/{__version__}",
            "instance": self.instance,
            "features": list(FEATURES),
            "limits": {
                "max_request_bytes": self.bounds.max_request_bytes,
                "max_requests_per_client": self.bounds.max_requests_per_client,
            },
            "heartbeat_s": self.heartbeat_s,
            **self.sessions.session_of(header, client),
        }

    async def _dispatch(self, op: str, header: Header, client: Peer) -> tuple[Header, list[Any]]:
        """Run one request; ``client`` is the connection (for the caps)."""
        if op in (Op.OPEN, Op.READ) and "release" in header:
            # First: the pins given back make room for the shard this request may fetch.
            await self.reads.release(released(header), stream_of(header, client))
        if op == Op.HELLO:
            return self._hello(header, client), []
        if op == Op.HEARTBEAT:
            return self.sessions.heartbeat(header, client), []
        if op == Op.OPEN:
            return await self.reads.open(header, client), []
        if op == Op.READ:
            return await self.reads.read(header, client)
        if op == Op.CLOSE:
            await self.reads.release([url_of(header)], stream_of(header, client))
            return {}, []
        if op == Op.STATUS:
            # Its own plans only, unless it is root or the daemon's user (owners.py).
            return {"status": for_viewer(self._status(), client.user)}, []
        if op == Op.PLAN:
            await self.plans.plan(header, client)
            return {}, []
        if op == Op.DATASET:
            await self.plans.dataset(header, client)
            return {}, []
        if op == Op.REPORT:
            self.jobs.report(Report.parse(header))
            return {}, []
        raise ProtocolError(f"unknown op {op!r}; expected one of {', '.join(Op)}")
