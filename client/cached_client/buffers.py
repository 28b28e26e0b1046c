"""Host memory that batches are received into, and who may read it when.

The fast path receives payload frames straight into a ring of reusable host buffers. A
batch handed to the user aliases one ring slot, so a slot is reused only when nothing
queued from its batch can still read it:

- a device copy out of a slot (``Batch.to``, ``FastLoader(device=...)``,
  ``DeviceLoader``) records an event on the stream that copies; the slot waits for it;
- in host mode the loader records an event on the current CUDA stream(s) when the user
  asks for the next batch, which covers the copies the user queued from the previous one
  (``batch.view(...).to("cuda", non_blocking=True)``);
- a batch used after its slot was reused raises :class:`StaleBatch` (a generation check),
  never returns another batch's bytes.

Pinned memory is allocated only where it pays (a batch goes to a GPU), under the target
device so that a rank's first pinned block does not create a CUDA context on GPU 0, and in
power-of-two sizes: torch's caching host allocator rounds every block up to a power of
two and keeps freed blocks for reuse, so growing through the same sizes leaves at most
one cached block per size, reused by the other slots, instead of a trail per slot.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .accelerator import require_device
from .errors import StaleBatch, UsageError

log = logging.getLogger(__name__)

MIN_BUFFER = 1 << 20

ByteView = np.ndarray[Any, np.dtype[np.uint8]]


@functools.cache
def pinned_memory_available() -> bool:
    """Whether page-locked host memory can be had here (CUDA is available).

    Asks without allocating: an allocation would create a CUDA context on the current
    device. CPU-only torch raises on ``pin_memory=True``; then plain buffers serve, and the
    fallback is said once.
    """
    if torch.cuda.is_available():
        return True
    log.info("pinned memory unavailable (no CUDA); using plain host buffers")
    return False


def buffer_size(nbytes: int) -> int:
    """The size a buffer for ``nbytes`` is allocated with: the next power of two, at
    least :data:`MIN_BUFFER` (what torch's pinned allocator would round it to anyway)."""
    return max(MIN_BUFFER, 1 << max(0, nbytes - 1).bit_length())


def host_buffer(nbytes: int, *, pinned: bool = False, device: int | None = None) -> torch.Tensor:
    """A flat uint8 host buffer of ``nbytes``; page-locked if ``pinned`` and possible,
    allocated under CUDA device ``device`` (default: the current one)."""
    if pinned and pinned_memory_available():
        with torch.cuda.device(torch.cuda.current_device() if device is None else device):
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return torch.empty(nbytes, dtype=torch.uint8)


@dataclass
class Slot:
    """One ring entry: a growable host buffer per extension, a generation that moves on
    each reuse, and the events of device copies queued out of it."""

    pinned: bool = False
    device: int | None = None
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    views: dict[str, ByteView] = field(default_factory=dict)
    generation: int = 0
    guards: list[Any] = field(default_factory=list)  # torch.cuda.Event

    def region(self, ext: str, at: int, size: int) -> ByteView:
        """Bytes ``at..at+size`` of the buffer for ``ext`` (grown, keeping its contents, if
        too small), as a numpy view to receive into: one view per buffer, sliced per
        member (a torch slice and ``.numpy()`` per member cost more than the copy)."""
        view = self.views.get(ext)
        if view is None or view.shape[0] < at + size:
            old = self.buffers.get(ext)
            grown = host_buffer(buffer_size(at + size), pinned=self.pinned, device=self.device)
            if old is not None and at:
                grown[:at].copy_(old[:at])
            self.buffers[ext] = grown
            self.views[ext] = view = grown.numpy()
        return view[at : at + size]

    def guard(self, event: Any) -> None:
        """A device copy out of this slot was queued; reuse waits until ``event``."""
        self.guards.append(event)

    def reclaim(self) -> None:
        """Make the slot ready for the next batch: wait for the copies out of it, and
        invalidate the batch it held."""
        for event in self.guards:
            event.synchronize()
        self.guards.clear()
        self.generation += 1


class Ring:
    """``size`` slots taken in turn."""

    def __init__(self, size: int, *, pinned: bool, device: int | None = None) -> None:
        self.slots = [Slot(pinned, device) for _ in range(max(2, size))]
        self._turn = 0

    def claim(self) -> Slot:
        """The next slot, reclaimed (waits for the device copies still reading it)."""
        slot = self.slots[self._turn % len(self.slots)]
        self._turn += 1
        slot.reclaim()
        return slot


class Batch:
    """One batch: per extension, the members' bytes packed end to end in one uint8 tensor.

    ``offsets[ext]`` has ``len(keys) + 1`` entries: member ``i`` is
    ``data[ext][offsets[ext][i]:offsets[ext][i + 1]]``. With fixed-size members,
    :meth:`view` reshapes without a copy.

    A host batch of :class:`~cached_client.FastLoader` aliases the loader's ring: it is
    valid until ``ring`` more batches have been taken; after that any use raises
    :class:`~cached_client.errors.StaleBatch` (tensors taken from it before then alias the
    reused memory: copy them, or :meth:`to` a device, to keep them longer). A batch on a
    device owns its memory.
    """

    def __init__(
        self,
        keys: list[str],
        data: dict[str, torch.Tensor],
        offsets: dict[str, list[int]],
        slot: Slot | None = None,
    ) -> None:
        self.keys = keys
        self.offsets = offsets
        self._data = data
        self._slot = slot
        self._generation = slot.generation if slot is not None else 0

    @property
    def slot(self) -> Slot | None:
        """The ring slot a host batch lives in (None: the batch owns its memory)."""
        return self._slot

    @property
    # I79: a batch used after its buffers were reused raises StaleBatch.
    def stale(self) -> bool:
        """Whether the loader has reused this batch's memory for a later batch."""
        return self._slot is not None and self._slot.generation != self._generation

    @property
    def data(self) -> dict[str, torch.Tensor]:
        """Per extension, the packed member bytes (raises ``StaleBatch`` once reused)."""
        if self.stale:
            raise StaleBatch(
                f"batch of {len(self.keys)} samples starting at {self.keys[:1]} was used after "
                "its buffers were reused: copy it, or .to(device), before taking more batches "
                "than the loader's ring holds"
            )
        return self._data

    @property
    def device(self) -> torch.device:
        """Where the batch's tensors are."""
        return next(iter(self._data.values())).device if self._data else torch.device("cpu")

    def __len__(self) -> int:
        return len(self.keys)

    def view(
        self, ext: str, dtype: torch.dtype = torch.uint8, shape: Sequence[int] | None = None
    ) -> torch.Tensor:
        """``data[ext]`` as ``[batch, *shape]`` of ``dtype``, without a copy; the members must
        be equal in size. ``shape=()``: one ``dtype`` scalar per member, ``[batch]``;
        None (the default): ``[batch, n]``, each member's bytes as ``n`` of ``dtype``."""
        data = self.data[ext]
        sizes = {b - a for a, b in zip(self.offsets[ext], self.offsets[ext][1:], strict=False)}
        if len(sizes) > 1:
            raise UsageError(f"members {ext!r} differ in size ({sorted(sizes)[:4]}...)")
        rows = (-1,) if shape is None else tuple(shape)
        try:
            return data.view(dtype).reshape(len(self.keys), *rows)
        except RuntimeError as exc:  # the members' size is not that of [*shape] of dtype
            raise UsageError(
                f"cannot view members {ext!r} ({next(iter(sizes), 0)} bytes each) as "
                f"{list(rows)} of {dtype}: {exc}"
            ) from exc

    def to(self, device: str | torch.device, non_blocking: bool = True) -> Batch:
        """This batch on ``device``: a batch that owns its memory, safe to keep.

        A CUDA copy is queued on the device's current stream; the loader reuses the host
        slot only once that copy is done. Already there: the batch itself.
        """
        target = torch.device(device)
        data = self.data
        if self.device == target or (
            target.type == "cuda" and target.index is None and self.device.type == "cuda"
        ):
            return self
        if target.type != "cuda":
            return Batch(self.keys, {e: t.to(target) for e, t in data.items()}, self.offsets)
        target = require_device(target)
        with torch.cuda.device(target):
            moved = {e: t.to(target, non_blocking=non_blocking) for e, t in data.items()}
            if self._slot is not None and non_blocking:
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(torch.cuda.current_stream(target))
                self._slot.guard(event)
        return Batch(self.keys, moved, self.offsets)
