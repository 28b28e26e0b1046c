"""cached_client: read training samples from the cached daemon.

- :class:`CachedDataset`: a torch ``IterableDataset`` for DataLoaders with workers.
- :class:`FastLoader`: the fast path; batches straight into reusable (pinned) buffers.
- :class:`DeviceLoader`, :class:`StallMeter`: batches to the GPU; time spent waiting.

Importing the package is cheap: torch is loaded only when one of these is first used, so
the daemon (which shares :mod:`cached_client.protocol`) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import CachedClientError, DaemonUnavailable, NotATar, RemoteError, ShardNotFound

if TYPE_CHECKING:
    from .dataset import CachedDataset
    from .device import DeviceLoader, StallMeter
    from .fast import Batch, FastLoader

_LAZY = {
    "CachedDataset": "dataset",
    "FastLoader": "fast",
    "Batch": "fast",
    "DeviceLoader": "device",
    "StallMeter": "device",
}

__all__ = [
    "Batch",
    "CachedClientError",
    "CachedDataset",
    "DaemonUnavailable",
    "DeviceLoader",
    "FastLoader",
    "NotATar",
    "RemoteError",
    "ShardNotFound",
    "StallMeter",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
