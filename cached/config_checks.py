"""The checks of a loaded configuration that one key's type cannot make: values in range,
formats, and the keys that only work together (``[server]`` access, ``[cold]``). Each
error names the file (or variable) and the key, and says what would work."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from .errors import ConfigError

if TYPE_CHECKING:
    from .config import ColdConfig, Config, ServerConfig

# [server]'s caps in bytes of the daemon's memory: each must be positive.
_BYTE_CAPS = tuple(
    f"max_{w}_bytes{s}" for w in ("plan", "dataset", "reply") for s in ("_per_user", "")
)
_POLICIES = ("belady", "lru")  # cached.policy.POLICIES; kept here so config imports nothing


def validate(cfg: Config) -> None:
    """Raise :class:`ConfigError` naming ``cfg.source`` and the key where a value, or a
    combination of values, cannot work."""
    where = cfg.source
    if cfg.cache.policy not in _POLICIES:
        raise ConfigError(
            f"{where}: [cache] policy must be one of {', '.join(_POLICIES)}, "
            f"not {cfg.cache.policy!r}"
        )
    if not cfg.server.socket.startswith(("ipc://", "tcp://")):
        raise ConfigError(
            f"{where}: [server] socket must start with ipc:// or tcp://, not {cfg.server.socket!r}"
        )
    host, _, port = cfg.server.http.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"{where}: [server] http must be host:port, not {cfg.server.http!r}")
    if cfg.s3.addressing_style not in ("path", "virtual", "auto"):
        raise ConfigError(f"{where}: [s3] addressing_style must be path, virtual or auto")
    if cfg.cache.capacity_bytes <= 0:
        raise ConfigError(f"{where}: [cache] capacity must be positive")
    if not math.isfinite(cfg.s3.max_requests_per_s):
        raise ConfigError(
            f"{where}: [s3] max_requests_per_s must be a number of requests per second "
            f"(0: no limit), not {cfg.s3.max_requests_per_s}"
        )
    for key in _BYTE_CAPS:
        if getattr(cfg.server, key) <= 0:
            raise ConfigError(
                f'{where}: [server] {key} must be a positive size such as "1GiB" '
                "(it caps what requests leave in the daemon's memory)"
            )
    share = cfg.server.max_pinned_share_per_user
    if not 0 < share <= 1:
        raise ConfigError(
            f"{where}: [server] max_pinned_share_per_user must be in (0, 1], not {share}"
        )
    _validate_access(cfg.server, where)
    _validate_cold(cfg.cold, where)


def _validate_access(server: ServerConfig, where: str) -> None:
    if not re.fullmatch(r"0?[0-7]{3}", server.socket_mode):
        raise ConfigError(
            f'{where}: [server] socket_mode must be octal digits like "0660", '
            f"not {server.socket_mode!r}"
        )
    if not server.allow:
        raise ConfigError(
            f"{where}: [server] allow is empty, so no client could read anything; "
            'list the URL prefixes clients may ask for, e.g. ["s3://"]'
        )
    for prefix in server.allow:
        # Matched after normalization (cached/access.py): a file:// prefix must name a
        # directory, or "file:///data" would also admit /database.
        if not (prefix.startswith("s3://") or re.match(r"^file:///(.*/)?$", prefix)):
            raise ConfigError(
                f"{where}: [server] allow entries must be s3://[BUCKET/PREFIX] or "
                f"file:///ABSOLUTE/DIRECTORY/ (ending with /), not {prefix!r}"
            )


def _validate_cold(cold: ColdConfig, where: str) -> None:
    if bool(cold.warm_prefix) != bool(cold.cold_prefix):
        missing = "cold_prefix" if cold.warm_prefix else "warm_prefix"
        raise ConfigError(
            f"{where}: [cold] {missing} is not set: set warm_prefix and cold_prefix together "
            "(the warm URLs they cover, and where the same keys live in the cold tier), "
            "or neither to turn the cold tier off"
        )
    if not cold.enabled:
        if cold.promote:
            raise ConfigError(
                f"{where}: [cold] promote needs a cold tier: set warm_prefix and cold_prefix"
            )
        return
    for key, prefix in (("warm_prefix", cold.warm_prefix), ("cold_prefix", cold.cold_prefix)):
        # The prefixes are matched and joined as strings, so check the shape here: a
        # mistake would otherwise surface only as "not found" on the first warm miss.
        if not re.match(r"^(s3://[^/]+|file:///)", prefix):
            raise ConfigError(
                f"{where}: [cold] {key} must start with s3://BUCKET or file:///ABSOLUTE/PATH, "
                f"not {prefix!r}"
            )
    if cold.warm_prefix.endswith("/") != cold.cold_prefix.endswith("/"):
        raise ConfigError(
            f"{where}: [cold] warm_prefix and cold_prefix must both end with '/' or neither "
            f"({cold.warm_prefix!r} -> {cold.cold_prefix!r} would join keys wrongly)"
        )
    if cold.endpoint_url is not None and not cold.cold_prefix.startswith("s3://"):
        raise ConfigError(
            f"{where}: [cold] endpoint_url applies to an s3:// cold_prefix only, "
            f"not {cold.cold_prefix!r}"
        )
    if cold.endpoint_url is None and cold.cold_prefix == cold.warm_prefix:
        raise ConfigError(
            f"{where}: [cold] cold_prefix is warm_prefix on the same endpoint: the cold tier "
            "must be another bucket, prefix or endpoint_url"
        )
    if cold.promote and not cold.warm_prefix.startswith("s3://"):
        raise ConfigError(
            f"{where}: [cold] promote writes shards back to the warm S3 tier, so warm_prefix "
            f"must be an s3:// prefix, not {cold.warm_prefix!r}"
        )
