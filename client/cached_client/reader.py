"""Reading shards from the daemon: opens sent ahead, then pipelined reads of sample ranges,
across shard boundaries. Shared by ``CachedDataset`` and ``FastLoader``."""

from __future__ import annotations

from collections import deque
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass

import zmq
from cached_wire.catalog import Catalog
from cached_wire.protocol import ErrorCode, Header, Op

from .errors import RemoteError
from .transport import Connection

# One read request asks for about this many payload bytes: large enough to amortize the
# round trip, small enough that a few in flight stay a bounded amount of memory.
TARGET_REQUEST_BYTES = 4 << 20
# A local read's reply carries no payload, so it may cover more: fewer requests for the
# daemon to answer (its CPU per GB), and no more than this through the socket should the
# reader have to ask for it there again (docs/decisions.md, D25).
LOCAL_TARGET_REQUEST_BYTES = 64 << 20
MAX_REQUEST_SAMPLES = 4096
# At most this many shards opened (fetched, not pinned) ahead of the ones being read.
MAX_OPEN_AHEAD = 8

RawSample = tuple[str, list[tuple[str, zmq.Frame]]]


@dataclass(frozen=True)
class Span:
    """Samples ``start..stop`` of the shard at ``url`` (``stop`` None: to its end), after
    the samples ``picks`` (ascending, each below ``start``).

    ``picks`` is how a resumed reader reads back the samples its shuffle buffer held:
    scattered indices, one read per run of consecutive ones, in the same span (one open,
    one pin) as the rest of the shard."""

    url: str
    start: int = 0
    stop: int | None = None
    picks: tuple[int, ...] = ()


@dataclass(frozen=True)
class Read:
    """One read request of a span: its header (``start``, ``count``), the shard's URL, the
    span's index in the list read (``pos``) and whether it is the span's final read."""

    header: Header
    url: str
    pos: int
    last: bool  # the span's final read
    partial: bool  # the span ends before the shard does (the daemon keeps the pin)


def shard_lengths(
    conn: Connection, urls: Sequence[str], stream: str, *, window: int = MAX_OPEN_AHEAD
) -> list[int]:
    """The number of samples in each shard, ``window`` opens in flight (each fetches its
    shard into the hot tier if needed, and pins nothing)."""
    lengths: list[int] = []
    sent: deque[int] = deque()
    try:
        for url in urls:
            sent.append(conn.send({"op": Op.OPEN, "url": url, "stream": stream, "pin": False}))
            if len(sent) >= window:
                lengths.append(_length(conn, urls[len(lengths)], sent.popleft()))
        while sent:
            lengths.append(_length(conn, urls[len(lengths)], sent.popleft()))
    finally:
        conn.forget(list(sent))
    return lengths


def _length(conn: Connection, url: str, rid: int) -> int:
    header = conn.wait(rid)[0]
    conn.remember_open(url, header)
    return int(header["samples"])


# I59, I61: a dataset is told while named, and again after a restart.
def announce(
    conn: Connection,
    plan: str,
    urls: Sequence[str],
    job: str = "",
    catalog: Catalog | None = None,
) -> bool:
    """Tell the daemon the shards this reader will read, in order (the rest of this epoch,
    then the next), so it prefetches ahead and evicts what is needed last. Reads then move
    the cursor (``pipelined_reads(plan=...)``). Returns False when the daemon does not know
    plans (an older daemon): reading works the same, without the lookahead.

    With ``catalog`` (the dataset's URL list, holding every URL of ``urls``) and a daemon
    that knows datasets, the plan names positions in the list: 4 bytes per shard instead
    of its URL. The list itself goes only to a daemon that does not hold it yet (another
    reader of the dataset told it, and the daemon keeps one copy per list), which answers
    the plan ``unknown_dataset`` (docs/protocol.md, "Datasets")."""
    conn.open()
    header: Header = {"op": Op.PLAN, "plan": plan, "cursor": 0, "job": job}
    index = catalog.index(urls) if catalog is not None and conn.supports("datasets") else None
    if catalog is not None and index is not None:
        header |= {"dataset": catalog.id, "index": index}
        try:
            conn.request(header)
        except RemoteError as exc:
            if exc.code != ErrorCode.UNKNOWN_DATASET:
                raise
            conn.request({"op": Op.DATASET, "dataset": catalog.id, "urls": catalog.urls})
            conn.request(header)
    else:
        header["urls"] = list(urls)
        try:
            conn.request(header)
        except RemoteError as exc:
            if exc.code != ErrorCode.BAD_REQUEST or "unknown op" not in str(exc):
                raise
            return False
    # A daemon that restarts loses plans; the connection tells the new one again (the
    # reads that follow move the cursor back to where the reader is). As URLs: a resent
    # plan goes without waiting for a reply, and the daemon handles requests concurrently,
    # so a plan by positions could overtake the list it names.
    kept = {k: v for k, v in header.items() if k not in ("dataset", "index")}
    conn.keep(f"plan/{plan}", {**kept, "urls": list(urls)})
    return True


def _runs(span: Span, n: int) -> list[tuple[int, int]]:
    """The span's sample ranges ``(start, stop)`` in a shard of ``n`` samples."""
    stop = n if span.stop is None else min(span.stop, n)
    runs: list[tuple[int, int]] = []

    def add(lo: int, hi: int) -> None:
        if runs and runs[-1][1] == lo:  # one read for consecutive samples
            runs[-1] = (runs[-1][0], hi)
        else:
            runs.append((lo, hi))

    for i in span.picks:
        if i < n:
            add(i, i + 1)
    if span.start < stop:
        add(span.start, stop)
    return runs


def _reads(
    span: Span,
    pos: int,
    opened: Header,
    stream: str,
    *,
    exts: Sequence[str] | None,
    plan: str | None,
    local: bool = False,
) -> list[Read]:
    n = int(opened["samples"])
    avg = max(1, int(opened["payload"]) // max(1, n))
    target = LOCAL_TARGET_REQUEST_BYTES if local else TARGET_REQUEST_BYTES
    per = max(1, min(MAX_REQUEST_SAMPLES, target // avg))
    headers: list[Header] = []
    for lo, hi in _runs(span, n):
        for start in range(lo, hi, per):
            header: Header = {
                "op": Op.READ,
                "url": span.url,
                "stream": stream,
                "start": start,
                "count": min(per, hi - start),
            }
            if exts is not None:
                header["exts"] = list(exts)
            if plan is not None:
                header["plan"], header["pos"] = plan, pos
            headers.append(header)
    if not headers:
        return []
    # The daemon releases a pin when the stream reads the shard's last sample; a span that
    # ends before it must release the pin itself.
    partial = headers[-1]["start"] + headers[-1]["count"] < n
    return [
        Read(header, span.url, pos, i == len(headers) - 1, partial)
        for i, header in enumerate(headers)
    ]


def _whole(
    span: Span, pos: int, stream: str, *, exts: Sequence[str] | None, plan: str | None
) -> Read:
    """The one read of a whole shard that an open of this connection described (D33):
    no open first; answered only if the shard is resident (else asked again as a demand
    when the reader gets to it, see ``Connection.whole_read``)."""
    header: Header = {
        "op": Op.READ,
        "url": span.url,
        "stream": stream,
        "start": 0,
        "whole": True,
        "if_resident": True,
    }
    if exts is not None:
        header["exts"] = list(exts)
    if plan is not None:
        header["plan"], header["pos"] = plan, pos
    return Read(header, span.url, pos, True, False)


def _is_whole(span: Span) -> bool:
    return span.start == 0 and span.stop is None and not span.picks


def _may_pin(conn: Connection, read: Read, pending: deque[tuple[int, Read]]) -> bool:
    """Whether ``read`` may go out now. A whole read asked only of a resident shard pins
    the shard when it is answered; none goes out behind one seen answered "not
    resident", so that, as with opens, a reader does not go on pinning beyond a shard it
    will wait for. (A cheap look, at replies already received: the bound is the daemon's,
    which keeps such pins to half its tier, see ``Server._resident_now``.)"""
    if not read.header.get("if_resident"):
        return True
    for rid, before in pending:
        if before.header.get("if_resident"):
            answer = conn.arrived(rid)
            if answer is not None and answer.get("resident") is False:
                return False
    return True


# An entry of the opens in line: (span's index, span, the open's request id, sent ahead);
# a request id of None stands for a shard read without an open (see _whole).
_Opening = tuple[int, Span, int | None, bool]


def _next_is_demand(conn: Connection, opens: deque[_Opening], stream: str) -> None:
    """The first open waiting in line is the next shard the reader needs: if it went out
    as an open ahead and the shard is not there yet, ask again as a demand (the daemon
    would otherwise leave it to its prefetcher, and the reader would wait for it)."""
    if not opens:
        return
    pos, span, rid, ahead = opens[0]
    if ahead and rid is not None and not conn.has_reply(rid):
        conn.forget([rid])
        # Fetched now, where there is room beside the shard being read; else it gives way
        # and is asked for once that shard's reads are done (see _answered).
        opened = {"op": Op.OPEN, "url": span.url, "stream": stream, "pin": False}
        opens[0] = (pos, span, conn.send({**opened, "give_way": True}), False)


def _answered(conn: Connection, rid: int) -> bool:
    """Whether the open ``rid`` has its answer, one to read the shard by. One that gave
    way ("resident": false) is asked again only once the reads before it are done: the
    demand then waits for no pin of this reader's."""
    if not conn.has_reply(rid):
        return False
    header = conn.arrived(rid)
    return header is None or header.get("resident") is not False


def _opened(conn: Connection, url: str, rid: int, stream: str) -> Header:
    """The reply to the open ``rid`` of ``url``, the shard this reader reads next.

    Before waiting for it, the pins this stream has given back go to the daemon now, not
    with its next request: that request may be this wait's own (a local reader's last
    shard stays pinned until its release arrives, and on a tier with room for one shard
    the open would wait for that pin). An open that gave way is asked again, as a demand
    (which carries those releases)."""
    if not conn.has_reply(rid):
        conn.flush_releases(stream)
    header, _ = conn.wait(rid)
    if header.get("resident") is False:  # it gave way (give_way)
        demand = {"op": Op.OPEN, "url": url, "stream": stream, "pin": False}
        header, _ = conn.wait(conn.send(demand))
    conn.remember_open(url, header)
    return header


def pipelined_reads(
    conn: Connection,
    spans: Sequence[Span],
    stream: str,
    *,
    inflight: int = 4,
    exts: Sequence[str] | None = None,
    plan: str | None = None,
) -> Generator[tuple[Read, int], None, None]:
    """Send the reads of ``spans`` and yield ``(read, request id)`` in order; the caller
    receives each reply (``conn.wait``, or ``conn.receive(in_place=True)`` into its own
    buffers) before asking for the next.

    Up to ``inflight`` reads are outstanding across shard boundaries (back-pressure: the
    daemon never queues more for this reader). The next shards' opens go out early (while
    fewer than ``inflight`` reads are queued, at most ``MAX_OPEN_AHEAD``), so a boundary
    costs no round trip, small shards still fill the pipeline, and a missing next shard
    downloads meanwhile. An open's reply has no payload, so receiving it while a read is
    awaited costs nothing; nothing blocks on an open while reads are in flight. Only the
    shards being read are pinned; leaving early releases them.

    ``plan`` names the plan announced for ``spans`` (:func:`announce`): every read carries
    it and the span's position, which is how the daemon follows this reader's progress.
    """
    opens: deque[_Opening] = deque()
    reads: deque[Read] = deque()
    pending: deque[tuple[int, Read]] = deque()
    todo = deque(enumerate(spans))
    held: set[str] = set()  # being read (pinned by its reads), not yet to the end of the span
    try:
        while True:
            while todo and len(opens) < MAX_OPEN_AHEAD and (not opens or len(reads) < inflight):
                pos, span = todo.popleft()
                if _is_whole(span) and conn.whole_read(
                    span.url, max_bytes=LOCAL_TARGET_REQUEST_BYTES, max_samples=MAX_REQUEST_SAMPLES
                ):
                    opens.append((pos, span, None, False))  # read in its turn, no open
                    continue
                # Unpinned: a reader's pins are the shards it is reading, never the ones it
                # looks ahead to, or a small hot tier could fill with pins and deadlock.
                # The first read pins the shard (and fetches it again if it was evicted).
                opened = {"op": Op.OPEN, "url": span.url, "stream": stream, "pin": False}
                if opens:
                    # Beyond the next shard: the daemon answers once the shard is resident
                    # but leaves fetching ahead to its prefetcher (lookahead, admission).
                    # Where the tier has no room for it beside the shards being read, it
                    # gives way ("resident": false) and the shard is asked for in its turn.
                    opened["ahead"] = opened["give_way"] = True
                opens.append((pos, span, conn.send(opened), bool(opens)))
            while len(pending) < inflight:
                if reads and not _may_pin(conn, reads[0], pending):
                    break
                if reads:
                    read = reads.popleft()
                    pending.append((conn.send(read.header), read))
                elif opens and (not pending or opens[0][2] is None or _answered(conn, opens[0][2])):
                    pos, span, rid, _ = opens.popleft()
                    _next_is_demand(conn, opens, stream)
                    if rid is None:
                        more = [_whole(span, pos, stream, exts=exts, plan=plan)]
                    else:
                        header = _opened(conn, span.url, rid, stream)
                        more = _reads(
                            span, pos, header, stream, exts=exts, plan=plan, local=conn.asks_local
                        )
                    reads.extend(more)
                    if more:
                        held.add(span.url)
                else:
                    break
            if not pending:
                return
            # Pins that no request of this loop carried back go now, not at some later one.
            conn.flush_releases(stream)
            rid, read = pending.popleft()
            yield read, rid
            if read.last:
                held.discard(read.url)
                # The daemon releases a pin at the shard's end, except a local reader's:
                # that holds the file open until here, and must close it first.
                if read.partial or conn.holds_local_leases:
                    conn.release(read.url, stream)  # its files closed, then its pin
    finally:
        conn.forget([rid for rid, _ in pending] + [r for _, _, r, _ in opens if r is not None])
        for url in held:
            conn.release(url, stream)
        conn.flush_releases(stream)  # no request of this stream follows to carry them


def read_spans(
    conn: Connection,
    spans: Sequence[Span],
    stream: str,
    *,
    inflight: int = 4,
    plan: str | None = None,
) -> Iterator[tuple[str, RawSample]]:
    """Yield ``(url, (key, [(ext, frame), ...]))`` for every sample of ``spans``, in order."""
    for read, rid in pipelined_reads(conn, spans, stream, inflight=inflight, plan=plan):
        reply, frames = conn.wait(rid)
        for raw in raw_samples(reply, frames):
            yield read.url, raw


def raw_samples(reply: Header, frames: Sequence[zmq.Frame]) -> Iterator[RawSample]:
    """The samples of a read's reply, ``(key, [(ext, frame), ...])`` in order (sample
    ``reply["start"] + i`` is the i-th)."""
    i = 0
    for key, members in reply["samples"]:
        # Each member is [ext, size] (a local reply adds its offset and checksum).
        yield key, [(member[0], frames[i + j]) for j, member in enumerate(members)]
        i += len(members)


def read_shard(
    conn: Connection,
    url: str,
    stream: str,
    *,
    start: int = 0,
    stop: int | None = None,
    inflight: int = 4,
) -> Iterator[RawSample]:
    """Yield ``(key, [(ext, frame), ...])`` for samples ``start..stop`` of one shard."""
    for _, raw in read_spans(conn, [Span(url, start, stop)], stream, inflight=inflight):
        yield raw
