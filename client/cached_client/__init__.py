"""cached_client: read training samples from the cached daemon.

- :class:`CachedDataset`: a torch ``IterableDataset`` for DataLoaders with workers.
- :class:`FastLoader`: the fast path; batches straight into reusable (pinned) buffers.
- :class:`DeviceLoader`, :class:`StallMeter`: batches to the GPU; time spent waiting.
- :class:`CachedClientError`: the base of every error the client raises.

Importing the package is cheap: torch is loaded only when one of these is first used, so
the daemon (which shares :mod:`cached_wire.protocol`) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    CachedClientError,
    DaemonTimeout,
    DaemonUnavailable,
    DeviceUnavailable,
    Forbidden,
    LimitExceeded,
    LocalReadsUnavailable,
    NotATar,
    ProtocolError,
    RemoteError,
    RequestTooLarge,
    ShardNotFound,
    StaleBatch,
    UsageError,
    VersionMismatch,
)

if TYPE_CHECKING:
    from .buffers import Batch
    from .dataset import CachedDataset
    from .device import DeviceLoader, StallMeter
    from .fast import FastLoader

_LAZY = {
    "CachedDataset": "dataset",
    "FastLoader": "fast",
    "Batch": "buffers",
    "DeviceLoader": "device",
    "StallMeter": "device",
}

__all__ = [
    "Batch",
    "CachedClientError",
    "CachedDataset",
    "DaemonTimeout",
    "DaemonUnavailable",
    "DeviceLoader",
    "DeviceUnavailable",
    "FastLoader",
    "Forbidden",
    "LimitExceeded",
    "LocalReadsUnavailable",
    "NotATar",
    "ProtocolError",
    "RemoteError",
    "RequestTooLarge",
    "ShardNotFound",
    "StaleBatch",
    "StallMeter",
    "UsageError",
    "VersionMismatch",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        try:
            module = importlib.import_module(f".{_LAZY[name]}", __name__)
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] != "torch":
                raise
            raise ImportError(
                f"cached_client.{name} needs torch, which is not installed here: "
                "pip install 'cached-client[torch]' (or torch as your training environment has it)"
            ) from exc
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
