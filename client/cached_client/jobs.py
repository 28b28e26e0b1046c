"""Jobs: the training loop's wait for data, reported to the daemon in the background.

The loop's wait is measured in the process that runs the loop (:func:`timed`, used by
``StallMeter``, ``DeviceLoader`` and ``FastLoader``), and added to this process's
:class:`JobReporter` for the job. A background thread sends the reporter's cumulative
totals to the daemon every :data:`REPORT_INTERVAL_S` while they change (and at least
every :data:`HEARTBEAT_S`, so the daemon knows the process lives), and once more when an
iteration ends. Never on the hot path: a batch costs two clock reads and a lock.

A job is named by the loaders' ``job=`` argument, else ``$CACHED_JOB``, else a name made
from the script and the launch, the same in every rank of one ``torchrun`` launch (see
:func:`job_name`). Every rank and worker on a node is one job at the daemon.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import zmq
from cached_wire.protocol import Op, decode, encode

from .errors import UsageError

log = logging.getLogger(__name__)

T = TypeVar("T")

JOB_ENV = "CACHED_JOB"
# How often a changed total is sent, and how often an unchanged one is (the daemon forgets
# a process silent for [server] job_timeout_s, 120 s by default).
REPORT_INTERVAL_S = 2.0
HEARTBEAT_S = 30.0
MAX_JOB_NAME = 128

# (wait_s, loop_s, batches, ready) of one step of a timed loop.
Record = Callable[[float, float, int, "int | None"], None]


def job_name(job: str | None = None) -> str:
    """``job`` if given, else ``$CACHED_JOB``, else a generated name.

    The generated name is the script's name and a short hash of the launch: torchrun's
    run id (``$TORCHELASTIC_RUN_ID``), else the rendezvous address every rank shares
    (``$MASTER_ADDR:$MASTER_PORT``), else this process's id. So the ranks of one launch
    on a node are one job, and DataLoader workers (which get the name from the loader
    made in the main process) belong to it too.
    """
    name = job or os.environ.get(JOB_ENV) or _generated()
    if len(name) > MAX_JOB_NAME or not name.isprintable():
        raise UsageError(
            f"job name {name[:40]!r}... must be printable text of at most {MAX_JOB_NAME} characters"
            if len(name) > MAX_JOB_NAME
            else f"job name {name!r} must be printable text"
        )
    return name


def _generated() -> str:
    stem = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else ""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        launch = run_id
    elif os.environ.get("MASTER_PORT"):
        launch = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ['MASTER_PORT']}"
    else:
        launch = str(os.getpid())
    digest = hashlib.sha1(launch.encode()).hexdigest()[:6]
    return f"{stem or 'python'}-{digest}"


class JobReporter:
    """This process's cumulative figures for one job, sent to the daemon by a thread.

    :meth:`add` is all a loop calls; the thread starts at the first one. Use
    :func:`reporter` to get the process's one reporter for a job and endpoint.
    """

    def __init__(self, job: str, endpoint: str, interval_s: float = REPORT_INTERVAL_S) -> None:
        self.job = job
        self.endpoint = endpoint
        self.interval_s = interval_s
        self.id = uuid.uuid4().hex[:12]
        # When counting began: a daemon that started later has missed the earlier figures
        # and takes the first report it gets as a baseline, not as growth.
        self.started = time.time()
        self.wait_s = 0.0
        self.loop_s = 0.0
        self.batches = 0
        self.ready: int | None = None
        self.sent = 0  # reports handed to ZeroMQ (for tests and debugging)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._warned: set[str] = set()

    def add(self, wait_s: float, loop_s: float, batches: int, ready: int | None) -> None:
        """Count one step of the loop: ``wait_s`` of ``loop_s`` spent waiting for data."""
        with self._lock:
            self.wait_s += wait_s
            self.loop_s += loop_s
            self.batches += batches
            if ready is not None:
                self.ready = ready
        if self._thread is None:
            self._start()

    def flush(self) -> None:
        """Send the totals now (in the background), e.g. at the end of an epoch."""
        self._wake.set()

    def close(self, timeout_s: float = 1.0) -> None:
        """Send the last totals and stop the thread (at interpreter exit)."""
        thread = self._thread
        if thread is None:
            return
        self._stop = True
        self._wake.set()
        thread.join(timeout_s)

    def snapshot(self) -> dict[str, Any]:
        """The report as it would be sent now."""
        with self._lock:
            return {
                "op": Op.REPORT,
                "job": self.job,
                "reporter": self.id,
                "started": self.started,
                "wait_s": self.wait_s,
                "loop_s": self.loop_s,
                "batches": self.batches,
                "ready": self.ready,
            }

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(
                target=self._run, name=f"cached-report-{self.job}", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        # A daemon that is away must not make reports pile up: past a few queued, a
        # report is dropped (the next one carries the totals).
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        last: dict[str, Any] | None = None
        last_at = 0.0
        try:
            while True:
                self._wake.wait(self.interval_s)
                self._wake.clear()
                report = self.snapshot()
                now = time.monotonic()
                if report != last or now - last_at >= HEARTBEAT_S or self._stop:
                    try:
                        sock.send(encode({**report, "id": self.sent + 1}), zmq.NOBLOCK)
                        self.sent += 1
                        last, last_at = report, now
                    except zmq.Again:
                        pass  # the daemon is away; the next report says it all
                self._drain(sock)
                if self._stop:
                    # At exit: give the last report a moment to leave.
                    sock.setsockopt(zmq.LINGER, 500)
                    return
        finally:
            sock.close()
            ctx.term()

    def _drain(self, sock: zmq.Socket[bytes]) -> None:
        """Read the daemon's answers; say once per kind what a refused report means."""
        while sock.poll(0, zmq.POLLIN):
            frames = sock.recv_multipart()
            try:
                header = decode(frames[0])
            except Exception:
                continue
            if header.get("ok") is False:
                code = str(header.get("code"))
                if code not in self._warned:
                    self._warned.add(code)
                    log.warning(
                        "the cached daemon refused job %r's report: %s: %s",
                        self.job,
                        code,
                        header.get("message"),
                    )


_reporters: dict[tuple[str, str], JobReporter] = {}
_reporters_pid = 0
_reporters_lock = threading.Lock()


def reporter(job: str, endpoint: str) -> JobReporter:
    """This process's reporter for ``job`` at ``endpoint`` (one per process: a forked
    child gets its own, with its own id)."""
    global _reporters_pid
    with _reporters_lock:
        if _reporters_pid != os.getpid():
            _reporters.clear()
            _reporters_pid = os.getpid()
        found = _reporters.get((job, endpoint))
        if found is None:
            found = _reporters[(job, endpoint)] = JobReporter(job, endpoint)
        return found


@atexit.register
def _close_all() -> None:
    if _reporters_pid == os.getpid():
        for r in list(_reporters.values()):
            r.close()


_nesting = threading.local()


def timed(
    iterable: Iterable[T],
    record: Record | None = None,
    *,
    ready: Callable[[Any], int | None] | None = None,
    report: JobReporter | None = None,
) -> Iterator[T]:
    """Yield from ``iterable``, timing the loop around it.

    After each item, ``record(wait_s, loop_s, 1, ready)``: the time the loop waited for
    that item, and the loop time since the previous one (so the loop times add up to the
    whole iteration). At the end (exhausted or closed early), one more record of the rest.
    ``ready(iterator)`` is asked, just before each wait, how many items are ready.

    ``report`` gets the same records, and a flush at the end, but only when this loop is
    not itself inside another timed loop's wait (a ``FastLoader`` wrapped in a
    ``StallMeter``): the outermost measures the training loop, and the job's wait is not
    counted twice.
    """
    it = iter(iterable)
    depth = getattr(_nesting, "depth", 0)
    sink = report if depth == 0 else None
    last = time.perf_counter()
    done = False

    def both(wait_s: float, loop_s: float, batches: int, depth_now: int | None) -> None:
        if record is not None:
            record(wait_s, loop_s, batches, depth_now)
        if sink is not None:
            sink.add(wait_s, loop_s, batches, depth_now)

    try:
        while True:
            depth_now = _probe(ready, it)
            t0 = time.perf_counter()
            _nesting.depth = depth + 1
            try:
                item = next(it)
            except StopIteration:
                now = time.perf_counter()
                both(now - t0, now - last, 0, depth_now)
                done = True
                return
            finally:
                _nesting.depth = depth
            now = time.perf_counter()
            both(now - t0, now - last, 1, depth_now)
            last = now
            yield item
    finally:
        if not done:  # left early (break, an error): the time since the last item
            both(0.0, time.perf_counter() - last, 0, None)
        if sink is not None:
            sink.flush()


def _probe(ready: Callable[[Any], int | None] | None, it: Any) -> int | None:
    if ready is None:
        return None
    try:
        return ready(it)
    except Exception:  # a probe of another library's internals: never worth a failure
        return None


def dataloader_ready(it: Any) -> int | None:
    """Batches a torch DataLoader iterator holds ready (received from its workers and not
    yet taken), or None when it cannot tell (no workers, another loader).

    Reads the iterator's private state (``_data_queue``, ``_task_info``), so it is best
    effort: a torch that changes them gives None, never an error.
    """
    queue = getattr(it, "_data_queue", None)
    tasks = getattr(it, "_task_info", None)
    if queue is None or not isinstance(tasks, dict):
        return None
    early = sum(1 for info in tasks.values() if isinstance(info, tuple) and len(info) == 2)
    return int(queue.qsize()) + early


def origin(loader: Any) -> tuple[str, str] | None:
    """The (job, endpoint) of the cached loader ``loader`` reads from: a ``FastLoader`` or
    ``CachedDataset`` itself, a DataLoader over a ``CachedDataset``, or a wrapper (such as
    ``DeviceLoader``) of one of them. None when it reads from none."""
    for _ in range(4):  # wrappers of wrappers, within reason
        job, endpoint = getattr(loader, "job", None), getattr(loader, "endpoint", None)
        if isinstance(job, str) and isinstance(endpoint, str):
            return job, endpoint
        inner = getattr(loader, "dataset", None) or getattr(loader, "loader", None)
        if inner is None:
            return None
        loader = inner
    return None
