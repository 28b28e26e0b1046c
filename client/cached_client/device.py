"""Host buffers and the trip to the accelerator: pinned memory when there is one, plain
memory otherwise; non-blocking copies on a side stream; a meter for data stalls."""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch

log = logging.getLogger(__name__)
T = TypeVar("T")


@functools.cache
def pinned_memory_available() -> bool:
    """Whether page-locked host memory can be allocated here.

    CPU-only torch raises on ``pin_memory=True``; then we use plain buffers and say so once.
    """
    try:
        torch.empty(1, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as exc:
        log.info("pinned memory unavailable (%s); using plain host buffers", exc)
        return False
    return True


def host_buffer(nbytes: int) -> torch.Tensor:
    """A flat uint8 host buffer, pinned when pinned memory is available."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned_memory_available())


def to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """Move every tensor of a nested batch (dicts, lists, tuples) to ``device``."""
    if isinstance(batch, torch.Tensor):
        if device.type != "cpu" and not batch.is_pinned() and pinned_memory_available():
            batch = batch.pin_memory()  # torch's caching host allocator reuses these blocks
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    return batch


class DeviceLoader:
    """Wraps a loader of host batches; yields them on ``device``, ``depth`` copies ahead.

    On CUDA the copies run on a side stream with ``non_blocking=True`` from pinned memory,
    and the compute stream waits on each batch's copy only when it takes that batch. On
    the CPU it passes batches through.
    """

    def __init__(self, loader: Iterable[Any], device: str | torch.device, depth: int = 2) -> None:
        self.loader = loader
        self.device = torch.device(device)
        self.depth = max(1, depth)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        if self.device.type != "cuda":
            for batch in self.loader:
                yield to_device(batch, self.device)
            return
        stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        queue: deque[tuple[Any, torch.cuda.Event]] = deque()
        for batch in self.loader:
            with torch.cuda.stream(stream):
                moved = to_device(batch, self.device, non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
            queue.append((moved, event))
            if len(queue) > self.depth:
                yield _take(*queue.popleft())
        while queue:
            yield _take(*queue.popleft())


def _take(batch: Any, event: torch.cuda.Event) -> Any:
    torch.cuda.current_stream().wait_event(event)
    _record_stream(batch, torch.cuda.current_stream())
    return batch


def _record_stream(batch: Any, stream: torch.cuda.Stream) -> None:
    # The caching allocator must not reuse a batch's memory while the compute stream uses it.
    if isinstance(batch, torch.Tensor):
        batch.record_stream(stream)
    elif isinstance(batch, dict):
        for v in batch.values():
            _record_stream(v, stream)
    elif isinstance(batch, list | tuple):
        for v in batch:
            _record_stream(v, stream)


class StallMeter:
    """How long the training loop waited for its next batch, against the whole loop time.

    ``for batch in meter.wrap(loader): ...``; then ``meter.wait_s``, ``meter.total_s`` and
    ``meter.fraction`` (the share of loop time blocked on data: "input-bound 40%").
    """

    def __init__(self) -> None:
        self.wait_s = 0.0
        self.total_s = 0.0
        self.batches = 0

    def wrap(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield from ``iterable``, timing each wait for the next item."""
        it = iter(iterable)
        start = time.perf_counter()
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    item = next(it)
                except StopIteration:
                    return
                self.wait_s += time.perf_counter() - t0
                self.batches += 1
                yield item
        finally:
            self.total_s += time.perf_counter() - start

    @property
    def fraction(self) -> float:
        """Share of loop time spent waiting for data (0..1)."""
        return self.wait_s / self.total_s if self.total_s > 0 else 0.0

    def reset(self) -> None:
        """Start a new measurement (e.g. per epoch)."""
        self.wait_s = self.total_s = 0.0
        self.batches = 0
