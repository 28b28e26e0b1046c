"""Jobs: what the trainers on this node experience, as they report it.

A training process measures how long its loop waited for the next batch (the client's
``StallMeter``, ``DeviceLoader`` and ``FastLoader``) and reports cumulative totals every
few seconds (op ``report``). One *job* is every process that reports under one name
(its ranks on this node); each process is a *reporter*. The board turns the reporters'
cumulative figures into per-job Prometheus counters: a report adds what grew since the
reporter's previous one, so a lost report loses nothing (the next carries the totals),
and a daemon that restarts does not count a process's past twice.

Plain data, no I/O: the server calls it from the event loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import LimitExceeded
from .errors import ProtocolError as BadRequest
from .metrics import Metrics

# Longest job name and reporter id accepted (they become label values).
MAX_NAME = 128
MAX_REPORTER = 64


@dataclass
class _Reporter:
    """One process's last cumulative figures."""

    wait_s: float = 0.0
    loop_s: float = 0.0
    batches: int = 0
    ready: int | None = None
    seen: float = 0.0


@dataclass
class _Job:
    name: str
    wait_s: float = 0.0
    loop_s: float = 0.0
    batches: int = 0
    seen: float = 0.0
    reporters: dict[str, _Reporter] = field(default_factory=dict)

    def ready(self) -> int | None:
        known = [r.ready for r in self.reporters.values() if r.ready is not None]
        return sum(known) if known else None


@dataclass(frozen=True)
class Report:
    """One ``report`` request, checked."""

    job: str
    reporter: str
    wait_s: float
    loop_s: float
    batches: int
    ready: int | None
    started: float = 0.0  # Unix time the reporter began counting (0: unknown)

    @classmethod
    def parse(cls, header: Mapping[str, Any]) -> Report:
        """The report a request header carries; :class:`BadRequest` naming the field."""
        return cls(
            job=_name(header, "job", MAX_NAME),
            reporter=_name(header, "reporter", MAX_REPORTER),
            wait_s=_seconds(header, "wait_s"),
            loop_s=_seconds(header, "loop_s"),
            batches=_count(header, "batches"),
            ready=None if header.get("ready") is None else _count(header, "ready"),
            started=0.0 if header.get("started") is None else _seconds(header, "started"),
        )


# I64: jobs stay bounded and lapse with their series.
class JobBoard:
    """Every job that reported recently, and its counters in ``metrics``.

    Args:
        metrics: where the ``cached_job_*`` series live.
        timeout_s: a reporter silent this long is forgotten (a process that ended; live
            ones report at least every 30 s); a job with no reporter left is dropped, and
            its series with it.
        max_jobs, max_reporters: caps (each job is a label value: a client must not be able
            to grow the metrics without bound); past them ``limit_exceeded``.
    """

    def __init__(
        self,
        metrics: Metrics,
        *,
        timeout_s: float = 120.0,
        max_jobs: int = 256,
        max_reporters: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metrics = metrics
        # A reporter that began counting before this daemon started (it restarted) has
        # totals that the previous instance counted: its first report is a baseline.
        self.started = time.time()
        self.timeout_s = timeout_s
        self.max_jobs = max_jobs
        self.max_reporters = max_reporters
        self.clock = clock
        self._jobs: dict[str, _Job] = {}

    def report(self, r: Report) -> None:
        """Add what grew since this reporter's previous report to its job's counters."""
        now = self.clock()
        self.expire(now)
        job = self._jobs.get(r.job)
        if job is None:
            if len(self._jobs) >= self.max_jobs:
                raise LimitExceeded(
                    f"the daemon already follows {len(self._jobs)} jobs, its cap; reports of "
                    f"job {r.job!r} are refused until one ends (jobs lapse "
                    f"{self.timeout_s:g} s after their last report)"
                )
            job = self._jobs[r.job] = _Job(r.job)
        last = job.reporters.get(r.reporter)
        if last is None:
            if sum(len(j.reporters) for j in self._jobs.values()) >= self.max_reporters:
                raise LimitExceeded(
                    f"the daemon already follows {self.max_reporters} reporting processes, "
                    "its cap; this report is refused"
                )
            last = job.reporters[r.reporter] = _Reporter()
            if r.started and r.started < self.started:
                last.wait_s, last.loop_s, last.batches = r.wait_s, r.loop_s, r.batches
        # Cumulative figures only grow; a smaller one is a reporter that started over.
        wait = r.wait_s - last.wait_s if r.wait_s >= last.wait_s else r.wait_s
        loop = r.loop_s - last.loop_s if r.loop_s >= last.loop_s else r.loop_s
        batches = r.batches - last.batches if r.batches >= last.batches else r.batches
        job.wait_s += wait
        job.loop_s += loop
        job.batches += batches
        last.wait_s, last.loop_s, last.batches, last.ready = (
            r.wait_s,
            r.loop_s,
            r.batches,
            r.ready,
        )
        last.seen = job.seen = now
        m = self.metrics
        m.job_wait_seconds.labels(r.job).inc(wait)
        m.job_loop_seconds.labels(r.job).inc(loop)
        m.job_batches.labels(r.job).inc(batches)
        self._publish_ready(job)
        m.jobs.set(len(self._jobs))

    def expire(self, now: float | None = None) -> None:
        """Forget silent reporters, and jobs with none left (and their series)."""
        now = self.clock() if now is None else now
        for job in list(self._jobs.values()):
            gone = [k for k, r in job.reporters.items() if now - r.seen > self.timeout_s]
            for key in gone:
                del job.reporters[key]
            if not job.reporters:
                del self._jobs[job.name]
                for series in self._series():
                    series.remove(job.name)
            elif gone:
                self._publish_ready(job)
        self.metrics.jobs.set(len(self._jobs))

    def summary(self, plans: Mapping[str, int] | None = None) -> list[dict[str, Any]]:
        """Per-job state for ``/status``; ``plans`` counts the live plans of each job."""
        now = self.clock()
        plans = plans or {}
        return [
            {
                "job": job.name,
                "wait_fraction": round(job.wait_s / job.loop_s, 4) if job.loop_s > 0 else None,
                "wait_s": round(job.wait_s, 3),
                "loop_s": round(job.loop_s, 3),
                "batches": job.batches,
                "ready": job.ready(),
                "reporters": len(job.reporters),
                "plans": plans.get(job.name, 0),
                "idle_s": round(now - job.seen, 3),
            }
            for job in sorted(self._jobs.values(), key=lambda j: j.name)
        ]

    def _publish_ready(self, job: _Job) -> None:
        ready = job.ready()
        gauge = self.metrics.job_ready_batches
        if ready is None:
            if (job.name,) in gauge._metrics:  # no reporter can tell any more
                gauge.remove(job.name)
        else:
            gauge.labels(job.name).set(ready)

    def _series(self) -> list[Any]:
        m = self.metrics
        return [
            s
            for s in (m.job_wait_seconds, m.job_loop_seconds, m.job_batches, m.job_ready_batches)
            if s is not None
        ]


def _name(header: Mapping[str, Any], key: str, longest: int) -> str:
    value = header.get(key)
    if not isinstance(value, str) or not value or len(value) > longest:
        raise BadRequest(f"report field {key!r} must be a string of 1 to {longest} characters")
    if not value.isprintable():
        raise BadRequest(f"report field {key!r} must be printable text")
    return value


def _seconds(header: Mapping[str, Any], key: str) -> float:
    value = header.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"report field {key!r} must be a number of seconds")
    if not math.isfinite(value) or value < 0:
        raise BadRequest(f"report field {key!r} must be finite and not negative")
    return float(value)


def _count(header: Mapping[str, Any], key: str) -> int:
    value = header.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest(f"report field {key!r} must be a non-negative integer")
    return value
