"""Prometheus metrics of the daemon, on a registry that is passed in (never the global one).

Names follow Prometheus conventions: ``cached_`` prefix, base units, ``_total`` counters.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

from . import gpu

_FETCH_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """Every metric the daemon exports. One instance per daemon."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        # process_* (CPU seconds, resident memory, open fds against the limit, start time)
        # and python_info: what an operator checks first when the daemon misbehaves.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.descriptor_limit = Gauge(
            "cached_descriptor_limit",
            "The daemon's descriptor limit (RLIMIT_NOFILE), soft (raised to the hard one at "
            "start; process_max_fds too) and hard",
            ["kind"],
            registry=r,
        )
        self.connections = Gauge(
            "cached_connections", "Client connections kept on the ZeroMQ socket", registry=r
        )
        self.connections_refused = Counter(
            "cached_connections_refused_total",
            "Connections shut as they were accepted, by reason: user (its user's cap), total "
            "(the daemon's cap), descriptors (the descriptor reserve)",
            ["reason"],
            registry=r,
        )
        self.shard_files_open = Gauge(
            "cached_shard_files_open",
            "Hot-tier shard files kept open for socket reads (bounded: [cache] max_open_files)",
            registry=r,
        )
        self.hits = Counter(
            "cached_hits_total",
            "Shard opens (and whole reads) served from the hot tier",
            registry=r,
        )
        self.misses = Counter(
            "cached_misses_total",
            "Shard opens (and whole reads) that had to wait for a fetch",
            ["kind"],
            registry=r,
        )
        self.fetched_bytes = Counter(
            "cached_fetched_bytes_total",
            "Bytes downloaded, by tier (warm, cold)",
            ["tier"],
            registry=r,
        )
        self.fetches = Counter(
            "cached_fetches_total",
            "Shard fetches by tier (warm, cold) and result",
            ["tier", "result"],
            registry=r,
        )
        self.fetch_seconds = Histogram(
            "cached_fetch_seconds",
            "Time to fetch, verify and publish one shard",
            buckets=_FETCH_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "cached_fetch_retries_total", "Retried remote requests", ["reason"], registry=r
        )
        self.hot_waits = Histogram(
            "cached_hot_wait_seconds",
            "Time reservations in the hot tier waited, by what for: room (readers' pins, "
            "downloads under way, the disk) or unlink (evicted files leaving the disk)",
            ["wait"],
            buckets=_FETCH_BUCKETS,
            registry=r,
        )
        self.hot_wait_timeouts = Counter(
            "cached_hot_wait_timeouts_total",
            "Reservations in the hot tier whose wait ran out its deadline ([cache] pin_wait_s; "
            "a GET held at its headers waits 1 s for unlinks)",
            ["wait"],
            registry=r,
        )
        self.evictions = Counter("cached_evictions_total", "Shards evicted", registry=r)
        self.evicted_bytes = Counter(
            "cached_evicted_bytes_total", "Bytes evicted from the hot tier", registry=r
        )
        self.served_samples = Counter(
            "cached_served_samples_total", "Samples sent to clients", registry=r
        )
        self.served_bytes = Counter(
            "cached_served_bytes_total",
            "Payload bytes served to clients (sent, or read by them from the hot tier's files)",
            registry=r,
        )
        self.local_read_bytes = Counter(
            "cached_local_read_bytes_total",
            "Payload bytes of reads answered for local clients to read from the hot tier's "
            "files, not sent (less cached_local_fallback_bytes_total: what they read)",
            registry=r,
        )
        self.local_fallback_bytes = Counter(
            "cached_local_fallback_bytes_total",
            "Payload bytes of local replies a client could not use and asked again through "
            "the socket (sent then; counted as served once)",
            registry=r,
        )
        self.requests = Counter(
            "cached_requests_total", "Client requests", ["op", "result"], registry=r
        )
        self.demand_wait_seconds = Histogram(
            "cached_demand_wait_seconds",
            "How long a client's open waited for its shard",
            buckets=_FETCH_BUCKETS,
            registry=r,
        )
        self.hot_bytes = Gauge("cached_hot_bytes", "Bytes held by the hot tier", registry=r)
        self.hot_capacity_bytes = Gauge(
            "cached_hot_capacity_bytes", "Capacity of the hot tier", registry=r
        )
        self.hot_capacity_effective_bytes = Gauge(
            "cached_hot_capacity_effective_bytes",
            "The bound the hot tier keeps now: its capacity, or less where the disk has less "
            "room (the tier's bytes and the free space, less [cache] min_free)",
            registry=r,
        )
        self.hot_shards = Gauge("cached_hot_shards", "Shards resident in the hot tier", registry=r)
        self.pinned_shards = Gauge(
            "cached_pinned_shards", "Shards held by readers (not evictable)", registry=r
        )
        self.fetching_shards = Gauge(
            "cached_fetching_shards", "Shards being downloaded", registry=r
        )
        self.promotions = Counter(
            "cached_promotions_total",
            "Shards read from the cold tier and written back to the warm tier",
            ["result"],
            registry=r,
        )
        self.prefetches = Counter(
            "cached_prefetches_total",
            "Prefetches by result (ok, not_admitted: no room without evicting a shard "
            "needed sooner, failed)",
            ["result"],
            registry=r,
        )
        self.prefetch_lead_seconds = Gauge(
            "cached_prefetch_lead_seconds",
            "Estimated seconds until a reader needs the first planned shard that is not "
            "resident (how far prefetch is ahead; 1e9 when everything planned is resident)",
            registry=r,
        )
        self.plans = Gauge("cached_plans", "Reader plans the daemon follows", registry=r)
        self.streams = Gauge(
            "cached_streams",
            "Client streams reading: holding a shard, or that held one in the last 10 s",
            registry=r,
        )
        self.corrupt_shards = Counter(
            "cached_corrupt_shards_total",
            "Shards found corrupt in the hot tier and dropped (found: read, when a read's "
            "members failed their checksums; io, when a read failed: EIO, a short file; "
            "check, when a reloaded shard was read back)",
            ["found"],
            registry=r,
        )
        self.store_reachable = Gauge(
            "cached_store_reachable",
            "1 while the object store answers, 0 during an outage (resident shards served)",
            registry=r,
        )
        self.requests_in_flight = Gauge(
            "cached_requests_in_flight",
            "Client requests being handled (waiting on a download, or being answered)",
            registry=r,
        )
        self.ready = Gauge(
            "cached_ready", "1 once the daemon serves, 0 before and while draining", registry=r
        )
        self.hot_unplanned_bytes = Gauge(
            "cached_hot_unplanned_bytes",
            "Resident bytes of shards that no live plan names",
            registry=r,
        )
        self.store_request_rate = Gauge(
            "cached_store_request_rate",
            "Requests per second the warm store's budget lets through now ([s3] "
            "max_requests_per_s, lowered after SlowDown); 0: not paced",
            registry=r,
        )
        # What the trainers experience, as their processes report it (cached/jobs.py).
        self.jobs = Gauge("cached_jobs", "Jobs that reported recently", registry=r)
        self.job_wait_seconds = Counter(
            "cached_job_wait_seconds_total",
            "Seconds the job's training loops waited for their next batch",
            ["job"],
            registry=r,
        )
        self.job_loop_seconds = Counter(
            "cached_job_loop_seconds_total",
            "Seconds of the job's training loops (waiting and computing)",
            ["job"],
            registry=r,
        )
        self.job_batches = Counter(
            "cached_job_batches_total", "Batches the job's training loops took", ["job"], registry=r
        )
        self.job_ready_batches = Gauge(
            "cached_job_ready_batches",
            "Batches ready when the job's loops last asked (summed over its processes)",
            ["job"],
            registry=r,
        )
        gpu.register(r)
        self.loop_lag_seconds = Histogram(
            "cached_event_loop_lag_seconds",
            "How late the event loop woke a periodic task: how long it was blocked",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
