"""What ``cached diagnose`` measured: plain data, handed from the measurements to the model
and the report (JSON as is)."""

from __future__ import annotations

from dataclasses import dataclass, field

# The downloads a daemon runs at once when its status does not say (an older daemon): the
# default ``[prefetch] concurrency``.
DEFAULT_CONCURRENCY = 4


@dataclass
class StoreRate:
    """Cold shards fetched through the daemon."""

    bytes_per_s: float | None  # None: no cold shard arrived, and no size is known
    shards: int  # cold shards that arrived within the budget
    bytes: int
    seconds: float
    pending: int  # cold shards still arriving at the deadline
    upper_bound: bool  # no cold shard arrived: the store is slower than bytes_per_s
    note: str = ""


@dataclass
class ReadRate:
    """Resident shards read through the daemon by ``readers`` processes at once."""

    readers: int
    samples_per_s: float  # all readers together
    bytes_per_s: float
    s_per_sample: float  # one reader's wall time per sample
    cpu_per_sample: float  # one reader's CPU time per sample


@dataclass
class LoaderRate:
    """A DataLoader with ``workers`` workers over ``CachedDataset``, resident shards."""

    workers: int
    samples_per_s: float  # taken as fast as the workers deliver
    start_s: float  # from iter() to the first batch
    hop_s: float  # the training process's time to take one batch the workers made
    batches: int


@dataclass
class Measurements:
    """What diagnose measured and learned about the dataset (JSON as is)."""

    shards: int
    shards_opened: int
    shard_bytes: float  # mean tar size of the shards opened
    samples_per_shard: float
    tar_bytes_per_sample: float  # what the store sends per sample
    payload_bytes_per_sample: float  # what a read sends per sample
    dataset_bytes: float
    epoch_samples: float
    resident_shards: float  # after the store measurement (estimated without the directory)
    # "hot tier directory", "open replies", or for a daemon whose open replies do not say
    # whether they hit: "daemon counters" or "open times"
    residency_from: str
    capacity_bytes: int
    used_bytes: int
    lookahead_bytes: int
    cpus: int
    concurrency: int = DEFAULT_CONCURRENCY  # the daemon's [prefetch] concurrency
    store: StoreRate | None = None
    reads: ReadRate | None = None
    disk_bytes_per_s: float | None = None
    decode_s_per_sample: float | None = None
    decode_cpu_per_sample: float | None = None
    loader: LoaderRate | None = None
    loader_2x: LoaderRate | None = None
    fast_samples_per_s: float | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
