"""The trip to the accelerator: non-blocking copies on a side stream handed to the
consumer's stream of the right device, and a meter for data stalls. Which device a batch
may go to is checked in :mod:`.accelerator` (re-exported here)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sized
from typing import Any, TypeVar

import torch

from . import jobs
from .accelerator import require_device, with_index
from .buffers import Batch, host_buffer, pinned_memory_available
from .endpoint import resolve_endpoint

T = TypeVar("T")

__all__ = [
    "CopyStream",
    "DeviceLoader",
    "StallMeter",
    "host_buffer",
    "pinned_memory_available",
    "require_device",
    "to_device",
    "with_index",
]


def to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """Move every tensor of a nested batch (dicts, lists, tuples, namedtuples, and
    FastLoader's :class:`Batch`) to ``device``; anything else is passed through."""
    if isinstance(batch, Batch):
        return batch.to(device, non_blocking)
    if isinstance(batch, torch.Tensor):
        if (
            device.type == "cuda"
            and batch.device.type == "cpu"
            and not batch.is_pinned()
            and pinned_memory_available()
        ):
            batch = batch.pin_memory()  # torch's caching host allocator reuses these blocks
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return type(batch)({k: to_device(v, device, non_blocking) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    return batch


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, Batch):
        yield from batch.data.values()
    elif isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for v in batch.values():
            yield from _tensors(v)
    elif isinstance(batch, list | tuple):
        for v in batch:
            yield from _tensors(v)


class CopyStream:
    """Host-to-device copies on a side stream of one CUDA device, handed to the consumer.

    :meth:`copy` queues a batch's copies on the side stream and returns the moved batch
    with an event; :meth:`hand_over` makes the consumer's stream *of that device* (its
    current stream, whatever device is current) wait for the event, and tells the caching
    allocator that the consumer uses the memory (``record_stream``), so it is not reused
    while the consumer's kernels still read it.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def copy(self, batch: Any) -> tuple[Any, torch.cuda.Event]:
        """``batch`` on the device, its copies queued; the event marks their end."""
        with torch.cuda.stream(self.stream):
            moved = to_device(batch, self.device, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        return moved, event

    def hand_over(self, moved: Any, event: torch.cuda.Event) -> Any:
        """``moved``, safe to use on the consumer's stream of this device."""
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(event)
        for t in _tensors(moved):
            if t.device.type == "cuda":
                t.record_stream(consumer)
        return moved


class DeviceLoader:
    """Wraps a loader of host batches; yields them on ``device``, ``depth`` copies ahead.

    On CUDA the copies run on a side stream with ``non_blocking=True`` from pinned memory,
    and the consumer's stream of ``device`` waits on each batch's copy only when it takes
    that batch. Batches may be tensors, dicts, lists, tuples, namedtuples or
    :class:`~cached_client.FastLoader` batches (whose ring slots are reused only once their
    copy is done). Elsewhere it moves batches synchronously.

    It measures how long the training loop waits for each batch and reports it to the
    cached daemon under the job of the cached loader it wraps, if any (see
    :class:`StallMeter`).

    Raises :class:`~cached_client.errors.DeviceUnavailable` at construction when the
    device does not exist here (``"cuda"`` without CUDA).
    """

    def __init__(self, loader: Iterable[Any], device: str | torch.device, depth: int = 2) -> None:
        self.loader = loader
        self.device = require_device(device)
        self.depth = max(1, depth)
        found = jobs.origin(loader)
        self._report = jobs.reporter(*found) if found is not None else None

    def __len__(self) -> int:
        if not isinstance(self.loader, Sized):
            name = type(self.loader).__name__
            raise TypeError(f"DeviceLoader has no length: the {name} it wraps has none")
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        inner = iter(self.loader)
        return jobs.timed(
            self._moved(inner),
            ready=lambda _: jobs.dataloader_ready(inner),
            report=self._report,
        )

    def _moved(self, inner: Iterator[Any]) -> Iterator[Any]:
        device = with_index(self.device)
        if device.type != "cuda":
            for batch in inner:
                yield to_device(batch, device, non_blocking=False)
            return
        copies = CopyStream(device)
        queue: deque[tuple[Any, torch.cuda.Event]] = deque()
        for batch in inner:
            queue.append(copies.copy(batch))
            if len(queue) > self.depth:
                yield copies.hand_over(*queue.popleft())
        while queue:
            yield copies.hand_over(*queue.popleft())


class StallMeter:
    """How long the training loop waited for its next batch, against the whole loop time.

    ``for batch in meter.wrap(loader): ...``; then ``meter.wait_s``, ``meter.total_s`` and
    ``meter.fraction`` (the share of loop time blocked on data: "input-bound 40%").

    It also reports the figures to the cached daemon (in the background, every 2 s), which
    shows them per job in ``/metrics``, ``/status`` and its dashboard: when ``loader``
    reads from cached (a ``FastLoader``, a DataLoader over a ``CachedDataset``, or a
    ``DeviceLoader`` of either), under that loader's job; with ``job`` given, under that
    name (at ``socket``, or the loader's daemon). ``report=False`` keeps them here.
    """

    def __init__(
        self, job: str | None = None, *, socket: str | None = None, report: bool = True
    ) -> None:
        self.wait_s = 0.0
        self.total_s = 0.0
        self.batches = 0
        self.job = job
        self.socket = socket
        self.report = report

    def wrap(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield from ``iterable``, timing each wait for the next item."""
        return jobs.timed(
            iterable, self._record, ready=jobs.dataloader_ready, report=self._reporter(iterable)
        )

    def _record(self, wait_s: float, loop_s: float, batches: int, _ready: int | None) -> None:
        self.wait_s += wait_s
        self.total_s += loop_s
        self.batches += batches

    def _reporter(self, iterable: Any) -> jobs.JobReporter | None:
        if not self.report:
            return None
        found = jobs.origin(iterable)
        if found is None and self.job is None:
            return None  # not reading from cached, and no job named: nothing to tell it
        job = jobs.job_name(self.job) if self.job is not None or found is None else found[0]
        endpoint = resolve_endpoint(self.socket) if self.socket or found is None else found[1]
        return jobs.reporter(job, endpoint)

    @property
    def fraction(self) -> float:
        """Share of loop time spent waiting for data (0..1)."""
        return self.wait_s / self.total_s if self.total_s > 0 else 0.0

    def reset(self) -> None:
        """Start a new measurement (e.g. per epoch)."""
        self.wait_s = self.total_s = 0.0
        self.batches = 0
