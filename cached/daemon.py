"""The daemon's life: startup -> serve -> drain (bounded) -> shutdown.

One :class:`contextlib.AsyncExitStack` owns every resource (sources, ZeroMQ server, HTTP
site); background tasks live in one set and are cancelled with a message at shutdown.
Signals only set a flag; a second signal forces the exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import time
from collections import Counter
from typing import Any

from prometheus_client import CollectorRegistry

from . import __version__
from .admission import ConnectionCaps
from .bounds import Bounds
from .config import Config, format_size
from .descriptors import FIXED_OVERHEAD, Budget, Limits, open_count, raise_soft_limit
from .errors import CachedError
from .fetcher import Fetcher
from .history import History
from .hot.tier import HotTier, Shard
from .http import AdminHTTP
from .jobs import JobBoard
from .lock import DirLock
from .loopwatch import LoopWatch
from .metrics import Metrics
from .planner import Planner
from .policy import make_policy
from .prefetcher import Prefetcher
from .server import Server
from .stores.chain import TierChain
from .stores.pacing import RequestPacer
from .systemd import Notifier

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 5.0
# How often the STATUS= line shown by `systemctl status cached` is refreshed.
STATUS_INTERVAL_S = 5.0


class Daemon:
    """A running cached daemon. ``async with Daemon(cfg) as d: await d.serve_until(stop)``."""

    def __init__(self, cfg: Config, registry: CollectorRegistry | None = None) -> None:
        self.cfg = cfg
        self.metrics = Metrics(registry)
        self.ready = False
        self.metrics.ready.set_function(lambda: 1.0 if self.serving() else 0.0)
        # At scrape time (on the event loop, where the scrape is served), not periodically.
        self.metrics.hot_unplanned_bytes.set_function(self._unplanned_bytes)
        # Every request to the warm store takes from this one budget (D45).
        self.pacer = RequestPacer(cfg.s3.max_requests_per_s)
        self.metrics.store_request_rate.set_function(
            lambda: self.pacer.rate if self.pacer.paced else 0.0
        )
        self.started = time.time()
        self._stack = contextlib.AsyncExitStack()
        self._tasks: set[asyncio.Task[None]] = set()
        self.systemd = Notifier()
        self.loop_watch = LoopWatch(self.metrics.loop_lag_seconds)
        self.planner = Planner(cfg.prefetch.plan_timeout_s)
        self.jobs = JobBoard(
            self.metrics, timeout_s=cfg.server.job_timeout_s, max_jobs=cfg.server.max_jobs
        )
        self.limits, self.fds = _descriptor_budget(cfg)
        self.metrics.descriptor_limit.labels("soft").set(self.limits.soft)
        self.metrics.descriptor_limit.labels("hard").set(self.limits.hard)
        self.metrics.connections.set_function(
            lambda: len(self.server.admission or ()) if hasattr(self, "server") else 0
        )
        self.hot = HotTier(
            cfg.cache.dir,
            cfg.cache.capacity_bytes,
            cfg.cache.min_free_bytes,
            make_policy(cfg.cache.policy, self.planner),
            pin_wait_s=cfg.cache.pin_wait_s,
            on_evict=self._count_eviction,
            verify_reads=cfg.cache.verify_reads,
            shared=cfg.server.local_reads,
            max_open_files=self.fds.shard_files,
        )

    async def __aenter__(self) -> Daemon:
        self.systemd.notify(f"STATUS=loading the hot tier from {self.cfg.cache.dir}")
        try:
            # Before anything in the directory is touched: a second daemon on it would
            # delete this one's partial downloads and evict its shards (cached/lock.py).
            self._stack.enter_context(DirLock(self.cfg.cache.dir))
            reloaded = await self._load_hot_tier()
            log.info("hot tier %s: %d complete shards reloaded", self.cfg.cache.dir, reloaded)
            m = self.metrics
            self.sources = await self._stack.enter_async_context(
                TierChain(
                    self.cfg.s3,
                    self.cfg.cold,
                    on_retry=lambda reason: m.retries.labels(reason).inc(),
                    pacer=self.pacer,
                )
            )
            self.fetcher = Fetcher(
                self.sources,
                self.hot,
                self.cfg.prefetch.concurrency,
                m,
                next_use=self.planner.next_use,
            )
            self.prefetcher = Prefetcher(
                self.planner,
                self.fetcher,
                m,
                lookahead_bytes=self.cfg.prefetch.lookahead_bytes,
                concurrency=self.cfg.prefetch.concurrency,
            )
            self.fetcher.gate = self.prefetcher.hold
            self.server = await self._stack.enter_async_context(
                Server(
                    self.cfg.server.socket,
                    self.fetcher,
                    self.hot,
                    m,
                    lease_timeout_s=self.cfg.server.lease_timeout_s,
                    max_read_samples=self.cfg.server.max_read_samples,
                    bounds=Bounds.from_config(self.cfg.server),
                    plan_grace_s=self.cfg.prefetch.plan_grace_s,
                    status=self.status,
                    planner=self.planner,
                    socket_mode=self.cfg.server.socket_mode,
                    socket_group=self.cfg.server.socket_group,
                    allow=self.cfg.server.allow,
                    jobs=self.jobs,
                    local_reads=self.cfg.server.local_reads,
                    connections=ConnectionCaps(
                        per_user=self.fds.connections_per_user,
                        total=self.fds.connections,
                        refuse_from=self.fds.refuse_from,
                    ),
                )
            )
            # The dashboard's last minutes (GET /history), sampled from status().
            self.history = History(self.status)
            try:
                self.http = await self._stack.enter_async_context(
                    AdminHTTP(
                        self.cfg.server.http,
                        m,
                        self.status,
                        self.serving,
                        history=self.history.snapshot,
                        max_connections=self.fds.http_connections,
                    )
                )
            except OSError as exc:
                raise CachedError(
                    f"cannot listen for HTTP on {self.cfg.server.http} ([server] http): "
                    f"{exc.strerror or exc}; choose another address, or port 0 for any free one"
                ) from exc
        except BaseException:
            await self._stack.aclose()
            raise
        self._spawn(self.server.serve(), "serve")
        self._spawn(self.server.expire_leases(), "leases")
        self._spawn(self.prefetcher.run(), "prefetch")
        self._spawn(self._refresh_gauges(), "gauges")
        self._spawn(self.loop_watch.run(), "loop watch")
        self._spawn(self.history.run(), "history")
        if self.systemd.enabled:
            self._spawn(self._tell_systemd(), "systemd")
        self.ready = True
        log.info(
            "cached %s ready: socket %s, http %s",
            __version__,
            self.server.bound_endpoint,
            self.http.url,
        )
        self.systemd.notify("READY=1", f"STATUS={self.status_line()}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.ready = False
        self.systemd.notify(
            "STOPPING=1", "STATUS=draining: finishing replies, dropping partial downloads"
        )
        for task in self._tasks:
            task.cancel(msg="cached is shutting down")
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=DRAIN_TIMEOUT_S)
            if pending:
                log.warning("%d background tasks did not stop in time", len(pending))
        # In this order: requests under way finish or are answered shutting_down (the
        # receive loop stopped above, so none is added), promotions get the drain time,
        # downloads are cancelled (no partial file stays), and only then do the sources
        # (the S3 client) close, with the rest of the stack.
        if hasattr(self, "server"):
            await self.server.drain(DRAIN_TIMEOUT_S)
        if hasattr(self, "fetcher"):
            # A promotion half done is harmless (the next miss reads the cold tier), but
            # one about to finish saves the next node that read: give it the drain time.
            try:
                await asyncio.wait_for(self.fetcher.drain(), DRAIN_TIMEOUT_S)
            except TimeoutError:
                log.warning("promotions to the warm tier did not finish in time")
            await self.fetcher.stop()
        await self._stack.aclose()
        log.info("cached stopped")

    async def serve_until(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set or a background task dies."""
        waiter = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({waiter, *self._tasks}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        for task in done:
            if task is not waiter and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]

    def serving(self) -> bool:
        """Ready, and the request loop makes progress: requests that wait to be taken while
        none is taken or finished for STUCK_AFTER_S (every slot held) make it not ready."""
        server: Server | None = getattr(self, "server", None)
        return self.ready and (server is None or not server.stuck)

    def status(self) -> dict[str, Any]:
        """A JSON-able snapshot for ``/status`` and ``cached status``."""
        hot = self.hot.stats()
        m = self.metrics
        plans = self.planner.summary()
        return {
            "version": __version__,
            "uptime_s": round(time.time() - self.started, 3),
            "ready": self.ready,
            "socket": self.server.bound_endpoint if hasattr(self, "server") else None,
            "http": self.http.url if hasattr(self, "http") else None,
            "hot": {
                "dir": str(self.cfg.cache.dir),
                "shards": hot.shards,
                "used_bytes": hot.used_bytes,
                "capacity_bytes": hot.capacity_bytes,
                "capacity_effective_bytes": hot.effective_bytes,
                "pinned_shards": hot.pinned,
                "fetching_shards": hot.fetching,
                "unverified_shards": hot.unverified,
                "policy": self.cfg.cache.policy,
            },
            "tiers": {
                tier: {
                    "fetches": _value(m.fetches, tier=tier, result="ok"),
                    "fetched_bytes": _value(m.fetched_bytes, tier=tier),
                }
                for tier in ("warm", "cold")
            }
            | {"promotions": _value(m.promotions, result="ok")},
            "counters": {
                "hits": _value(m.hits),
                "misses": _value(m.misses),
                "demand_misses": _value(m.misses, kind="demand"),
                "fetched_bytes": _value(m.fetched_bytes),
                "evictions": _value(m.evictions),
                "served_samples": _value(m.served_samples),
                "served_bytes": _value(m.served_bytes),
                "local_read_bytes": _value(m.local_read_bytes),
                "local_fallback_bytes": _value(m.local_fallback_bytes),
                "retries": _value(m.retries),
                "corrupt_shards": _value(m.corrupt_shards),
            },
            "streams": self.server.leases.streams() if hasattr(self, "server") else 0,
            "prefetch": {
                "lookahead_bytes": self.cfg.prefetch.lookahead_bytes,
                "concurrency": self.cfg.prefetch.concurrency,
                "lead_s": _finite(self.prefetcher.lead_s) if hasattr(self, "prefetcher") else None,
                "prefetches": _value(m.prefetches),
            },
            "plans": plans,
            "datasets": self.server.datasets.summary() if hasattr(self, "server") else None,
            "jobs": self.jobs.summary(Counter(str(p["job"]) for p in plans if p["job"])),
            "store": self.fetcher.store_status() if hasattr(self, "fetcher") else None,
            "requests": self._requests_status(),
            "descriptors": self._descriptors_status(),
            "loop": {
                "worst_lag_s": round(self.loop_watch.worst_s, 4),
                "worst_lag_last_minute_s": round(self.loop_watch.recent_worst_s(), 4),
            },
        }

    def _descriptors_status(self) -> dict[str, Any]:
        """The descriptor limit (soft, hard), what is open, and the shares in force."""
        fds, admission = self.fds, self.server.admission if hasattr(self, "server") else None
        return {
            "soft_limit": self.limits.soft,
            "hard_limit": self.limits.hard,
            "open": open_count(),
            "reserve": fds.reserve,
            "connections": len(admission) if admission is not None else 0,
            "max_connections": fds.connections,
            "max_connections_per_user": fds.connections_per_user,
            "connections_by_user": admission.by_user() if admission is not None else {},
            "connections_refused": admission.refused if admission is not None else 0,
            "max_http_connections": fds.http_connections,
            "http_refused": self.http.refused if hasattr(self, "http") else 0,
            "shard_files_open": len(self.hot.files),
            "max_open_files": fds.shard_files,
        }

    def _requests_status(self) -> dict[str, Any]:
        """The warm store's request budget: its ceiling, the rate it paces at now (None:
        not paced), and what it has let through, seen throttled and made wait."""
        pacer = self.pacer
        return {
            "max_per_s": self.cfg.s3.max_requests_per_s,
            "rate_per_s": round(pacer.rate, 3) if pacer.paced else None,
            "sent": pacer.requests,
            "throttled": pacer.throttles,
            "slowed_down": pacer.decreases,
            "waited_s": round(pacer.waited_s, 3),
        }

    async def _load_hot_tier(self) -> int:
        """Load the hot tier, with one clear error for a directory that cannot be used,
        and a warning when the capacity cannot be reached on this file system."""
        directory = self.cfg.cache.dir
        try:
            # In a worker thread: scanning thousands of shard files is blocking file-system
            # work, which stays off the event loop.
            reloaded = await asyncio.to_thread(self.hot.load)
        except OSError as exc:
            raise CachedError(
                f"cannot use the hot tier directory {directory} ([cache] dir): "
                f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
            ) from exc
        disk = shutil.disk_usage(directory).total
        if self.cfg.cache.capacity_bytes > disk:
            log.warning(
                "[cache] capacity %s is more than the %s file system holding %s: the cache is "
                "bounded by the disk (and [cache] min_free %s) instead; set capacity below %s",
                format_size(self.cfg.cache.capacity_bytes),
                format_size(disk),
                directory,
                format_size(self.cfg.cache.min_free_bytes),
                format_size(disk),
            )
        return reloaded

    def status_line(self) -> str:
        """One line for ``systemctl status``: e.g. "serving: 812 shards, 412 GiB of 500 GiB,
        3 streams, 2 fetching"."""
        hot = self.hot.stats()
        streams = self.server.leases.streams() if hasattr(self, "server") else 0
        return (
            f"serving: {hot.shards} shards, {format_size(hot.used_bytes)} of "
            f"{format_size(hot.capacity_bytes)}, {streams} streams, {hot.fetching} fetching"
        )

    def _unplanned_bytes(self) -> float:
        """Bytes of resident shards that no live plan names: a dict lookup per shard."""
        names = self.planner.names
        return float(sum(s.reserved_bytes for s in self.hot.resident() if not names(s.url)))

    def _count_eviction(self, shard: Shard) -> None:
        self.metrics.evictions.inc()
        self.metrics.evicted_bytes.inc(shard.reserved_bytes)
        if hasattr(self, "prefetcher"):
            self.prefetcher.wake()  # room for the window again

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)

    async def _refresh_gauges(self) -> None:
        m = self.metrics
        while True:
            hot = self.hot.stats()
            m.hot_bytes.set(hot.used_bytes)
            m.hot_capacity_bytes.set(hot.capacity_bytes)
            m.hot_capacity_effective_bytes.set(hot.effective_bytes)
            m.hot_shards.set(hot.shards)
            m.pinned_shards.set(hot.pinned)
            m.fetching_shards.set(hot.fetching)
            self.hot.files.sweep()
            m.shard_files_open.set(len(self.hot.files))
            self.jobs.expire()
            await asyncio.sleep(1.0)

    async def _tell_systemd(self) -> None:
        """Refresh STATUS= and, when the unit sets WatchdogSec=, send WATCHDOG=1 at half of
        it. From the event loop on purpose: a loop that stops turning stops the pings, and
        systemd restarts the daemon."""
        watchdog = self.systemd.watchdog_interval_s
        period = STATUS_INTERVAL_S if watchdog is None else min(STATUS_INTERVAL_S, watchdog)
        last_status = time.monotonic()
        while True:
            now = time.monotonic()
            # Not while the request loop is stuck: a loop that turns but serves no one is
            # restarted as one that stopped turning is.
            lines = ["WATCHDOG=1"] if watchdog is not None and self.serving() else []
            if now - last_status >= STATUS_INTERVAL_S or not lines:
                lines.append(f"STATUS={self.status_line()}")
                last_status = now
            self.systemd.notify(*lines)
            await asyncio.sleep(period)


def _descriptor_budget(cfg: Config) -> tuple[Limits, Budget]:
    """The descriptor limit raised to the hard one, and shared out (cached/descriptors.py);
    a warning where it holds fewer connections or shard files than configured."""
    limits = raise_soft_limit()
    server = cfg.server
    pools = cfg.s3.max_pool_connections * (2 if cfg.cold.enabled else 1)
    budget = Budget.plan(
        limits.soft,
        open_count(),
        fixed=FIXED_OVERHEAD + pools + 2 * cfg.prefetch.concurrency,
        max_connections=server.max_connections,
        max_connections_per_user=server.max_connections_per_user,
        max_open_files=cfg.cache.max_open_files,
        max_http_connections=server.max_http_connections,
    )
    if limits.soft > limits.found_soft:
        log.info("descriptor limit raised from %d to %d", limits.found_soft, limits.soft)
    if budget.scaled(server.max_connections, cfg.cache.max_open_files):
        log.warning(
            "the descriptor limit (%d) holds %d connections (%d per user) and %d open shard "
            "files, not the %d, %d and %d configured, with %d kept in reserve: raise "
            "LimitNOFILE= (the container runtime's nofile, or `ulimit -n`)",
            limits.soft,
            budget.connections,
            budget.connections_per_user,
            budget.shard_files,
            server.max_connections,
            server.max_connections_per_user,
            cfg.cache.max_open_files,
            budget.reserve,
        )
    return limits, budget


def _finite(x: float) -> float | None:
    """JSON has no infinity: None stands for "nothing planned is missing"."""
    return None if x == float("inf") else round(x, 3)


def _value(metric: Any, **labels: str) -> float:
    """Sum of a counter over its label sets (those matching ``labels``)."""
    return float(
        sum(
            s.value
            for fam in metric.collect()
            for s in fam.samples
            if s.name.endswith("_total") and labels.items() <= s.labels.items()
        )
    )


async def run(cfg: Config) -> None:
    """Run a daemon until SIGINT/SIGTERM. A second signal cancels the drain at once."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    main = asyncio.current_task()
    signals = (signal.SIGINT, signal.SIGTERM)

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.warning("second %s: exiting now", sig.name)
            if main is not None:
                main.cancel()
            return
        log.info("%s received: draining (send it again to exit at once)", sig.name)
        stop.set()

    for sig in signals:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        async with Daemon(cfg) as daemon:
            await daemon.serve_until(stop)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
