"""The device a batch may go to: a name checked against this node (CUDA present, the
index in range) before anything else happens, and a bare ``cuda`` resolved to the device
current when the first batch goes.

Below both :mod:`.buffers` (``Batch.to``) and :mod:`.device` (the copies), which import it.
"""

from __future__ import annotations

import torch

from .errors import DeviceUnavailable


def require_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` that exists here; a CUDA device gets its index
    (the current device for a bare ``"cuda"``). Raises :class:`DeviceUnavailable` (before
    anything else happens) when CUDA is absent or the index is out of range."""
    target = torch.device(device)
    if target.type != "cuda":
        return target
    if not torch.cuda.is_available():
        raise DeviceUnavailable(
            f"CUDA is not available (torch {torch.__version__}"
            f"{', a CPU-only build' if torch.version.cuda is None else ''}), so batches cannot "
            f"go to {str(device)!r}; pass device=None to keep them on the host"
        )
    count = torch.cuda.device_count()
    if target.index is not None and target.index >= count:
        raise DeviceUnavailable(f"{target} does not exist: this node has {count} CUDA devices")
    return target


def with_index(device: torch.device) -> torch.device:
    """A bare ``cuda`` as the device current now (resolved at first use, not construction:
    DDP scripts often build loaders before ``torch.cuda.set_device``)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
