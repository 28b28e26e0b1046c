"""The store and the dataset's residency, measured through the daemon: which shards the hot
tier holds, and cold shards opened as the prefetcher fetches them, timed."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cached_wire.protocol import Op

from ..errors import DaemonTimeout
from ..transport import Connection
from .measurements import StoreRate

# At most this many cold shards fetched to measure the store (the daemon keeps them: they
# are the dataset's).
STORE_MAX_COLD = 8
# Without a reply that says whether an open hit, an open slower than this counts as a
# cold shard for the STORE_MAX_COLD bound.
SLOW_S = 0.25


def resident_files(hot_dir: str, urls: Sequence[str]) -> dict[str, Path] | None:
    """The hot tier's data file of each of ``urls`` it holds, from the shards' sidecars
    (``<id>.idx``, whose first line names the URL); None when this user may not read the
    directory (a daemon's files are private by default)."""
    wanted = set(urls)
    found: dict[str, Path] = {}
    try:
        entries = list(os.scandir(hot_dir))
    except OSError:
        return None
    for entry in entries:
        if not entry.name.endswith(".idx"):
            continue
        try:
            with open(entry.path, "rb") as f:
                head = json.loads(f.readline(1 << 16))
        except PermissionError:
            return None  # a listable directory of private files: no view after all
        except (OSError, ValueError):
            continue  # evicted while we looked, or being rewritten
        url = head.get("url") if isinstance(head, dict) else None
        tar = Path(hot_dir) / (entry.name[: -len(".idx")] + ".tar")
        if url in wanted and tar.exists():
            found[url] = tar
    return found


@dataclass
class Open:
    """One open of the store measurement: sent, answered (``done``, ``header``) or not."""

    url: str
    sent: float
    done: float | None = None
    header: dict[str, Any] | None = None
    cold: bool = False

    @property
    def size(self) -> int | None:
        """The shard's tar size, from the reply."""
        return None if self.header is None else int(self.header["size"])

    @property
    def hit(self) -> bool | None:
        """Whether the shard was resident when the open came, as the reply says; None when
        it has not answered, or the daemon is older than the reply's ``hit``."""
        if self.header is None or "hit" not in self.header:
            return None
        return bool(self.header["hit"])


@dataclass
class Probe:
    """The opens of the store measurement, and when it stopped waiting for them."""

    opens: list[Open]
    ended: float


def probe(
    socket: str,
    queue: list[tuple[str, bool]],
    budget_s: float,
    *,
    slots: int,
    hard_s: float,
    bound_cold: bool,
) -> Probe:
    """Open ``queue``'s shards (``(url, known to be cold)``) through the daemon, unpinned,
    from ``slots`` threads with a connection each.

    Opens are sent during the first half of the budget; the ones in flight then get the
    rest, and past it until one open at all has answered (something to size the shards
    by), up to ``hard_s``. With ``bound_cold`` (residency unknown) no open is sent once
    ``STORE_MAX_COLD`` missed (as their replies say, else: were slow). Each open is marked
    a prefetch, so it waits behind the demand misses of any job training now, as the
    daemon's own prefetches do. Downloads the probe leaves running go on in the daemon.
    """
    start = time.monotonic()
    issue_until, deadline, hard = start + budget_s / 2, start + budget_s, start + hard_s
    lock = threading.Lock()
    stop = threading.Event()
    todo = list(queue)
    opens: list[Open] = []
    inflight: dict[int, float] = {}
    errors: list[BaseException] = []

    def missed(o: Open) -> bool:
        hit = o.hit
        return not hit if hit is not None else (o.done or 0.0) - o.sent > SLOW_S

    def slow() -> int:
        now = time.monotonic()
        done = sum(1 for o in opens if o.done is not None and missed(o))
        return done + sum(1 for t in inflight.values() if now - t > SLOW_S)

    def run(slot: int) -> None:
        conn = Connection(socket, connect_timeout_s=3.0)
        try:
            while True:
                with lock:
                    now = time.monotonic()
                    if (
                        stop.is_set()
                        or not todo
                        or now > issue_until
                        or (bound_cold and slow() >= STORE_MAX_COLD)
                    ):
                        return
                    url, cold = todo.pop(0)
                    record = Open(url, now, cold=cold)
                    opens.append(record)
                    inflight[slot] = now
                conn.request_timeout_s = max(0.1, hard - time.monotonic())
                request = {
                    "op": Op.OPEN,
                    "url": url,
                    "stream": f"diagnose-{uuid.uuid4().hex[:8]}",
                    "pin": False,
                    "prefetch": True,
                }
                try:
                    header, _ = conn.request(request)
                except DaemonTimeout:
                    return  # still arriving at the end: record.done stays None
                with lock:
                    if stop.is_set():
                        return  # answered after the probe stopped looking
                    record.done, record.header = time.monotonic(), header
                    inflight.pop(slot, None)
        except BaseException as exc:
            with lock:
                errors.append(exc)
        finally:
            conn.close()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(slots)]
    for t in threads:
        t.start()
    while True:
        time.sleep(0.02)
        now = time.monotonic()
        with lock:
            answered = any(o.done is not None for o in opens)
            if errors or not any(t.is_alive() for t in threads):
                break
            if (now >= deadline and answered) or now >= hard:
                break
    with lock:
        stop.set()  # a thread still waiting for a download leaves it to the daemon
        ended = time.monotonic()
        if errors:
            raise errors[0]
        taken = [dataclasses.replace(o) for o in opens]
    return Probe(taken, ended)


def classify(opens: list[Open], before: dict[str, Any], after: dict[str, Any]) -> str:
    """Mark the opens that fetched their shard (cold ones), when the residency was not
    known in advance; returns how it was told.

    The replies say it (``hit``); a daemon older than that field is told by its hit and
    miss counters (``before`` and ``after`` the opens), else by how long each open took.
    An open that never answered is cold.
    """
    answered = [o for o in opens if o.done is not None]
    if answered and all(o.hit is not None for o in answered):
        for o in answered:
            o.cold = not o.hit
        how = "open replies"
    else:
        how = _classify_by_counters(answered, before, after)
    for o in opens:
        if o.done is None:
            o.cold = True
    return how


def _classify_by_counters(
    answered: list[Open], before: dict[str, Any], after: dict[str, Any]
) -> str:
    hits = after["hits"] - before["hits"]
    misses = after["misses"] - before["misses"]
    by_time = sorted(answered, key=lambda o: (o.done or 0.0) - o.sent, reverse=True)
    if hits + misses == len(answered):
        # Nobody else opened anything meanwhile: the daemon's count is exact, and a miss
        # (a download) takes longer than a hit.
        for i, o in enumerate(by_time):
            o.cold = i < misses
        return "daemon counters"
    latencies = sorted((o.done or 0.0) - o.sent for o in answered)
    quick = latencies[: max(1, len(latencies) // 4)] if latencies else [0.0]
    cutoff = max(0.1, 4 * quick[-1])
    for o in answered:
        o.cold = (o.done or 0.0) - o.sent > cutoff
    return "open times"


def store_rate(probe: Probe) -> StoreRate | None:
    """Bytes per second of the cold opens, from the first one sent to the last arrival
    (downloads still running then counted by how far they got, estimated); None when no
    open was cold."""
    cold = [o for o in probe.opens if o.cold]
    if not cold:
        return None
    arrived = [(o, o.done, o.size) for o in cold if o.done is not None and o.size is not None]
    pending = [o for o in cold if o.done is None]
    first = min(o.sent for o in cold)
    got = sum(size for _, _, size in arrived)
    if not pending:
        seconds = max(1e-6, max(done for _, done, _ in arrived) - first)
        return StoreRate(got / seconds, len(arrived), got, seconds, 0, False)
    note = f"{len(pending)} more still arriving at the end"
    sizes = [o.size for o in probe.opens if o.size is not None]
    if arrived:
        # Until the last arrival; a download still running had gone as fast as those that
        # arrived (they shared the store), up to a shard's mean size.
        last = max(done for _, done, _ in arrived)
        speed = sum(size / max(1e-6, done - o.sent) for o, done, size in arrived) / len(arrived)
        mean = sum(sizes) / len(sizes)
        more = sum(min(mean, speed * max(0.0, last - o.sent)) for o in pending)
        seconds = max(1e-6, last - first)
        note += ", their bytes so far estimated"
        return StoreRate(
            (got + more) / seconds, len(arrived), got, seconds, len(pending), False, note
        )
    seconds = max(1e-6, probe.ended - first)
    note = f"no cold shard arrived in {seconds:.0f} s"
    if not sizes:
        return StoreRate(None, 0, 0, seconds, len(pending), True, note)
    # None arrived: the store is slower than all of them within that time.
    bound = len(pending) * (sum(sizes) / len(sizes)) / seconds
    return StoreRate(bound, 0, 0, seconds, len(pending), True, note)
