"""The fast path: a reader in the training process receives payload frames from the daemon
straight into a ring of reusable (pinned) host buffers and yields batches as tensors.

No DataLoader workers and no pickling: the daemon already does the I/O in parallel, and
``recv_into`` writes each frame where the batch needs it. For data that needs no CPU
decoding (raw or pre-decoded arrays, or data decoded on the GPU).
"""

from __future__ import annotations

import contextlib
import random
import uuid
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zmq

from . import partition
from .device import host_buffer
from .errors import check_reply
from .protocol import Header
from .reader import Span, announce, pipelined_reads
from .transport import Connection, resolve_endpoint
from .urls import expand_all

_MIN_BUFFER = 1 << 20


@dataclass
class Batch:
    """One batch: per extension, the members' bytes packed end to end in one uint8 tensor.

    ``offsets[ext]`` has ``len(keys) + 1`` entries: member ``i`` is
    ``data[ext][offsets[ext][i]:offsets[ext][i + 1]]``. With fixed-size members,
    :meth:`view` reshapes without a copy. Host tensors alias the loader's ring: they are
    valid until ``ring`` more batches have been taken (copy them to keep them longer).
    """

    keys: list[str]
    data: dict[str, torch.Tensor]
    offsets: dict[str, list[int]]

    def view(
        self, ext: str, dtype: torch.dtype = torch.uint8, shape: Sequence[int] = ()
    ) -> torch.Tensor:
        """``data[ext]`` as ``[batch, *shape]`` of ``dtype``; the members must be equal in size."""
        sizes = {b - a for a, b in zip(self.offsets[ext], self.offsets[ext][1:], strict=False)}
        if len(sizes) > 1:
            raise ValueError(f"members {ext!r} differ in size ({sorted(sizes)[:4]}...)")
        return (
            self.data[ext].view(dtype).reshape(len(self.keys), *shape)
            if shape
            else self.data[ext].view(dtype).reshape(len(self.keys), -1)
        )


@dataclass
class _Slot:
    """One ring entry: a growable host buffer per extension, and the copy that reads it."""

    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    views: dict[str, np.ndarray[Any, np.dtype[np.uint8]]] = field(default_factory=dict)
    event: Any = None  # torch.cuda.Event of the last device copy out of these buffers

    def region(self, ext: str, at: int, size: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """Bytes ``at..at+size`` of the buffer for ``ext`` (grown, keeping its contents, if
        too small), as a numpy view for ``recv_into``: one view per buffer, sliced per
        member (a torch slice and ``.numpy()`` per member cost more than the copy)."""
        view = self.views.get(ext)
        if view is None or view.shape[0] < at + size:
            old = self.buffers.get(ext)
            grown = host_buffer(max(_MIN_BUFFER, (at + size) * 5 // 4))
            if old is not None and at:
                grown[:at].copy_(old[:at])
            self.buffers[ext] = grown
            self.views[ext] = view = grown.numpy()
        return view[at : at + size]


class FastLoader:
    """Batches of raw member bytes from the daemon, received in place into reusable buffers.

    Args:
        urls: shard URLs or brace patterns.
        batch_size: samples per batch (the last batch may be short unless ``drop_last``).
        exts: the extensions to receive (e.g. ``["input.npy", "cls"]``); the daemon sends
            only these. None: every member.
        device: where batches go (``"cuda"``: non-blocking copies on a side stream); None
            keeps them on the host.
        ring: host buffer sets in the ring; also how many batches may be in flight.
        socket, shuffle, seed, rank, world_size: as for :class:`~cached_client.CachedDataset`
            (the shard order; each rank reads whole shards, round-robin).
    """

    def __init__(
        self,
        urls: str | Iterable[str],
        *,
        batch_size: int,
        exts: Sequence[str] | None = None,
        device: str | torch.device | None = None,
        ring: int = 4,
        socket: str | None = None,
        shuffle: bool = False,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        inflight: int = 8,
        drop_last: bool = False,
        connect_timeout_s: float = 5.0,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be positive")
        self.urls = expand_all(urls)
        self.batch_size = batch_size
        self.exts = list(exts) if exts is not None else None
        self.device = torch.device(device) if device is not None else None
        self.ring = [_Slot() for _ in range(max(2, ring))]
        self.endpoint = resolve_endpoint(socket)
        self.shuffle, self.seed = shuffle, seed
        self.rank, self.world_size = partition.resolve_rank(rank, world_size)
        self.inflight = inflight
        self.drop_last = drop_last
        self.epoch = 0
        self.conn = Connection(self.endpoint, connect_timeout_s=connect_timeout_s)
        self._stream = f"fast-{uuid.uuid4().hex[:12]}/r{self.rank}"
        self._cuda_stream: Any = None

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose shard order the next iteration follows."""
        self.epoch = epoch

    def shard_urls(self, epoch: int) -> list[str]:
        """The shards this rank reads in ``epoch``, in order."""
        order = partition.shard_order(
            len(self.urls), shuffle=self.shuffle, seed=self.seed, epoch=epoch
        )
        parts = partition.by_shard(order, self.rank, self.world_size)
        if self.shuffle:
            random.Random(f"fast/{self.seed}/{epoch}").shuffle(parts)
        return [self.urls[p.shard] for p in parts]

    def __iter__(self) -> Iterator[Batch]:
        self.conn.open()
        urls = self.shard_urls(self.epoch)
        # This epoch and the next: the daemon prefetches across the boundary.
        plan_key = self._stream.split("/")[0]
        plan = (
            plan_key
            if announce(self.conn, plan_key, urls + self.shard_urls(self.epoch + 1))
            else None
        )
        slot_no = 0
        keys: list[str] = []
        offsets: dict[str, list[int]] = {}
        used: dict[str, int] = {}
        slot = self._claim(slot_no)
        spans = [Span(url) for url in urls]
        reads: Generator[tuple[str, int], None, None] = pipelined_reads(
            self.conn, spans, self._stream, inflight=self.inflight, exts=self.exts, plan=plan
        )
        with contextlib.closing(reads):  # leaving early releases the reader's pins now
            for _url, rid in reads:
                header, early = self._reply(rid)
                for key, members in header["samples"]:
                    for ext, size in members:
                        at = used.get(ext, 0)
                        dst = slot.region(ext, at, size)
                        if early is None:
                            got = self.conn.recv_into(dst)  # straight from the socket
                        else:
                            src = memoryview(next(early).buffer)
                            got = len(src)
                            dst[:got] = np.frombuffer(src, dtype=np.uint8)
                        if got != size:
                            raise ConnectionError(f"frame of {got} bytes, expected {size}")
                        used[ext] = at + size
                        offsets.setdefault(ext, [0] * (len(keys) + 1)).append(at + size)
                    keys.append(key)
                    for offs in offsets.values():
                        if len(offs) < len(keys) + 1:  # sample without this member
                            offs.append(offs[-1])
                    if len(keys) == self.batch_size:
                        yield self._emit(slot, keys, offsets, used)
                        slot_no += 1
                        slot = self._claim(slot_no)
                        keys, offsets, used = [], {}, {}
            if keys and not self.drop_last:
                yield self._emit(slot, keys, offsets, used)

    def _reply(self, rid: int) -> tuple[Header, Iterator[zmq.Frame] | None]:
        """The reply to ``rid``: its header and, if it came early (stashed while another
        reply was awaited), its frames; else the frames are still on the socket."""
        while True:
            early = self.conn.pop_early(rid)
            if early is not None:
                header, frames = early
                source: Iterator[zmq.Frame] | None = iter(frames)
            else:
                header, source = self.conn.recv_header_into(), None
                if header.get("id") != rid:
                    self.conn.stash(header, self.conn.recv_rest())
                    continue
                self.conn.settle(rid)
            check_reply(header)
            return header, source

    def _claim(self, n: int) -> _Slot:
        slot = self.ring[n % len(self.ring)]
        if slot.event is not None:
            slot.event.synchronize()  # the device copy out of this slot must be done
            slot.event = None
        return slot

    def _emit(
        self, slot: _Slot, keys: list[str], offsets: dict[str, list[int]], used: dict[str, int]
    ) -> Batch:
        data = {ext: slot.buffers[ext][:n] for ext, n in used.items()}
        if self.device is not None and self.device.type == "cuda":
            if self._cuda_stream is None:
                self._cuda_stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
            with torch.cuda.stream(self._cuda_stream):
                data = {e: t.to(self.device, non_blocking=True) for e, t in data.items()}
                slot.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                slot.event.record(self._cuda_stream)
            torch.cuda.current_stream(self.device).wait_event(slot.event)
            for t in data.values():
                t.record_stream(torch.cuda.current_stream(self.device))
        elif self.device is not None:
            data = {e: t.to(self.device) for e, t in data.items()}
        return Batch(keys, data, offsets)
