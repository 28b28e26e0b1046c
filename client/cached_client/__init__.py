"""cached_client: read training samples from the cached daemon.

- :class:`CachedDataset`: a torch ``IterableDataset`` for DataLoaders with workers.
- :class:`FastLoader`: the fast path; batches straight into reusable (pinned) buffers.
- :class:`DeviceLoader`: moves batches to the GPU through pinned buffers, non-blocking.
"""

from .dataset import CachedDataset
from .errors import CachedClientError, DaemonUnavailable, NotATar, RemoteError, ShardNotFound

__all__ = [
    "CachedClientError",
    "CachedDataset",
    "DaemonUnavailable",
    "NotATar",
    "RemoteError",
    "ShardNotFound",
]
__version__ = "0.1.0"
