"""Soak: many real client streams at full speed against one daemon, for minutes.

One ``cached serve`` subprocess serves a dataset twice its hot tier out of an S3 server
(moto, in its own process), so shards are evicted and fetched again all the time. Against
it run, by default, 32 client streams at full speed (no compute between batches):

- 16 ``CachedDataset`` readers: 4 client processes, each one DataLoader with 4 worker
  processes (``persistent_workers=True``, ``set_epoch`` per epoch, as the README trains);
  every worker is one stream with its own connection to the daemon;
- 16 ``FastLoader`` streams: 2 client processes with 8 threads each, one loader per
  thread.

Every unit (a DataLoader, or a FastLoader) reads whole shuffled epochs of the whole
dataset (its own seed) until the time is up. Every sample's bytes follow from its key
(``shake_128(key)``, a length from the key's hash), so each sample is checked byte for
byte where it is consumed, and every key exactly once per epoch: per DataLoader worker
against that worker's share of the epoch (``partition.reader_parts``), per FastLoader
against the whole dataset. The epoch cut off by the time limit must have no duplicate or
foreign key.

Meanwhile, from outside the daemon: its resident memory, open file descriptors and
threads (``/proc/<pid>``) every second; ``/status`` every 5 s; and the latency of
``GET /healthz`` sent every 100 ms on one kept-alive connection: the handler is trivial
and runs on the daemon's event loop, so its worst latency bounds from above how long the
loop went without turning (an outside measurement: it also holds the prober's own
scheduling delay on a loaded machine, reported beside it). Where the daemon watches its
own loop (``/status`` ``loop``, ``cached_event_loop_lag_seconds``), that is reported too.

It reports figures and never passes or fails (exit 0 unless it crashed): the growth of
resident memory from ``--ref-at`` (60 s; a third of a shorter run) to the end, as medians
of the 1 s samples in a window around each (10 s; 5 s when short); the descriptors other
than the hot tier's shard files, under load and after it against the idle set of before
it; the errors, warnings, duplicate, missing, foreign and corrupt samples; hung clients;
how the daemon stopped. ``tests/test_soak.py`` runs ``--small --compare`` and judges them.

A JSON record (every sample, probe and check) goes to ``bench/out/soak-<timestamp>.json``.

    python bench/soak.py                 # the benchmark: 10 minutes (make soak)
    python bench/soak.py --small         # CI: 60 s on a smaller dataset, reference at 20 s
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import hashlib
import http.client
import json
import logging
import multiprocessing
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing.process import BaseProcess
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common, hostile
from cached.config import parse_size
from cached_demo.stack import DaemonProcess, s3_endpoint, write_config
from cached_demo.tars import make_tar

BUCKET = "soak"
PREFIX = "train"
# Probes of the event loop: one GET /healthz this often.
PROBE_INTERVAL_S = 0.1
PROBE_TIMEOUT_S = 30.0
# /proc samples (memory, fds, threads) this often; /status this often.
SAMPLE_INTERVAL_S = 1.0
STATUS_INTERVAL_S = 5.0
# A DataLoader that yields nothing for this long raises (DataLoader(timeout=)): a hang. A
# healthy wait is at most a fetch plus [cache] pin_wait_s (30 s).
LOADER_TIMEOUT_S = 120.0
# After the deadline, a client process that has not reported within this long is hung.
REPORT_GRACE_S = LOADER_TIMEOUT_S + 30
# A daemon that has not exited this long after SIGTERM is stuck in its drain.
STOP_TIMEOUT_S = 20.0
# After the load, how long the daemon's descriptors may take to settle to the idle set.
SETTLE_S = 20.0
# A unit that raised this many times stops (the rest of the soak goes on).
MAX_ERRORS_PER_UNIT = 3
# Examples kept per kind of finding (the counts are always complete).
EXAMPLES = 5
# Waits between items kept per unit for the latency percentiles.
GAP_SAMPLES = 20_000

# -- the dataset --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dataset:
    """``shards`` tar shards of ``per_shard`` samples each. A sample is ``<key>.bin``
    (``shake_128(key)``, between half and 1.5 times ``sample_size`` bytes, its length
    from the key's hash) and ``<key>.cls`` (a decimal from the hash): the bytes follow from
    the key, so any reader can check every byte without a table."""

    shards: int
    per_shard: int
    sample_size: int

    @property
    def urls(self) -> list[str]:
        return [f"s3://{BUCKET}/{PREFIX}/{self.object_name(s)}" for s in range(self.shards)]

    @staticmethod
    def object_name(shard: int) -> str:
        return f"shard-{shard:06d}.tar"

    def keys(self, shard: int) -> list[str]:
        """The sample keys of ``shard``, in order."""
        return [f"k{shard:06d}-{i:05d}" for i in range(self.per_shard)]

    @property
    def samples(self) -> int:
        return self.shards * self.per_shard

    def members(self, key: str) -> tuple[bytes, bytes]:
        """The ``bin`` and ``cls`` bytes of sample ``key``."""
        h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
        size = self.sample_size // 2 + h % self.sample_size
        return hashlib.shake_128(key.encode()).digest(size), b"%d" % (h >> 40)

    def tar(self, shard: int) -> bytes:
        """The shard's tar bytes (the same on every call)."""
        return make_tar(
            (key, dict(zip(("bin", "cls"), self.members(key), strict=True)))
            for key in self.keys(shard)
        )


def shard_of(key: str) -> int:
    """The shard a key belongs to (``k000012-00003`` -> 12)."""
    return int(key[1:7])


# -- checking what a unit receives ------------------------------------------------------------


@dataclass
class Findings:
    """What went wrong in what a unit received (counts, and a few examples each)."""

    duplicates: int = 0
    foreign: int = 0  # a key that is not in this stream's share of the epoch
    missing: int = 0  # keys of a completed epoch never delivered
    corrupt: int = 0  # bytes (or a member set) that do not follow from the key
    examples: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        if len(self.examples) < EXAMPLES * 4:
            self.examples.append(what)

    def total(self) -> int:
        return self.duplicates + self.foreign + self.missing + self.corrupt


class EpochCheck:
    """One epoch of one unit: every key at most once, each from the stream whose share it
    is, every byte as the key says; at the end of a completed epoch, every key seen."""

    def __init__(self, data: Dataset, epoch: int, expected: dict[int, set[str]]) -> None:
        self.data = data
        self.epoch = epoch
        self.expected = expected  # stream -> its keys this epoch
        self.seen: set[str] = set()
        self.samples = 0
        self.bytes = 0

    def add(
        self,
        findings: Findings,
        stream: int,
        key: str,
        members: dict[str, bytes],
        url: str | None = None,
    ) -> None:
        self.samples += 1
        if key in self.seen:
            findings.duplicates += 1
            findings.note(f"epoch {self.epoch} stream {stream}: {key} delivered twice")
        self.seen.add(key)
        if key not in self.expected.get(stream, ()):
            findings.foreign += 1
            findings.note(f"epoch {self.epoch} stream {stream}: {key} is not in its share")
        expect_bin, expect_cls = self.data.members(key)
        got_bin, got_cls = members.get("bin"), members.get("cls")
        self.bytes += sum(len(v) for v in members.values())
        bad = (
            set(members) != {"bin", "cls"}
            or got_bin is None
            or got_cls is None
            or got_cls != expect_cls
            or len(got_bin) != len(expect_bin)
            or got_bin != expect_bin
            or (url is not None and url != self.data.urls[shard_of(key)])
        )
        if bad:
            findings.corrupt += 1
            sizes = {ext: len(v) for ext, v in members.items()}
            findings.note(
                f"epoch {self.epoch} stream {stream}: {key} corrupt: members {sizes}, "
                f"expected bin {len(expect_bin)} B, cls {expect_cls!r}; url {url}"
            )

    def complete(self, findings: Findings) -> None:
        """The epoch ended on its own: every expected key must have come."""
        for stream, keys in self.expected.items():
            lost = keys - self.seen
            if lost:
                findings.missing += len(lost)
                findings.note(
                    f"epoch {self.epoch} stream {stream}: {len(lost)} keys never came, e.g. "
                    f"{sorted(lost)[:3]}"
                )


@dataclass
class UnitReport:
    """What one unit (a DataLoader with its workers, or one FastLoader) did."""

    name: str
    kind: str  # "dataloader" or "fast"
    streams: int
    epochs_complete: int = 0
    epoch_samples: int = 0  # samples of one whole epoch
    partial_epoch_samples: int = 0  # delivered in epochs cut off (the time limit, an error)
    samples: int = 0
    bytes: int = 0
    epoch_s: list[float] = field(default_factory=list)
    max_gap_s: float = 0.0  # the longest wait for the next sample or batch
    # Waits for the next sample or batch: a uniform sample of at most GAP_SAMPLES of them.
    gaps: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    findings: Findings = field(default_factory=Findings)

    def end_epoch(self, check: EpochCheck, *, cut: bool, started: float) -> None:
        """Count an epoch's delivery: a whole one is checked complete (every key once), a
        cut-off one (the time limit, an error) only for what it delivered."""
        self.samples += check.samples
        self.bytes += check.bytes
        if cut:
            self.partial_epoch_samples += check.samples
        else:
            check.complete(self.findings)
            self.epochs_complete += 1
            self.epoch_s.append(time.monotonic() - started)


class Gaps:
    """The time between two consecutive items a unit received: the longest, and a uniform
    sample of all of them (reservoir sampling, so a 10-minute run keeps a bounded list)."""

    def __init__(self, seed: int = 0) -> None:
        self.last = time.monotonic()
        self.worst = 0.0
        self.seen = 0
        self.kept: list[float] = []
        self._rng = random.Random(seed)

    def tick(self) -> None:
        now = time.monotonic()
        gap = now - self.last
        self.worst = max(self.worst, gap)
        self.last = now
        self.seen += 1
        if len(self.kept) < GAP_SAMPLES:
            self.kept.append(gap)
        else:
            slot = self._rng.randrange(self.seen)
            if slot < GAP_SAMPLES:
                self.kept[slot] = gap


def dataset_keys(data: Dataset, shards: Sequence[int]) -> set[str]:
    return {key for s in shards for key in data.keys(s)}


# -- client processes ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientPlan:
    """What one client process runs (sent to it when it is spawned)."""

    name: str
    kind: str  # "dataloader", "fast", or a hostile client's kind (bench/hostile.py)
    data: Dataset
    socket: str
    units: int  # DataLoaders (always 1 here) or FastLoader threads
    workers: int  # DataLoader workers per loader
    batch_size: int
    seed: int
    stacks: str  # where faulthandler writes every thread's stack on SIGUSR1


class WarningCounter(logging.Handler):
    """Counts the client library's warnings (a reconnect, a restart seen) and keeps a few."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0
        self.examples: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        if len(self.examples) < EXAMPLES:
            self.examples.append(f"{record.name}: {record.getMessage()}")


def client_main(
    plan: ClientPlan,
    events: Any,  # multiprocessing Queue: ("ready"|"report", name, payload)
    go: Any,  # multiprocessing Event
    deadline: Synchronized[float],
) -> None:
    """A client process: build its loaders, wait for the start, run to the deadline, report."""
    stacks = open(plan.stacks, "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    # torch's advice against more workers than cores: over-subscribing is the point here.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    counter = WarningCounter()
    logging.getLogger("cached_client").addHandler(counter)
    reports: list[UnitReport] = []
    if plan.kind in hostile.KINDS:
        events.put(("ready", plan.name, None))
        go.wait()
        bad = hostile.run(plan.kind, plan.name, plan.socket, plan.data.urls, deadline.value)
        events.put(("report", plan.name, {"hostile": bad.as_dict()}))
        return
    try:
        runners: list[Callable[[float], UnitReport]] = []
        if plan.kind == "dataloader":
            runners.append(_dataloader_unit(plan, 0))
        else:
            runners.extend(_fast_unit(plan, u) for u in range(plan.units))
        events.put(("ready", plan.name, None))
        go.wait()
        end = deadline.value
        if len(runners) == 1:
            reports.append(runners[0](end))
        else:
            with ThreadPoolExecutor(len(runners), thread_name_prefix=plan.name) as pool:
                reports.extend(pool.map(lambda run: run(end), runners))
    except BaseException as exc:  # a failure to start: say so instead of hanging the run
        err = UnitReport(plan.name, plan.kind, 0)
        err.errors.append("".join(traceback.format_exception(exc)))
        reports.append(err)
    events.put(
        (
            "report",
            plan.name,
            {
                "units": [asdict(r) for r in reports],
                "warnings": counter.count,
                "warning_examples": counter.examples,
            },
        )
    )


def close_loader(loader: Any) -> None:
    """Stop a DataLoader's persistent workers now. Left to the interpreter's exit, they are
    terminated first and the DataLoader's SIGCHLD handler then raises in the exiting
    process ("worker ... killed by signal: Terminated"). No public API does this; the
    iterator's own clean-up method is what its ``__del__`` calls."""
    it = getattr(loader, "_iterator", None)
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    loader._iterator = None


def tag_worker(sample: dict[str, Any]) -> dict[str, Any]:
    """``decode`` for the DataLoader: note which worker (stream) read the sample."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    sample["__worker__"] = 0 if info is None else info.id
    return sample


def _dataloader_unit(plan: ClientPlan, unit: int) -> Callable[[float], UnitReport]:
    """A DataLoader over a ``CachedDataset``, ``plan.workers`` workers (one stream each)."""
    from cached_client import CachedDataset
    from cached_client.partition import reader_parts
    from torch.utils.data import DataLoader

    data = plan.data
    seed = plan.seed * 1000 + unit
    report = UnitReport(plan.name, "dataloader", plan.workers, epoch_samples=data.samples)

    def make() -> tuple[Any, Any]:
        ds = CachedDataset(
            data.urls,
            socket=plan.socket,
            shuffle=True,
            seed=seed,
            rank=0,
            world_size=1,
            decode=tag_worker,
        )
        loader = DataLoader(
            ds,
            batch_size=None,
            num_workers=plan.workers,
            persistent_workers=True,
            timeout=LOADER_TIMEOUT_S,
            # Fork, as a training script's DataLoader does on Linux. This process was
            # spawned, which makes spawn its default: 16 workers would each import torch
            # afresh and load the two cores for the first half minute.
            multiprocessing_context="fork",
        )
        return ds, loader

    def shares(epoch: int) -> dict[int, set[str]]:
        return {
            w: dataset_keys(
                data,
                [
                    p.shard
                    for p in reader_parts(
                        data.shards,
                        shuffle=True,
                        seed=seed,
                        epoch=epoch,
                        stream=w,
                        streams=plan.workers,
                    )
                ],
            )
            for w in range(plan.workers)
        }

    ds, loader = make()

    def run(end: float) -> UnitReport:
        nonlocal ds, loader
        epoch, gaps = 0, Gaps()
        while time.monotonic() < end and len(report.errors) < MAX_ERRORS_PER_UNIT:
            ds.set_epoch(epoch)
            check = EpochCheck(data, epoch, shares(epoch))
            started = time.monotonic()
            cut = False
            try:
                for sample in loader:
                    gaps.tick()
                    members = {k: v for k, v in sample.items() if not k.startswith("__")}
                    check.add(
                        report.findings,
                        sample["__worker__"],
                        sample["__key__"],
                        members,
                        sample["__url__"],
                    )
                    if time.monotonic() >= end:
                        cut = True
                        break
            except Exception as exc:
                report.errors.append(f"epoch {epoch}: {''.join(traceback.format_exception(exc))}")
                cut = True
                with contextlib.suppress(Exception):
                    close_loader(loader)
                ds, loader = make()
                gaps.last = time.monotonic()  # a new loader's start is not a gap
            report.end_epoch(check, cut=cut, started=started)
            epoch += 1
        report.max_gap_s, report.gaps = gaps.worst, gaps.kept
        try:
            close_loader(loader)
        except Exception as exc:
            report.errors.append(f"shutting down: {''.join(traceback.format_exception(exc))}")
        return report

    return run


def _fast_unit(plan: ClientPlan, unit: int) -> Callable[[float], UnitReport]:
    """One ``FastLoader`` (one stream), run in a thread of its process."""
    from cached_client import FastLoader

    data = plan.data
    seed = plan.seed * 1000 + unit
    report = UnitReport(f"{plan.name}/t{unit}", "fast", 1, epoch_samples=data.samples)
    every = {0: dataset_keys(data, range(data.shards))}

    def make() -> Any:
        return FastLoader(
            data.urls,
            batch_size=plan.batch_size,
            socket=plan.socket,
            shuffle=True,
            seed=seed,
            rank=0,
            world_size=1,
        )

    def run(end: float) -> UnitReport:
        loader = make()
        epoch, gaps = 0, Gaps()
        while time.monotonic() < end and len(report.errors) < MAX_ERRORS_PER_UNIT:
            loader.set_epoch(epoch)
            check = EpochCheck(data, epoch, every)
            started = time.monotonic()
            cut = False
            try:
                for batch in loader:
                    gaps.tick()
                    # One numpy view per extension; members are slices of it, compared with
                    # the expected bytes before the next batch can reuse the ring slot.
                    views = {ext: t.numpy() for ext, t in batch.data.items()}
                    for i, key in enumerate(batch.keys):
                        members: dict[str, bytes] = {}
                        for ext, view in views.items():
                            a, b = batch.offsets[ext][i], batch.offsets[ext][i + 1]
                            if b > a:
                                # A copy: bytes compare with memcmp, 20x faster than a view.
                                members[ext] = view[a:b].tobytes()
                        check.add(report.findings, 0, key, members)
                    if time.monotonic() >= end:
                        cut = True
                        break
            except Exception as exc:
                report.errors.append(f"epoch {epoch}: {''.join(traceback.format_exception(exc))}")
                cut = True
                loader = make()
                gaps.last = time.monotonic()  # a new loader's start is not a gap
            report.end_epoch(check, cut=cut, started=started)
            epoch += 1
        report.max_gap_s, report.gaps = gaps.worst, gaps.kept
        return report

    return run


# -- watching the daemon from outside -----------------------------------------------------------


@dataclass
class ProcSample:
    t: float  # seconds since the start of the load
    rss: int  # VmRSS, bytes
    rss_anon: int
    rss_file: int
    fds: int
    maps: int  # of the fds, the hot tier's open shard files (*.tar): bounded by its shards
    threads: int

    @property
    def other_fds(self) -> int:
        """Descriptors other than shard files: sockets, pipes, downloads, the log."""
        return self.fds - self.maps


def proc_sample(pid: int, t: float, hot_dir: Path) -> ProcSample | None:
    """The daemon's memory, descriptors and threads now; None once it is gone."""
    try:
        fields: dict[str, int] = {}
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                name, _, rest = line.partition(":")
                if name in ("VmRSS", "RssAnon", "RssFile", "Threads"):
                    fields[name] = int(rest.split()[0])
        kinds = fd_kinds(pid, hot_dir)
    except (OSError, ValueError):
        return None
    if not kinds:
        return None  # gone between the two reads
    kib = 1024
    return ProcSample(
        t,
        fields.get("VmRSS", 0) * kib,
        fields.get("RssAnon", 0) * kib,
        fields.get("RssFile", 0) * kib,
        sum(kinds.values()),
        kinds.get("hot tier *.tar", 0),
        fields.get("Threads", 0),
    )


def fd_kinds(pid: int, hot_dir: Path) -> dict[str, int]:
    """The daemon's descriptors by kind (socket, pipe, anon_inode:..., a file in the hot
    tier by suffix, a deleted one, another file), to say what grew when something did."""
    kinds: dict[str, int] = {}
    hot = str(hot_dir)
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("anon_inode:"):
                kind = target
            elif target.startswith(("socket:", "pipe:")):
                kind = target.split(":", 1)[0]
            elif target.endswith(" (deleted)"):
                kind = "file (deleted)"
            elif target.startswith(hot + "/"):
                kind = "hot tier *" + "".join(Path(target).suffixes[-2:])
            else:
                kind = target
            kinds[kind] = kinds.get(kind, 0) + 1
    return dict(sorted(kinds.items()))


class Watcher:
    """Threads in the orchestrator: /proc samples of the daemon, /status snapshots, and the
    /healthz prober. Times count from the watcher's start until :meth:`rebase` makes the
    moment the streams were let go (:meth:`mark_go`) time 0."""

    def __init__(self, pid: int, http_url: str, hot_dir: Path) -> None:
        self.pid = pid
        self.hot_dir = hot_dir
        host, _, port = http_url.removeprefix("http://").rpartition(":")
        self.host, self.port = host, int(port)
        self.t0 = time.monotonic()
        self.samples: list[ProcSample] = []
        self.statuses: list[dict[str, Any]] = []
        self.probes: list[tuple[float, float, float]] = []  # (t, latency s, prober lateness s)
        self.probe_failures: list[str] = []
        self.daemon_gone_at: float | None = None
        self.go_at: float | None = None
        self.idle_rss: int | None = None  # VmRSS before the load
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._sample_loop, name="soak-sample", daemon=True),
            threading.Thread(target=self._probe_loop, name="soak-probe", daemon=True),
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def mark_go(self) -> None:
        """The streams start now."""
        self.go_at = self.now()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def since_go(self) -> float | None:
        """Seconds since the streams started; None before."""
        return None if self.go_at is None else self.now() - self.go_at

    def rebase(self) -> None:
        """Make the start of the load time 0 in every record (call after :meth:`stop`)."""
        shift = self.go_at or 0.0
        for s in self.samples:
            s.t -= shift
        for st in self.statuses:
            st["t"] = round(st["t"] - shift, 2)
        self.probes = [(t - shift, lat, late) for t, lat, late in self.probes]
        if self.daemon_gone_at is not None:
            self.daemon_gone_at -= shift

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=PROBE_TIMEOUT_S + 5)

    def get(self, path: str, timeout_s: float = 10.0) -> bytes:
        """One GET on a fresh connection (for /status and /metrics)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"GET {path}: HTTP {resp.status}")
            return body
        finally:
            conn.close()

    def _sample_loop(self) -> None:
        next_status = 0.0
        while not self._stop.is_set():
            t = self.now()
            s = proc_sample(self.pid, t, self.hot_dir)
            if s is None:
                if self.daemon_gone_at is None:
                    self.daemon_gone_at = t
            else:
                self.samples.append(s)
            if time.monotonic() >= next_status and s is not None:
                next_status = time.monotonic() + STATUS_INTERVAL_S
                with contextlib.suppress(Exception):
                    status = json.loads(self.get("/status"))
                    self.statuses.append({"t": round(self.now(), 2), **_status_brief(status)})
            self._stop.wait(SAMPLE_INTERVAL_S)

    def _probe_loop(self) -> None:
        conn: http.client.HTTPConnection | None = None
        due = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if now < due:
                self._stop.wait(due - now)
                continue
            late = now - due
            # A fixed grid: a slow probe is followed by the next slot, never by a burst.
            due += PROBE_INTERVAL_S * (1 + int(late // PROBE_INTERVAL_S))
            try:
                if conn is None:
                    conn = http.client.HTTPConnection(self.host, self.port, timeout=PROBE_TIMEOUT_S)
                    conn.connect()
                sent = time.monotonic()
                conn.request("GET", "/healthz")
                resp = conn.getresponse()
                resp.read()
                latency = time.monotonic() - sent
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}")
                self.probes.append((self.now(), latency, late))
            except Exception as exc:
                self.probe_failures.append(f"t={self.now():.1f}s: {type(exc).__name__}: {exc}")
                if conn is not None:
                    conn.close()
                conn = None
        if conn is not None:
            conn.close()

    def progress_line(self, interval_s: float) -> str:
        """One line while the load runs: time, memory, fds, serving rate, worst probe."""
        t = self.since_go() or 0.0
        last = self.samples[-1] if self.samples else None
        recent = [lat for when, lat, _ in self.probes if when >= self.now() - interval_s]
        served = [st for st in self.statuses if st.get("served_samples") is not None]
        rate = ""
        if len(served) > 1:
            a, b = (
                served[max(0, len(served) - 1 - int(interval_s // STATUS_INTERVAL_S))],
                served[-1],
            )
            if b["t"] > a["t"]:
                per_s = (b["served_samples"] - a["served_samples"]) / (b["t"] - a["t"])
                rate = f", {per_s:,.0f} samples/s served"
        return (
            f"  {t:5.0f}s: RSS {common.human(last.rss) if last else '?'}, "
            f"{last.fds if last else '?'} fds{rate}, worst /healthz of the last "
            f"{interval_s:.0f}s {_ms(max(recent, default=None))}"
        )

    def probes_between(self, t0: float, t1: float) -> list[tuple[float, float, float]]:
        return [p for p in self.probes if t0 <= p[0] < t1]

    def samples_between(self, t0: float, t1: float) -> list[ProcSample]:
        return [s for s in self.samples if t0 <= s.t <= t1]


def warm_up(socket: str, url: str) -> None:
    """Fetch ``url`` into the daemon's hot tier with ``cached prefetch`` (raises if it
    fails): the daemon then holds its S3 client, as it does from its first fetch on."""
    subprocess.run(
        [sys.executable, "-m", "cached", "prefetch", "--socket", socket, url],
        check=True,
        capture_output=True,
        timeout=60,
    )


def not_hot(kinds: dict[str, int]) -> dict[str, int]:
    """Descriptor kinds other than the hot tier's shard files."""
    return {k: n for k, n in kinds.items() if not k.startswith("hot tier")}


def settle_fds(watcher: Watcher, pid: int, hot_dir: Path, before: dict[str, int]) -> dict[str, Any]:
    """After the clients left: wait (up to ``SETTLE_S``) until every descriptor but the
    hot tier's shard files is back to the idle set of before the load (client connections
    closed, downloads finished), and no descriptor holds a deleted (evicted) shard. The
    hot tier's files must then number at most its resident shards: the daemon keeps one
    descriptor per shard it serves through the socket (``pread.ShardFile``), and an
    evicted shard must have let its go."""
    give_up = time.monotonic() + SETTLE_S
    while True:
        kinds = fd_kinds(pid, hot_dir)
        shards: int | None = None
        with contextlib.suppress(Exception):
            shards = int(json.loads(watcher.get("/status"))["hot"]["shards"])
        settled = not_hot(kinds) == not_hot(before) and "file (deleted)" not in kinds
        if settled or time.monotonic() > give_up:
            break
        time.sleep(1)
    maps = sum(n for k, n in kinds.items() if k.startswith("hot tier *.tar"))
    return {
        "fd_kinds": kinds,
        "settled": settled,
        "hot_maps": maps,
        "resident_shards": shards,
    }


def _status_brief(status: dict[str, Any]) -> dict[str, Any]:
    """The fields of a /status reply worth keeping every 5 s."""
    c, hot = status.get("counters", {}), status.get("hot", {})
    return {
        "served_samples": c.get("served_samples"),
        "served_bytes": c.get("served_bytes"),
        "hits": c.get("hits"),
        "misses": c.get("misses"),
        "evictions": c.get("evictions"),
        "fetched_bytes": c.get("fetched_bytes"),
        "retries": c.get("retries"),
        "corrupt_shards": c.get("corrupt_shards"),
        # The daemon's own event-loop watch (a periodic task's lateness), where it has one.
        "loop_worst_lag_s": status.get("loop", {}).get("worst_lag_s"),
        "loop_worst_lag_last_minute_s": status.get("loop", {}).get("worst_lag_last_minute_s"),
        "streams": status.get("streams"),
        "hot_bytes": hot.get("used_bytes"),
        "pinned_shards": hot.get("pinned_shards"),
        "fetching_shards": hot.get("fetching_shards"),
    }


LAG_HISTOGRAM = "cached_event_loop_lag_seconds"


def scrape_process_metrics(watcher: Watcher) -> dict[str, float]:
    """The daemon's own process_* figures from /metrics (a cross-check of /proc), and its
    event-loop lag histogram where it has one (``<name>_bucket:<le>``, ``<name>_count``)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    with contextlib.suppress(Exception):
        text = watcher.get("/metrics").decode()
        for family in text_string_to_metric_families(text):
            if family.name in ("process_resident_memory_bytes", "process_open_fds"):
                for s in family.samples:
                    out[s.name] = s.value
            elif family.name == LAG_HISTOGRAM:
                for s in family.samples:
                    if s.name.endswith("_bucket"):
                        out[f"{s.name}:{s.labels['le']}"] = s.value
                    elif s.name.endswith("_count"):
                        out[s.name] = s.value
    return out


def inside_lag(
    marks: dict[str, Any], statuses: Sequence[dict[str, Any]], end_s: float
) -> dict[str, Any] | None:
    """The daemon's own loop-lag figures (None from a daemon without them): the worst since
    its start and in the last minute of the load (``/status``), and from the reference to
    the end how many of its periodic ticks came late by over 100 and 250 ms (histogram)."""
    loaded = [st for st in statuses if st.get("loop_worst_lag_s") is not None and st["t"] <= end_s]
    if not loaded:
        return None
    out: dict[str, Any] = {
        "worst_s": loaded[-1]["loop_worst_lag_s"],
        "worst_last_minute_at_end_s": loaded[-1]["loop_worst_lag_last_minute_s"],
    }
    ref: dict[str, float] = marks.get("ref", {}).get("metrics", {})
    end: dict[str, float] = marks.get("end", {}).get("metrics", {})
    count = f"{LAG_HISTOGRAM}_count"
    if count in ref and count in end:

        def late(over: str) -> float:
            key = f"{LAG_HISTOGRAM}_bucket:{over}"
            return (end[count] - end.get(key, 0.0)) - (ref[count] - ref.get(key, 0.0))

        out.update(ticks=end[count] - ref[count], over_100ms=late("0.1"), over_250ms=late("0.25"))
    return out


# -- the run --------------------------------------------------------------------------------


def serve_s3(conn: Any, stop: Any) -> None:
    """The S3 server's process: moto on loopback until ``stop`` is set. Apart from the
    orchestrator so that its request handling (Python, under the GIL) never delays the
    prober or the samplers."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with s3_endpoint() as url:
        conn.send(url)
        stop.wait()


def upload(endpoint: str, data: Dataset, log: Callable[[str], None]) -> int:
    """Write every shard into the bucket; returns the dataset's tar bytes."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    started = time.perf_counter()

    def put(shard: int) -> int:
        body = data.tar(shard)
        client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{data.object_name(shard)}", Body=body)
        return len(body)

    with ThreadPoolExecutor(4) as pool:
        total = sum(pool.map(put, range(data.shards)))
    log(
        f"dataset: {data.shards} shards x {data.per_shard} samples of ~"
        f"{common.human(data.sample_size)} ({data.samples:,} samples, {common.human(total)} of "
        f"tar), written to s3://{BUCKET}/{PREFIX}/ in {time.perf_counter() - started:.1f}s"
    )
    return total


def client_plans(
    args: argparse.Namespace, data: Dataset, socket: str, work: Path
) -> list[ClientPlan]:
    plans = [
        ClientPlan(
            f"loader{i}",
            "dataloader",
            data,
            socket,
            1,
            args.workers,
            args.batch_size,
            100 + i,
            str(work / f"loader{i}.stacks"),
        )
        for i in range(args.loaders)
    ]
    plans += [
        ClientPlan(
            f"fast{i}",
            "fast",
            data,
            socket,
            args.fast_streams,
            0,
            args.batch_size,
            200 + i,
            str(work / f"fast{i}.stacks"),
        )
        for i in range(args.fast_procs)
    ]
    if args.hostile:
        plans += [
            ClientPlan(kind, kind, data, socket, 1, 0, 0, 0, str(work / f"{kind}.stacks"))
            for kind in hostile.KINDS
        ]
    return plans


@dataclass
class ClientResults:
    units: list[UnitReport]
    warnings: int
    warning_examples: list[str]
    hung: dict[str, str]  # client name -> its threads' stacks
    exit_codes: dict[str, int | None]
    hostile: list[dict[str, Any]] = field(default_factory=list)  # HostileReport.as_dict()


def run_clients(
    plans: Sequence[ClientPlan],
    watcher: Watcher,
    duration_s: float,
    progress_s: float,
    log: Callable[[str], None],
) -> ClientResults:
    """Spawn the client processes, start them together, wait for their reports."""
    ctx = multiprocessing.get_context("spawn")
    events = ctx.Queue()
    go = ctx.Event()
    deadline = ctx.Value("d", 0.0)
    procs: dict[str, BaseProcess] = {}
    try:
        for plan in plans:
            # Not daemonic: a DataLoader's workers are the client's children.
            proc = ctx.Process(
                target=client_main, args=(plan, events, go, deadline), name=plan.name
            )
            proc.start()
            procs[plan.name] = proc
        return _drive_clients(
            plans,
            procs,
            events=events,
            go=go,
            deadline=deadline,
            watcher=watcher,
            duration_s=duration_s,
            progress_s=progress_s,
            log=log,
        )
    finally:
        # Interrupted (SIGTERM, Ctrl-C, a failed start): the interpreter's exit would wait
        # for these non-daemonic processes until their deadline.
        for left in procs.values():
            if left.is_alive():
                kill_tree(left)
                left.join(timeout=10)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), children first."""
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError):
                for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
                    out += [int(child), *descendants(int(child))]
    return out


def kill_tree(proc: BaseProcess) -> None:
    """SIGKILL a client process and its DataLoader workers. Killed alone, it leaves them
    orphaned, and a worker then blocks for good in its exit: it joins its result queue's
    feeder thread, which writes into a pipe no one reads (the worker itself holds the
    read end, inherited, so the write never fails)."""
    if proc.pid is None:
        return
    for pid in [*descendants(proc.pid), proc.pid]:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _drive_clients(
    plans: Sequence[ClientPlan],
    procs: dict[str, BaseProcess],
    *,
    events: Any,
    go: Any,
    deadline: Synchronized[float],
    watcher: Watcher,
    duration_s: float,
    progress_s: float,
    log: Callable[[str], None],
) -> ClientResults:
    """Wait until every client is ready, let them go, collect their reports (a client that
    does not report in time is hung: its stacks are taken and it is killed)."""
    pending_ready = set(procs)
    started = time.monotonic()
    while pending_ready:
        try:
            kind, name, payload = events.get(timeout=5)
        except Exception:
            dead = [n for n in pending_ready if not procs[n].is_alive()]
            if dead or time.monotonic() - started > 300:
                raise RuntimeError(
                    f"client processes did not start: {sorted(pending_ready)}"
                ) from None
            continue
        if kind == "ready":
            pending_ready.discard(name)
        else:  # a report before "ready": it failed to start; keep it for the end
            events.put((kind, name, payload))
            pending_ready.discard(name)
    log(f"clients: {len(procs)} processes ready in {time.monotonic() - started:.1f}s; go")
    watcher.mark_go()
    deadline.value = time.monotonic() + duration_s
    go.set()
    reports: dict[str, dict[str, Any]] = {}
    give_up = deadline.value + REPORT_GRACE_S
    next_progress = time.monotonic() + progress_s
    while len(reports) < len(procs) and time.monotonic() < give_up:
        if time.monotonic() >= next_progress and time.monotonic() < deadline.value:
            next_progress += progress_s
            log(watcher.progress_line(progress_s))
        try:
            kind, name, payload = events.get(timeout=1)
        except Exception:
            continue
        if kind == "report":
            reports[name] = payload
    hung: dict[str, str] = {}
    for plan in plans:
        p = procs[plan.name]
        if plan.name not in reports:
            # A hang: every thread's stack (faulthandler, SIGUSR1), then away with it.
            if p.pid is not None and p.is_alive():
                with contextlib.suppress(OSError):
                    os.kill(p.pid, signal.SIGUSR1)
                time.sleep(2)
            with contextlib.suppress(OSError):
                hung[plan.name] = Path(plan.stacks).read_text()[-20000:]
            kill_tree(p)
        p.join(timeout=60)
        if p.is_alive():
            kill_tree(p)
            p.join(timeout=10)
    good = [r for r in reports.values() if "hostile" not in r]
    units = [UnitReport(**_unit_fields(u)) for r in good for u in r["units"]]
    return ClientResults(
        units,
        sum(r["warnings"] for r in good),
        [w for r in good for w in r["warning_examples"]],
        hung,
        {name: p.exitcode for name, p in procs.items()},
        [r["hostile"] for r in reports.values() if "hostile" in r],
    )


def _unit_fields(d: dict[str, Any]) -> dict[str, Any]:
    return {**d, "findings": Findings(**d["findings"])}


def stop_daemon(proc: Any) -> dict[str, Any]:
    """SIGTERM (the daemon drains and exits 0); after ``STOP_TIMEOUT_S`` SIGABRT, which
    makes Python's faulthandler write every thread's stack to the daemon's log (where the
    report shows it); SIGKILL if even that does not end it."""
    started = time.monotonic()
    sent = "SIGTERM"
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        sent = "SIGTERM, then SIGABRT (stacks in the daemon log)"
        proc.send_signal(signal.SIGABRT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            sent += ", then SIGKILL"
            proc.kill()
            proc.wait()
    return {"exit_code": proc.returncode, "seconds": time.monotonic() - started, "sent": sent}


def daemon_log_problems(path: Path) -> tuple[list[str], list[str]]:
    """(error lines, warning lines) of the daemon's log: tracebacks and ERROR/CRITICAL
    records are errors; WARNING records are reported."""
    errors: list[str] = []
    warnings: list[str] = []
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            if re.search(r"\b(ERROR|CRITICAL)\b|Traceback", line):
                errors.append(line)
            elif re.search(r"\bWARNING\b", line):
                warnings.append(line)
    return errors, warnings


def slope(samples: Sequence[ProcSample], get: Callable[[ProcSample], int]) -> float:
    """The least-squares trend of ``get`` over ``samples``, per second (0 for fewer than 2)."""
    if len(samples) < 2:
        return 0.0
    ts = [s.t for s in samples]
    ys = [float(get(s)) for s in samples]
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    var = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var if var else 0.0


def window(samples: Sequence[ProcSample], get: Callable[[ProcSample], int]) -> dict[str, float]:
    values = [get(s) for s in samples]
    if not values:
        return {"n": 0, "median": float("nan"), "min": float("nan"), "max": float("nan")}
    return {
        "n": len(values),
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--small", action="store_true", help="the CI run: 60 s, the smaller dataset, ref at 20 s"
    )
    p.add_argument("--duration", type=float, help="seconds of load (default 600; --small 60)")
    p.add_argument(
        "--ref-at",
        type=float,
        help="when the reference memory and fds are taken, s (default 60, or a third of a "
        "run shorter than 180 s)",
    )
    p.add_argument("--shards", type=int, help="shards in the dataset (default 768; --small 384)")
    p.add_argument("--per-shard", type=int, default=8, help="samples per shard (8)")
    p.add_argument("--sample-size", default="16KiB", help="mean .bin size (16KiB)")
    p.add_argument("--loaders", type=int, default=4, help="DataLoader processes (4)")
    p.add_argument("--workers", type=int, default=4, help="workers per DataLoader (4)")
    p.add_argument("--fast-procs", type=int, default=2, help="FastLoader processes (2)")
    p.add_argument("--fast-streams", type=int, default=8, help="FastLoader threads each (8)")
    p.add_argument("--batch-size", type=int, default=32, help="FastLoader batch size (32)")
    p.add_argument(
        "--progress", type=float, help="seconds between progress lines (default 60; --small 10)"
    )
    p.add_argument(
        "--hostile",
        action="store_true",
        help="add the hostile clients of bench/hostile.py (one that never reads its replies, "
        "one that sends oversized requests) beside the good streams",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="run twice, without and then with the hostile clients (a fresh daemon each), "
        "and compare the good streams' latency and the daemon's memory",
    )
    p.add_argument("--out", type=Path, default=common.OUT_DIR, help="where the JSON goes")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = p.parse_args(argv)
    args.duration = args.duration or (60.0 if args.small else 600.0)
    if args.ref_at is None:
        args.ref_at = 60.0 if args.duration >= 180 else args.duration / 3
    args.shards = args.shards or (384 if args.small else 768)
    args.progress = args.progress or (10.0 if args.duration < 180 else 60.0)
    args.sample_size = parse_size(args.sample_size)
    # Medians over this many seconds around the reference and before the end.
    args.window = 10.0 if args.duration >= 180 else 5.0
    if args.ref_at + args.window / 2 >= args.duration - args.window:
        p.error("--ref-at must leave room for two windows before the end")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    head, started = common.start_run("soak", "cached soak: many client streams against one daemon")
    log = common.log
    data = Dataset(args.shards, args.per_shard, args.sample_size)
    doc: dict[str, Any] = {
        **head,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "source_digest_at_start": common.source_digest(),
    }
    ctx = multiprocessing.get_context("spawn")
    with common.workdir("cached-soak-", keep=args.keep) as work:
        work.chmod(0o755)  # the hostile clients' other user reaches the sockets under it
        parent, child = ctx.Pipe()
        stop_s3 = ctx.Event()
        s3 = ctx.Process(target=serve_s3, args=(child, stop_s3), name="moto", daemon=True)
        s3.start()
        try:
            if not parent.poll(120):
                raise RuntimeError("the S3 server did not start")
            endpoint: str = parent.recv()
            tar_bytes = upload(endpoint, data, log)
            doc["dataset"] = {**asdict(data), "tar_bytes": tar_bytes}
            phases = (False, True) if args.compare else (args.hostile,)
            for bad in phases:
                args.hostile = bad
                name = "hostile" if bad else "baseline"
                if args.compare:
                    log(
                        f"\n== {name}: a fresh daemon, {'with' if bad else 'without'} the "
                        "hostile clients"
                    )
                here = work / name
                here.mkdir()
                soak(
                    args,
                    data=data,
                    tar_bytes=tar_bytes,
                    endpoint=endpoint,
                    work=here,
                    doc=doc.setdefault(name, {}) if args.compare else doc,
                    log=log,
                )
            if args.compare:
                compare(doc["baseline"]["figures"], doc["hostile"]["figures"], log)
        finally:
            stop_s3.set()
            s3.join(timeout=20)
            if s3.is_alive():
                s3.kill()
    common.note_source_change(doc)
    common.finish_run("soak", doc, started, args.out)
    return 0


def soak(
    args: argparse.Namespace,
    *,
    data: Dataset,
    tar_bytes: int,
    endpoint: str,
    work: Path,
    doc: dict[str, Any],
    log: Callable[[str], None],
) -> None:
    """Run the daemon and the clients, print the figures and record them in ``doc``."""
    socket = f"ipc://{work}/cached.sock"
    hot_dir = work / "hot"
    capacity = tar_bytes // 2
    server: dict[str, Any] = {"socket": socket, "http": "127.0.0.1:0"}
    if args.hostile:
        # The flood and long-URL clients are another user (bench/hostile.py): they reach the
        # socket, and the long URLs meet a byte cap well before the count caps.
        work.chmod(0o755)
        server |= {"socket_mode": "0666", "max_plan_bytes_per_user": "16MiB"}
    config = write_config(
        work / "cached.toml",
        {
            "server": server,
            "cache": {"dir": str(hot_dir), "capacity": capacity, "min_free": 0},
            "s3": {"endpoint_url": endpoint},
        },
    )
    plans = client_plans(args, data, socket, work)
    streams = sum(
        p.workers if p.kind == "dataloader" else p.units
        for p in plans
        if p.kind not in hostile.KINDS
    )
    log(
        f"hot tier {common.human(capacity)} (the dataset is {tar_bytes / capacity:.1f}x it); "
        f"{streams} streams: {args.loaders} DataLoader processes x {args.workers} workers "
        f"(CachedDataset), {args.fast_procs} processes x {args.fast_streams} FastLoader threads "
        f"(batch {args.batch_size}); {args.duration:.0f}s of load, reference at {args.ref_at:.0f}s"
    )
    # PYTHONFAULTHANDLER: a daemon that ignores SIGTERM gets SIGABRT (stop_daemon), and
    # dumps every thread's Python stack into its log first.
    env = {"AWS_EC2_METADATA_DISABLED": "true", "PYTHONFAULTHANDLER": "1"}
    daemon = DaemonProcess(config, socket, env=env)
    watcher: Watcher | None = None
    with daemon:
        assert daemon.proc is not None
        pid = daemon.proc.pid
        http_url = daemon.status()["http"]
        # The idle set is taken once the daemon holds its standing S3 client: it opens it
        # at the first s3:// URL, and awscrt's (the native path, D44) keeps event loops,
        # each an epoll, an eventfd and a timerfd, for its whole life. One shard fetched
        # before the baseline makes them part of it: what the load leaves beyond them
        # is what it leaked.
        warm_up(socket, data.urls[0])
        watcher = Watcher(pid, http_url, hot_dir)
        watcher.start()
        time.sleep(3)  # an idle baseline for the prober
        idle_probes = [p[1] for p in watcher.probes]
        idle = proc_sample(pid, 0.0, hot_dir)
        watcher.idle_rss = idle.rss if idle else None
        doc["idle_before"] = {
            "proc": asdict(idle) if idle else None,
            "fd_kinds": fd_kinds(pid, hot_dir),
            "probe_max_s": max(idle_probes, default=None),
        }
        ref_at, end_at = args.ref_at, args.duration
        # Figures taken while the load runs: at the reference and just before the end.
        marks: dict[str, Any] = {}

        def at_marks() -> None:
            for name, t in (("ref", ref_at), ("end", end_at - 1.0)):
                while not stop_marks.is_set():
                    since = watcher.since_go()
                    if since is not None and since >= t:
                        break
                    stop_marks.wait(0.2)
                if stop_marks.is_set():
                    return
                marks[name] = {
                    "t": round(watcher.since_go() or 0.0, 1),
                    "fd_kinds": fd_kinds(pid, hot_dir),
                    "metrics": scrape_process_metrics(watcher),
                }

        stop_marks = threading.Event()
        marker = threading.Thread(target=at_marks, name="soak-marks", daemon=True)
        clients: ClientResults | None = None
        try:
            marker.start()  # waits for the go, which run_clients gives
            clients = run_clients(plans, watcher, args.duration, args.progress, log)
        finally:
            stop_marks.set()
            marker.join(timeout=30)
        loaded_until = watcher.since_go()
        # The clients are gone: the daemon idles (their leases and plans lapse later).
        settle = settle_fds(watcher, pid, hot_dir, doc["idle_before"]["fd_kinds"])
        after = proc_sample(pid, watcher.now(), hot_dir)
        doc["idle_after"] = {"proc": asdict(after) if after else None, **settle}
        watcher.stop()
        watcher.rebase()
        alive_at_end = daemon.proc.poll() is None
        doc["daemon_stop"] = stop_daemon(daemon.proc)
    log_errors, log_warnings = daemon_log_problems(daemon.log)
    assert clients is not None and watcher is not None
    figures = evaluate(
        args,
        watcher=watcher,
        clients=clients,
        marks=marks,
        alive_at_end=alive_at_end,
        stop=doc["daemon_stop"],
    )
    figures["daemon_log_errors"] = len(log_errors)
    doc.update(
        figures=figures,
        marks=marks,
        loaded_until_s=loaded_until,
        units=[{k: v for k, v in asdict(u).items() if k != "gaps"} for u in clients.units],
        client_warnings=clients.warning_examples,
        client_exit_codes=clients.exit_codes,
        hung=clients.hung,
        daemon_log_errors=log_errors[:50],
        daemon_log_warnings=log_warnings[:50],
        probe_failures=watcher.probe_failures[:50],
        samples=[asdict(s) for s in watcher.samples],
        statuses=watcher.statuses,
        probes=[[round(t, 2), round(lat, 5), round(late, 5)] for t, lat, late in watcher.probes],
    )
    print_report(args, clients, figures, doc, log)
    if log_errors:
        log(f"daemon log: {len(log_errors)} ERROR/traceback lines, e.g. {log_errors[0][:200]}")
    if log_warnings:
        log(f"daemon log: {len(log_warnings)} WARNING lines, e.g. {log_warnings[0][:200]}")
    if watcher.probe_failures:
        log(f"prober: {len(watcher.probe_failures)} failures, e.g. {watcher.probe_failures[0]}")
    if doc["daemon_stop"]["exit_code"] != 0:
        tail = daemon.log_tail(16000)
        doc["daemon_log_tail"] = tail
        log(f"\nthe daemon did not stop cleanly; the end of its log:\n{tail}")
    for name, stacks in clients.hung.items():
        log(f"\n{name} did not finish; its threads:\n{stacks[-6000:]}")
    for u in clients.units:
        for err in u.errors[:2]:
            log(f"\n{u.name}: {err[-3000:]}")
        for ex in u.findings.examples[:EXAMPLES]:
            log(f"{u.name}: {ex}")


def evaluate(
    args: argparse.Namespace,
    *,
    watcher: Watcher,
    clients: ClientResults,
    marks: dict[str, Any],
    alive_at_end: bool,
    stop: dict[str, Any],
) -> dict[str, Any]:
    """The run's figures (tests/test_soak.py judges them; the soak only reports)."""
    w = args.window
    ref = watcher.samples_between(args.ref_at - w / 2, args.ref_at + w / 2)
    end = watcher.samples_between(args.duration - w, args.duration)
    rss_ref, rss_end = window(ref, lambda s: s.rss), window(end, lambda s: s.rss)
    anon_ref, anon_end = window(ref, lambda s: s.rss_anon), window(end, lambda s: s.rss_anon)
    fds_ref, fds_end = window(ref, lambda s: s.fds), window(end, lambda s: s.fds)
    other_ref, other_end = window(ref, lambda s: s.other_fds), window(end, lambda s: s.other_fds)
    maps_ref, maps_end = window(ref, lambda s: s.maps), window(end, lambda s: s.maps)
    loaded_samples = watcher.samples_between(args.ref_at, args.duration)
    thr_ref, thr_end = window(ref, lambda s: s.threads), window(end, lambda s: s.threads)
    growth = rss_end["median"] / rss_ref["median"] - 1 if rss_ref["n"] and end else float("nan")
    anon_growth = (
        anon_end["median"] / anon_ref["median"] - 1 if anon_ref["n"] and end else float("nan")
    )
    loaded = watcher.probes_between(0.0, args.duration)
    lat = sorted(p[1] for p in loaded)
    worst = max(loaded, key=lambda p: p[1], default=None)
    units = clients.units
    complete_expected = sum(u.epochs_complete * u.epoch_samples for u in units)
    complete_delivered = sum(u.samples - u.partial_epoch_samples for u in units)
    f = Findings()
    for u in units:
        f.duplicates += u.findings.duplicates
        f.foreign += u.findings.foreign
        f.missing += u.findings.missing
        f.corrupt += u.findings.corrupt
    errors = sum(len(u.errors) for u in units)
    served = [s for s in watcher.statuses if s.get("served_samples") is not None]
    figures: dict[str, Any] = {
        "rss_ref": rss_ref,
        "rss_end": rss_end,
        "rss_growth": growth,
        "rss_anon_ref": anon_ref,
        "rss_anon_end": anon_end,
        "rss_anon_growth": anon_growth,
        "rss_peak": max((s.rss for s in watcher.samples), default=0),
        "fds_peak": max((s.fds for s in watcher.samples), default=0),
        "fds_ref": fds_ref,
        "fds_end": fds_end,
        "other_fds_ref": other_ref,
        "other_fds_end": other_end,
        "shard_maps_ref": maps_ref,
        "shard_maps_end": maps_end,
        # Least-squares trends from the reference to the end, per minute.
        "fds_per_min": 60 * slope(loaded_samples, lambda s: s.fds),
        "other_fds_per_min": 60 * slope(loaded_samples, lambda s: s.other_fds),
        "rss_bytes_per_min": 60 * slope(loaded_samples, lambda s: s.rss),
        "rss_anon_bytes_per_min": 60 * slope(loaded_samples, lambda s: s.rss_anon),
        "threads_ref": thr_ref,
        "threads_end": thr_end,
        "probes": len(loaded),
        "probe_p50_s": lat[len(lat) // 2] if lat else None,
        "probe_p99_s": lat[int(len(lat) * 0.99)] if lat else None,
        "probe_max_s": worst[1] if worst else None,
        "probe_max_at_s": worst[0] if worst else None,
        "prober_lateness_max_s": max((p[2] for p in loaded), default=None),
        "probe_failures": len(watcher.probe_failures),
        "inside_lag": inside_lag(marks, watcher.statuses, args.duration),
        "daemon_stop": stop,
        "streams": sum(u.streams for u in units),
        "samples": sum(u.samples for u in units),
        "bytes": sum(u.bytes for u in units),
        "complete_epoch_samples_expected": complete_expected,
        "complete_epoch_samples_delivered": complete_delivered,
        "partial_epoch_samples": sum(u.partial_epoch_samples for u in units),
        "epochs_complete": sum(u.epochs_complete for u in units),
        "units_without_complete_epoch": [u.name for u in units if u.epochs_complete == 0],
        "max_gap_s": max((u.max_gap_s for u in units), default=None),
        "errors": errors,
        "client_warnings": clients.warnings,
        "findings": asdict(f),
        "daemon": counter_deltas(served, args.duration),
        # The good streams' waits for their next sample (DataLoader) or batch (FastLoader).
        "latency": {
            kind: percentiles([g for u in units if u.kind == kind for g in u.gaps])
            for kind in ("dataloader", "fast")
        },
        "rss_idle": watcher.idle_rss,
        "hostile": clients.hostile,
    }
    # What tests/test_soak.py judges beside the figures above.
    figures |= {
        "expected_streams": args.loaders * args.workers + args.fast_procs * args.fast_streams,
        "gained_other_fds": figures["other_fds_per_min"] * (args.duration - args.ref_at) / 60,
        "units_without_samples": [u.name for u in units if u.samples == 0],
        "hung": sorted(clients.hung),
        "alive_at_end": alive_at_end,
        "daemon_gone_at_s": watcher.daemon_gone_at,
    }
    return figures


def percentiles(values: Sequence[float]) -> dict[str, float | int | None]:
    """``{"n", "p50", "p99"}`` of ``values`` (None where there are none)."""
    xs = sorted(values)
    if not xs:
        return {"n": 0, "p50": None, "p99": None}
    return {"n": len(xs), "p50": xs[len(xs) // 2], "p99": xs[min(len(xs) - 1, int(len(xs) * 0.99))]}


def compare(base: dict[str, Any], bad: dict[str, Any], log: Callable[[str], None]) -> None:
    """The good streams' latency and the daemon's memory, without and with the hostile
    clients (figures of :func:`evaluate`)."""
    log("\nthe good streams without / with the hostile clients (waits for the next item):")
    for kind in ("dataloader", "fast"):
        a, b = base["latency"][kind], bad["latency"][kind]
        if not a["n"] or not b["n"]:
            continue
        log(
            f"  {kind:<12} p50 {_ms(a['p50'])} / {_ms(b['p50'])} ({b['p50'] / a['p50']:.2f}x), "
            f"p99 {_ms(a['p99'])} / {_ms(b['p99'])} ({b['p99'] / a['p99']:.2f}x)"
        )
    for name in ("rss_idle", "rss_peak"):
        log(f"  {name:<12} {common.human(base[name] or 0)} / {common.human(bad[name] or 0)}")
    log(f"  fds_peak     {base.get('fds_peak', 0):,} / {bad.get('fds_peak', 0):,}")
    log(
        f"  samples      {base['samples']:,} / {bad['samples']:,} "
        f"({bad['samples'] / max(1, base['samples']):.2f}x)"
    )


COUNTERS = (
    "served_samples",
    "served_bytes",
    "hits",
    "misses",
    "evictions",
    "fetched_bytes",
    "retries",
    "corrupt_shards",
)


def counter_deltas(statuses: Sequence[dict[str, Any]], end_s: float) -> dict[str, float | None]:
    """The daemon's counters over the load: from the last /status before the start to the
    last before the end (after it, plans whose readers left still prefetch for a while).
    None for a counter this daemon does not have."""
    before = [st for st in statuses if st["t"] <= 0]
    during = [st for st in statuses if st["t"] <= end_s]
    if not before or not during:
        return dict.fromkeys(COUNTERS)
    a, b = before[-1], during[-1]
    return {k: None if a.get(k) is None or b.get(k) is None else b[k] - a[k] for k in COUNTERS}


def print_report(
    args: argparse.Namespace,
    clients: ClientResults,
    figures: dict[str, Any],
    doc: dict[str, Any],
    log: Callable[[str], None],
) -> None:
    """The tables: per kind of unit, then the daemon's figures."""
    secs = args.duration
    log(
        f"\n{'unit':<12} {'streams':>7} {'epochs':>6} {'samples':>10} {'MB/s':>7} "
        f"{'partial':>8} {'dup':>4} {'miss':>5} {'bad':>4} {'err':>4} {'max gap s':>9}"
    )
    log("-" * 84)
    for kind in ("dataloader", "fast"):
        us = [u for u in clients.units if u.kind == kind]
        if not us:
            continue
        log(
            f"{kind:<12} {sum(u.streams for u in us):>7} {sum(u.epochs_complete for u in us):>6} "
            f"{sum(u.samples for u in us):>10,} {sum(u.bytes for u in us) / secs / 1e6:>7.1f} "
            f"{sum(u.partial_epoch_samples for u in us):>8,} "
            f"{sum(u.findings.duplicates for u in us):>4} "
            f"{sum(u.findings.missing for u in us):>5} "
            f"{sum(u.findings.corrupt + u.findings.foreign for u in us):>4} "
            f"{sum(len(u.errors) for u in us):>4} {max(u.max_gap_s for u in us):>9.2f}"
        )
    f = figures
    d = f["daemon"]
    log(
        f"\ndaemon, {args.duration:.0f}s under load (memory and fds: medians / ranges of 1 s "
        f"samples over {args.window:.0f}s windows):"
    )
    rows = [
        (
            f"RSS at {args.ref_at:.0f}s / end",
            f"{common.human(f['rss_ref']['median'])} / {common.human(f['rss_end']['median'])} "
            f"({f['rss_growth']:+.1%}); peak {common.human(f['rss_peak'])}",
        ),
        (
            "  of it anonymous",
            f"{common.human(f['rss_anon_ref']['median'])} / "
            f"{common.human(f['rss_anon_end']['median'])} ({f['rss_anon_growth']:+.1%})",
        ),
        (
            "trend from the reference",
            f"RSS {common.human(f['rss_bytes_per_min'])}/min (anonymous "
            f"{common.human(f['rss_anon_bytes_per_min'])}/min), fds {f['fds_per_min']:+.2f}/min",
        ),
        (
            f"fds at {args.ref_at:.0f}s / end",
            f"{f['fds_ref']['min']:.0f}-{f['fds_ref']['max']:.0f} / "
            f"{f['fds_end']['min']:.0f}-{f['fds_end']['max']:.0f} (shard maps "
            f"{f['shard_maps_ref']['median']:.0f} / {f['shard_maps_end']['median']:.0f}, "
            f"others {f['other_fds_ref']['median']:.0f} / {f['other_fds_end']['median']:.0f})",
        ),
        (
            f"threads at {args.ref_at:.0f}s / end",
            f"{f['threads_ref']['median']:.0f} / {f['threads_end']['median']:.0f}",
        ),
        (
            "GET /healthz every 100 ms",
            f"{f['probes']} probes: p50 {_ms(f['probe_p50_s'])}, p99 {_ms(f['probe_p99_s'])}, "
            f"max {_ms(f['probe_max_s'])} at {f['probe_max_at_s'] or 0:.0f}s (outside "
            f"measurement); prober's own wake-up lateness max {_ms(f['prober_lateness_max_s'])}",
        ),
        (
            "daemon's own loop watch",
            _inside_lag_line(f["inside_lag"]),
        ),
        (
            "served (daemon counters)",
            f"{d['served_samples'] or 0:,.0f} samples, {(d['served_bytes'] or 0) / 1e6:,.0f} MB",
        ),
        (
            "hot tier",
            f"{d['hits'] or 0:,.0f} hits, {d['misses'] or 0:,.0f} misses, "
            f"{d['evictions'] or 0:,.0f} evictions, "
            f"{(d['fetched_bytes'] or 0) / 1e6:,.0f} MB fetched, "
            f"{d['retries'] or 0:,.0f} retries"
            + ("" if d["corrupt_shards"] is None else f", {d['corrupt_shards']:,.0f} corrupt"),
        ),
        (
            "delivered",
            f"{f['complete_epoch_samples_delivered']:,} samples in "
            f"{f['epochs_complete']} complete unit-epochs (expected "
            f"{f['complete_epoch_samples_expected']:,}), "
            f"+{f['partial_epoch_samples']:,} in cut-off epochs",
        ),
    ]
    for kind, lat in f["latency"].items():
        if lat["n"]:
            rows.append(
                (
                    f"{kind} waits",
                    f"p50 {_ms(lat['p50'])}, p99 {_ms(lat['p99'])} ({lat['n']:,} sampled)",
                )
            )
    for bad in f["hostile"]:
        rows.append(
            (
                f"hostile: {bad['kind']}",
                f"{bad['requests']:,} requests, {bad['connections']} connections"
                + (f", error {bad['errors']}" if bad["errors"] else ""),
            )
        )
    stop = f["daemon_stop"]
    rows.append(("stop", f"exit {stop['exit_code']} {stop['seconds']:.1f}s after {stop['sent']}"))
    for name, value in rows:
        log(f"  {name:<26} {value}")
    if f["units_without_complete_epoch"]:
        log(f"  (no complete epoch: {', '.join(f['units_without_complete_epoch'])})")
    before, after = doc["idle_before"]["fd_kinds"], doc["idle_after"]
    log(
        f"  {'fds after the load':<26} {'settled' if after['settled'] else 'NOT settled'}: "
        f"{sum(not_hot(after['fd_kinds']).values())} other fds (idle before: "
        f"{sum(not_hot(before).values())}), {after['hot_maps']} shard maps for "
        f"{after['resident_shards']} resident shards"
    )


def _inside_lag_line(lag: dict[str, Any] | None) -> str:
    if lag is None:
        return "- (this daemon reports no loop lag)"
    line = (
        f"worst lag {_ms(lag['worst_s'])} since its start, {_ms(lag['worst_last_minute_at_end_s'])}"
        " in the last minute"
    )
    if "ticks" in lag:
        line += (
            f"; from the reference on, {lag['over_100ms']:,.0f} of {lag['ticks']:,.0f} ticks late "
            f"by > 100 ms, {lag['over_250ms']:,.0f} by > 250 ms"
        )
    return line


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f} ms"


if __name__ == "__main__":
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "soak")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "soak")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    sys.exit(main())
