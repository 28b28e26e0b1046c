"""Configuration: TOML file -> ``CACHED_*`` environment -> CLI flags, into frozen dataclasses.

Validated when loaded: unknown sections and keys fail, sizes parse from human strings
("500GiB"), and every error names the file (or variable) and the key.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cached_wire import units
from cached_wire.protocol import DEFAULT_SOCKET

from .config_checks import validate
from .errors import ConfigError

DEFAULT_CONFIG_PATH = Path("/etc/cached/config.toml")
CONFIG_ENV = "CACHED_CONFIG"

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int) -> int:
    """Parse ``"500GiB"``, ``"64MB"``, ``"1.5GiB"`` or a plain integer into bytes."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative: {value}")
        return value
    match = _SIZE.match(str(value))
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {value!r} (use e.g. 500GiB, 64MiB, 10GB or bytes)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


# Bytes for humans (``1536 -> '1.5 KiB'``): the daemon's and `cached diagnose`'s one function,
# which lives in the client (the client never imports the daemon).
format_size = units.format_size


def _size(default: str) -> Any:
    return field(default=parse_size(default), metadata={"size": True})


# An endpoint's URL: botocore takes "127.0.0.1:9000" without complaint and fails only at the
# first request, far from the config line that caused it.
def _endpoint() -> Any:
    return field(default=None, metadata={"endpoint": True})


def _check_endpoint(value: str) -> str:
    if re.fullmatch(r"https?://[^/?#\s]+(/\S*)?", value):
        return value
    if "://" not in value:
        raise ValueError(f"{value!r} has no scheme: write http://{value} (or https://)")
    raise ValueError(f"{value!r} is not an http:// or https:// URL, e.g. http://HOST:PORT")


@dataclass(frozen=True)
class ServerConfig:
    """``[server]``: where clients and operators reach the daemon."""

    socket: str = DEFAULT_SOCKET
    http: str = "127.0.0.1:9464"
    # A stream's pin on a shard lapses this long after its last request or its connection's
    # last heartbeat (a killed or stopped client), at the next sweep: up to 1.25x this.
    lease_timeout_s: float = 120.0
    # Largest number of samples one read request may ask for.
    max_read_samples: int = 4096
    # Caps on what one client (a ZeroMQ connection) may hold: reader plans (one per
    # reader; a DataLoader worker is a client of its own), and shards pinned by its reads.
    max_plans_per_client: int = 64
    max_leases_per_client: int = 4096
    # Fairness on a shared node (docs/operations.md, "Fairness and bounds on a shared node").
    # A request frame larger than this drops its connection before it is buffered (a plan
    # of 1,000,000 URLs of ~100 characters is ~100 MB).
    max_request_bytes: int = _size("128MiB")
    # Requests one connection may have in flight, replies not yet taken included; a reply
    # the client does not take within reply_timeout_s is dropped.
    max_requests_per_client: int = 256
    reply_timeout_s: float = 30.0
    # The same caps per local user (the uid of an ipc connection; a tcp connection is a
    # user of its own) and for all clients together. A plan costs 270-560 bytes per URL
    # (bench/bounds_rss.py, bench/plan_wire.py); the URL caps also bound, apart, the URLs
    # of the datasets each user told (about 107 bytes each; docs/protocol.md, "Datasets").
    max_plans_per_user: int = 1024
    max_plans: int = 4096
    max_plan_urls_per_user: int = 4_000_000
    max_plan_urls: int = 8_000_000
    max_leases_per_user: int = 16384
    max_leases: int = 65536
    # The same in bytes of the daemon's memory (cached/weights.py: a URL's string and 450
    # bytes of index a planned URL; docs/operations.md gives the worst-case RSS they make):
    # the plans' URL lists, the datasets' URL lists (told apart from the plans), and the
    # replies waiting in the daemon for clients that do not take them (Peer.backlog).
    max_plan_bytes_per_user: int = _size("2GiB")
    max_plan_bytes: int = _size("4GiB")
    max_dataset_bytes_per_user: int = _size("512MiB")
    max_dataset_bytes: int = _size("1GiB")
    max_reply_bytes_per_user: int = _size("1GiB")
    max_reply_bytes: int = _size("2GiB")
    # The bytes one user's leases may pin, as a share of the hot tier's bound when the
    # daemon started (computed once).
    max_pinned_share_per_user: float = 0.75
    # Connections kept per local user (the uid of an ipc peer) and in total; one past a cap
    # is shut as it is accepted (cached/admission.py). A reader process holds two (its
    # requests and its heartbeats): 64 readers of one user are 128. The descriptor limit
    # may hold fewer, and then the daemon keeps fewer (cached/descriptors.py, "cached
    # status" shows the caps in force). Admin HTTP connections ([server] http) are capped
    # apart.
    max_connections_per_user: int = 512
    max_connections: int = 2048
    max_http_connections: int = 64
    # Training jobs' reports (cached/jobs.py): a process silent this long is forgotten (live
    # ones report at least every 30 s), and at most this many jobs are followed at once
    # (each is a label value of the cached_job_* series).
    job_timeout_s: float = 120.0
    max_jobs: int = 256
    # The ipc socket's mode and group, set right after bind whatever the umask: "0660"
    # admits the daemon's user and group; a group name or gid gives the socket to that
    # group (the daemon's user must be a member). Unused for tcp://.
    socket_mode: str = "0660"
    socket_group: str | None = None
    # URL prefixes a client may ask for (cached/access.py). file:// is not in the default:
    # a client could name any file the daemon can read.
    allow: tuple[str, ...] = ("s3://",)
    # Local reads (docs/protocol.md): clients on this node that can open the hot tier's
    # files (the daemon's group: the directory becomes 0750, shard files 0640) read the
    # sample bytes from them; the socket carries only control messages. false: every byte
    # goes through the socket, and the files stay the daemon's alone.
    local_reads: bool = True


@dataclass(frozen=True)
class CacheConfig:
    """``[cache]``: the NVMe hot tier."""

    dir: Path = Path("/var/cache/cached")
    capacity_bytes: int = _size("500GiB")
    # Keep at least this much free on the file system, whatever the capacity says.
    min_free_bytes: int = _size("1GiB")
    # "belady": evict what the readers' plans need last; "lru": least recently used.
    policy: str = "belady"
    # How long a fetch waits for readers to release pinned shards before CacheFull.
    pin_wait_s: float = 30.0
    # Shard files kept open for socket reads (a bounded LRU, closed after 60 s unread):
    # each is a descriptor, and the tier may hold tens of thousands of shards.
    max_open_files: int = 1024
    # Check each served member's checksum before sending it (rotten bytes are dropped and
    # fetched again). Off: only shards reloaded at start are checked, once, before use.
    verify_reads: bool = True


@dataclass(frozen=True)
class S3Config:
    """``[s3]``: the warm tier. Credentials come from the standard AWS chain."""

    endpoint_url: str | None = _endpoint()
    region: str = "us-east-1"
    addressing_style: str = "path"
    part_size_bytes: int = _size("16MiB")
    part_concurrency: int = 8
    max_pool_connections: int = 64
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    retry_attempts: int = 6
    retry_base_delay_s: float = 0.1
    retry_max_delay_s: float = 5.0
    verify_checksum: bool = True
    # Fetch shards with awscrt's S3 client, bytes straight from the socket to the hot
    # tier's file (cached/stores/native.py, D42); false: aiobotocore streams them.
    native_fetch: bool = True
    # A native open of an object whose ETag is its MD5 also sends a HEAD for the store's
    # full-object checksum, and checks the bytes with it (0.05 ms of CPU per MB for a
    # CRC64NVME) instead of the MD5 (1.4 ms): one more request per shard (D47).
    checksum_head: bool = False
    # Seconds the store's answer about an object (size, ETag) is trusted before an open
    # asks again (one HEAD); 0: at every open. A replaced object is served within this.
    revalidate_s: float = 60.0
    # This node's share of the store's request rate (requests/s, every GET part and HEAD
    # counted); 0: none, paced only once the store answers SlowDown. Either way a
    # SlowDown halves the rate and successes raise it again (cached/stores/pacing.py).
    max_requests_per_s: float = 0.0


@dataclass(frozen=True)
class PrefetchConfig:
    """``[prefetch]``: how far ahead of the readers to fetch."""

    lookahead_bytes: int = _size("32GiB")
    # Shards downloaded at once (each may use several ranged GETs).
    concurrency: int = 4
    # A reader's plan is dropped this long after its last request or heartbeat. Longer
    # than the pin lease: a validation pass or a checkpoint between epochs must not lose
    # the next epoch's plan, which warms the hot tier across the boundary.
    plan_timeout_s: float = 900.0
    # A plan whose connection closed (its process ended, or a DataLoader worker that ends
    # with its epoch) is dropped this long after: long enough for the next epoch's workers
    # to announce theirs while the prefetcher still follows it, short enough that a killed
    # job leaves `cached status` within a minute.
    plan_grace_s: float = 30.0


@dataclass(frozen=True)
class ColdConfig:
    """``[cold]``: the tier read when the warm tier misses (or holds an archived object).

    A shard URL ``warm_prefix + rest`` is looked up at ``cold_prefix + rest`` when the
    warm tier does not have it. ``warm_prefix = ""`` (the default) turns the cold tier
    off. ``endpoint_url``/``region`` name the cold tier's S3 endpoint when it is not the
    ``[s3]`` one (None: the ``[s3]`` client serves it too). ``promote`` writes a shard
    served from the cold tier back to the warm tier, for the next node or job.
    """

    warm_prefix: str = ""
    cold_prefix: str = ""
    endpoint_url: str | None = _endpoint()
    region: str = "us-east-1"
    promote: bool = False

    @property
    def enabled(self) -> bool:
        """Whether a cold tier is configured."""
        return bool(self.warm_prefix)

    def cold_url(self, url: str) -> str | None:
        """The cold tier's URL for the warm ``url``, or None if the cold tier does not cover it."""
        if not self.warm_prefix or not url.startswith(self.warm_prefix):
            return None
        return self.cold_prefix + url[len(self.warm_prefix) :]


@dataclass(frozen=True)
class Config:
    """The whole daemon configuration."""

    server: ServerConfig = ServerConfig()
    cache: CacheConfig = CacheConfig()
    s3: S3Config = S3Config()
    prefetch: PrefetchConfig = PrefetchConfig()
    cold: ColdConfig = ColdConfig()
    source: str = "<defaults>"


_SECTIONS: dict[str, type[Any]] = {
    "server": ServerConfig,
    "cache": CacheConfig,
    "s3": S3Config,
    "prefetch": PrefetchConfig,
    "cold": ColdConfig,
}
# TOML and environment names drop the unit suffix of the dataclass field: `capacity = "1GiB"`.
_ALIASES = {
    "capacity": "capacity_bytes",
    "min_free": "min_free_bytes",
    "lookahead": "lookahead_bytes",
    "part_size": "part_size_bytes",
}


def _field_name(section: str, key: str, where: str) -> dataclasses.Field[Any]:
    cls = _SECTIONS[section]
    name = _ALIASES.get(key, key)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if name not in fields:
        public = sorted({next((a for a, n in _ALIASES.items() if n == f), f) for f in fields})
        raise ConfigError(
            f"{where}: unknown key [{section}] {key!r}; known keys: {', '.join(public)}"
        )
    return fields[name]


def _coerce(f: dataclasses.Field[Any], value: Any, where: str, key: str, from_text: bool) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if f.metadata.get("size"):
            return parse_size(value)
        if kind == "bool":
            if from_text:
                if str(value).lower() in ("1", "true", "yes", "on"):
                    return True
                if str(value).lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(f"not a boolean: {value!r}")
            if not isinstance(value, bool):
                raise ValueError(f"not a boolean: {value!r}")
            return value
        if kind == "int":
            if isinstance(value, bool) or (not from_text and not isinstance(value, int)):
                raise ValueError(f"not an integer: {value!r}")
            out = int(value)
            if out <= 0:
                raise ValueError(f"must be positive: {value!r}")
            return out
        if kind == "float":
            if isinstance(value, bool) or (not from_text and not isinstance(value, int | float)):
                raise ValueError(f"not a number: {value!r}")
            out_f = float(value)
            if out_f < 0:
                raise ValueError(f"cannot be negative: {value!r}")
            return out_f
        if kind == "Path":
            return Path(str(value)).expanduser()
        if kind == "str | None":
            text = None if value in ("", None) else str(value)
            return _check_endpoint(text) if text and f.metadata.get("endpoint") else text
        if kind == "tuple[str, ...]":
            return _strings(value, from_text)
        if not isinstance(value, str):
            raise ValueError(f"not a string: {value!r}")
        return value
    except ValueError as exc:
        raise ConfigError(f"{where}: bad value for {key}: {exc}") from exc


def _strings(value: Any, from_text: bool) -> tuple[str, ...]:
    """A list of strings: a TOML array, or comma-separated in an environment variable."""
    if from_text:
        return tuple(item.strip() for item in str(value).split(",") if item.strip())
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"not a list of strings: {value!r}")
    return tuple(value)


def load(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Load the configuration.

    ``path`` None means ``$CACHED_CONFIG``, else ``/etc/cached/config.toml`` if it exists,
    else the embedded defaults. Then ``CACHED_<SECTION>_<KEY>`` variables override
    (``CACHED_CACHE_CAPACITY=10GiB``), then ``overrides`` (``{"cache.dir": "/x"}``, from flags).
    Raises :class:`ConfigError` naming the file or variable and the key.
    """
    env = os.environ if env is None else env
    values: dict[str, dict[str, Any]] = {s: {} for s in _SECTIONS}
    source = "<defaults>"
    if path is None and env.get(CONFIG_ENV):
        path = env[CONFIG_ENV]
    if path is None and DEFAULT_CONFIG_PATH.exists():
        path = DEFAULT_CONFIG_PATH
    if path is not None:
        source = str(path)
        try:
            with open(path, "rb") as fh:
                doc = tomllib.load(fh)
        except FileNotFoundError as exc:
            raise ConfigError(f"{path}: config file not found") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
        for section, table in doc.items():
            if section not in _SECTIONS:
                raise ConfigError(
                    f"{path}: unknown section [{section}]; known: {', '.join(_SECTIONS)}"
                )
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: [{section}] must be a table")
            for key, value in table.items():
                f = _field_name(section, key, source)
                values[section][f.name] = _coerce(f, value, source, f"[{section}] {key}", False)
    for name, value in env.items():
        if not name.startswith("CACHED_") or name in (CONFIG_ENV, "CACHED_SOCKET"):
            continue
        rest = name[len("CACHED_") :].lower()
        found = next((s for s in _SECTIONS if rest.startswith(s + "_")), None)
        if found is None:
            continue  # other CACHED_* variables (the client's) are not ours
        key = rest[len(found) + 1 :]
        f = _field_name(found, key, f"environment {name}")
        values[found][f.name] = _coerce(f, value, f"environment {name}", name, True)
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        section, _, key = dotted.partition(".")
        f = _field_name(section, key, f"flag --{key.replace('_', '-')}")
        values[section][f.name] = _coerce(f, value, f"flag --{key}", dotted, isinstance(value, str))
    cfg = Config(
        server=ServerConfig(**values["server"]),
        cache=CacheConfig(**values["cache"]),
        s3=S3Config(**values["s3"]),
        prefetch=PrefetchConfig(**values["prefetch"]),
        cold=ColdConfig(**values["cold"]),
        source=source,
    )
    validate(cfg)
    return cfg
