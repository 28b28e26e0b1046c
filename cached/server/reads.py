"""The ops that read: ``open`` (a shard resident, fetched on a miss, and the stream's lease
on it), ``read`` (samples through the socket, each member its own frame read from the
page cache, or a local reader's packed layout of the file), ``close`` and the ``release``
field (the stream's pins given back). A read's plan position moves its plan's cursor."""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

from cached_wire.protocol import Header

from ..errors import OutOfRange, ProtocolError
from ..fetcher import AHEAD, DEMAND, PREFETCH, Fetcher, GaveWay, shard_id
from ..hot.index import Member
from ..hot.tier import HotTier, Shard, ShardCorrupt
from ..layouts import chosen, packed_layout
from ..metrics import Metrics
from ..offload import Offload
from ..owners import scoped
from ..peers import Peer
from .checks import integer, text, url_of
from .holdings import Holdings

# An open's flags -> how the fetcher treats a miss.
_PRIORITY = {"demand": DEMAND, "prefetch": PREFETCH, "ahead": AHEAD}


def stream_of(header: Header, client: Peer) -> str:
    """The request's ``stream``, as the daemon holds it: under the client's user, so a
    name another user chose is never that user's stream (cached/owners.py)."""
    return scoped(client.user, text(header, "stream"))


class Reads:
    """The ``open``, ``read`` and ``close`` handlers, and ``release``. :meth:`close` stops
    the deferred cursor notice."""

    def __init__(
        self,
        fetcher: Fetcher,
        hot: HotTier,
        holdings: Holdings,
        metrics: Metrics,
        offload: Offload,
        *,
        max_read_samples: int,
        local_reads: bool,
        instance: str,
    ) -> None:
        self.fetcher = fetcher
        self.hot = hot
        self.leases = holdings.leases
        self.planner = holdings.planner
        self.metrics = metrics
        self.offload = offload
        self.max_read_samples = max_read_samples
        # Answer reads that ask for it with the shard file's layout, not its bytes.
        self.local_reads = local_reads
        self.instance = instance
        # The planner's deferred notice of cursor moves (see _advance).
        self._flush: asyncio.TimerHandle | None = None

    def close(self) -> None:
        """Cancel the deferred notice of cursor moves."""
        if self._flush is not None:
            self._flush.cancel()

    async def release(self, urls: list[str], stream: str) -> None:
        """The stream is done with these shards: their pins go (``close``, or the
        ``release`` field of its next open or read)."""
        for url in urls:
            info = await self.fetcher.info(url)
            self.leases.release(stream, shard_id(info))

    async def _shard(self, header: Header, client: Peer, *, count: bool) -> tuple[Shard, str, bool]:
        """The shard a request names, fetched on a miss, the stream's lease on it, and
        whether it was resident when the request came (a hit). Opens count as hits or
        misses; reads (which follow an open) do not."""
        url, stream = url_of(header), stream_of(header, client)
        kind = (
            "ahead" if header.get("ahead") else "prefetch" if header.get("prefetch") else "demand"
        )
        started = time.monotonic()
        give_way = count and header.get("give_way") is True  # opens only
        # Opens ask the store again after [s3] revalidate_s; reads keep the version known.
        shard, hit = await self.fetcher.ensure(
            url, _PRIORITY[kind], revalidate=count, give_way=give_way
        )
        if count and hit:
            self.metrics.hits.inc()
        elif count:
            self.metrics.misses.labels(kind).inc()
            if kind == "demand":
                self.metrics.demand_wait_seconds.observe(time.monotonic() - started)
        if header.get("pin", True):
            self.leases.hold(stream, shard, client.ident, client.user)
        return shard, stream, hit

    def _advance(self, header: Header, client: Peer) -> None:
        """Reads name the stream's plan and position: the cursor rides along for free (of
        the client's user's plan of that name only). A move the planner does not tell its
        listeners at once is told a moment later."""
        key = header.get("plan")
        if isinstance(key, str) and key:
            wait = self.planner.advance(scoped(client.user, key), integer(header, "pos"))
            if wait is not None and self._flush is None:
                self._flush = asyncio.get_running_loop().call_later(wait, self._flushed)

    def _flushed(self) -> None:
        self._flush = None
        self.planner.flush()

    async def open(self, header: Header, client: Peer) -> Header:
        """An open: the shard resident (fetched on a miss) and leased to the stream."""
        try:
            shard, _, hit = await self._shard(header, client, count=True)
        except GaveWay:
            # No room ahead of the reader (a small tier): it asks again when it gets there.
            return {"url": url_of(header), "resident": False}
        assert shard.index is not None
        return {
            "url": shard.url,
            "hit": hit,  # resident when the open came
            # Once per shard: lets a client that never waited long enough to ping notice
            # a restart (and tell the new daemon its plan again).
            "instance": self.instance,
            "samples": len(shard.index.samples),
            "size": shard.index.size_bytes,
            "payload": shard.index.payload_bytes,
        }

    # I66, I67: a not-resident whole read fetches, pins and counts nothing; pins ahead
    # hold at most half the tier.
    def _resident_now(self, header: Header) -> bool:
        """Whether the shard a read names can be served at once, as an open would find it:
        a fresh READY copy (``Fetcher.resident_fresh``) and room to pin it ahead
        (``HotTier.may_pin_ahead``). Nothing is asked of the store, fetched or pinned."""
        shard = self.fetcher.resident_fresh(url_of(header))
        return shard is not None and self.hot.may_pin_ahead(shard)

    async def read(self, header: Header, client: Peer) -> tuple[Header, list[Any]]:
        """A read of samples ``start`` to ``start + count`` (or, ``whole``, of all)."""
        start = integer(header, "start")
        # A whole read (D33) stands for an open and the read of every sample: it is
        # counted and revalidated as an open, and the daemon's index says how many.
        whole = header.get("whole") is True
        if whole and start != 0:
            raise ProtocolError("a whole read starts at sample 0")
        count = self.max_read_samples if whole else integer(header, "count", low=1)
        if count > self.max_read_samples:
            raise ProtocolError(f"count {count} exceeds the limit of {self.max_read_samples}")
        if whole and header.get("if_resident") is True and not self._resident_now(header):
            return {"resident": False}, []  # the reader asks again when it gets there
        self._advance(header, client)
        exts = header.get("exts")
        if exts is not None and not (
            isinstance(exts, list) and all(isinstance(e, str) for e in exts)
        ):
            raise ProtocolError("request field 'exts' must be a list of strings")
        wanted = None if exts is None else frozenset(exts)
        # A local reader reads the members from the file itself (and checks them: the
        # layout gives their checksums); the socket carries only the header and the
        # layout, one packed frame (D34).
        local = bool(header.get("local")) and self.local_reads
        for attempt in (1, 2):
            shard, stream, _ = await self._shard(header, client, count=whole and attempt == 1)
            index = shard.index
            assert index is not None
            n = len(index.samples)
            if start > n:
                raise OutOfRange(f"{shard.url} has {n} samples; cannot read from sample {start}")
            if whole and local:
                count = n  # a local reply carries no payload: no bound on its samples
            elif whole and n > count:
                raise ProtocolError(
                    f"{shard.url} has {n} samples, more than one read through the socket may "
                    f"carry ([server] max_read_samples = {count}): read it in parts"
                )
            stop = min(n, start + count)
            if local:
                layout, nbytes = packed_layout(index, wanted, start, stop)
                frames: list[Any] = [layout.frame]
                break
            listed: list[Any] = []
            picked: list[Member] = []
            for sample in index.samples[start:stop]:
                members = chosen(sample, wanted)
                listed.append([sample.key, [[m.ext, m.size] for m in members]])
                picked.extend(members)
            samples, nbytes = listed, sum(m.size for m in picked)
            try:
                # Checked against their checksums first: rotten bytes are never sent.
                off_loop = functools.partial(self.offload.run, client.user)
                frames = await self.hot.read(shard, picked, off_loop)
                break
            except ShardCorrupt:
                if attempt == 2:
                    raise
                # The hot tier dropped the rotten copy; _shard fetches a good one.
        reply: Header = {"start": start, "next": stop, "end": stop == n}
        if local:
            reply["packed"] = {"samples": stop - start, "exts": layout.exts}
            # The reader holds the file open past this reply: its lease (the pin that keeps
            # the file from being unlinked under it) goes with its close, not here.
            reply["local"] = self.hot.locate(shard)
            self.metrics.local_read_bytes.inc(nbytes)
        else:
            reply["samples"] = samples
            if stop == n:
                self.leases.release(stream, shard.shard_id)
        if header.get("refetch") is True and not local:
            # A local reply the reader could not use (no file there, a failed checksum),
            # asked again here: counted as served once, with the local reply.
            self.metrics.local_fallback_bytes.inc(nbytes)
        else:
            self.metrics.served_samples.inc(stop - start)
            self.metrics.served_bytes.inc(nbytes)
        return reply, frames
