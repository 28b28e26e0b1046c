"""The fast path: a reader in the training process receives payload frames from the daemon
straight into a ring of reusable (pinned) host buffers and yields batches as tensors.

No DataLoader workers and no pickling: the daemon already does the I/O in parallel, and
the connection's in-place receive writes each frame where the batch needs it. For data
that needs no CPU decoding (raw or pre-decoded arrays, or data decoded on the GPU).

The rooms it stands on: :mod:`.partition` (who reads what), :mod:`.reader` (pipelined
reads), :mod:`.transport` (the receive layer), :mod:`.filling` (a batch received into one
ring slot), :mod:`.buffers` (the ring and batch ownership) and :mod:`.device` (the copy
to the GPU).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import uuid
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from cached_wire.catalog import Catalog
from cached_wire.urls import expand_all

from . import elastic, jobs, partition, resume
from . import local as local_module
from . import placement as placement_module
from .accelerator import require_device, with_index
from .buffers import Batch, Ring, Slot, pinned_memory_available
from .device import CopyStream
from .endpoint import resolve_endpoint
from .errors import UsageError
from .filling import Filling
from .local import choose
from .reader import announce, pipelined_reads, shard_lengths
from .resume import Position
from .transport import Connection

__all__ = ["Batch", "FastLoader"]

log = logging.getLogger(__name__)


class FastLoader:
    """Batches of raw member bytes from the daemon, received in place into reusable buffers.

    Args:
        urls: shard URLs or brace patterns.
        batch_size: samples per batch (the last batch may be short unless ``drop_last``).
        exts: the extensions to receive (e.g. ``["input.npy", "cls"]``); the daemon sends
            only these. None: every member.
        device: where batches go (``"cuda"``, ``"cuda:1"``: non-blocking copies on a side
            stream, which the current stream of that device waits for); None keeps them on
            the host, in the ring. A device that does not exist here raises
            :class:`~cached_client.errors.DeviceUnavailable` at construction.
        ring: host buffer sets in the ring: a host batch stays valid until this many more
            have been taken (then it raises :class:`~cached_client.errors.StaleBatch`).
        pin_memory: page-locked host buffers. Default: when ``device`` is a CUDA device.
            In host mode pass True if you copy batches to a GPU yourself
            (``batch.to("cuda")`` or ``batch.view(...).to("cuda", non_blocking=True)``: the
            loader records an event on the current stream when you take the next batch,
            and reuses a slot only after it).
        equal_batches: every rank yields exactly the same number of samples (so the same
            number of batches: no rank waits for another in DDP's last all-reduce); the
            daemon indexes every shard once first, and up to ``world_size - 1`` samples of
            each epoch are left out. :func:`len` then gives the number of batches.
        socket, shuffle, seed, rank, world_size, job, local_reads, placement,
        placement_mix, node, local_world_size: as for
            :class:`~cached_client.CachedDataset`. The loader measures how long the training
            loop waits for each batch and reports it to the daemon under ``job``.

    Resuming: :meth:`state_dict` is the position after the last batch taken (epoch, shard,
    sample); :meth:`load_state_dict` makes the next iteration start there, reading only
    the samples that remain, in the same batches the uninterrupted run would have made.
    A state merged from every rank's by :func:`cached_client.elastic.elastic_state`
    resumes on any number of nodes and ranks: the rest of its epoch is spread over them.
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
        equal_batches: bool = False,
        inflight: int = 8,
        drop_last: bool = False,
        pin_memory: bool | None = None,
        connect_timeout_s: float = 5.0,
        job: str | None = None,
        local_reads: bool | None = None,
        placement: str = "global",
        placement_mix: float = 0.0,
        node: int | None = None,
        local_world_size: int | None = None,
    ) -> None:
        if batch_size < 1:
            raise UsageError(f"batch_size must be positive, not {batch_size}")
        self.urls = expand_all(urls)
        self.catalog = Catalog(self.urls)  # told to the daemon once; plans name positions
        self.batch_size = batch_size
        self.exts = list(exts) if exts is not None else None
        # Checked first: a missing device fails here, before any connection.
        self.device = require_device(device) if device is not None else None
        on_gpu = self.device is not None and self.device.type == "cuda"
        self.pin_memory = (on_gpu if pin_memory is None else pin_memory) and (
            pinned_memory_available()
        )
        self.ring_size = ring
        self.endpoint = resolve_endpoint(socket)
        self.shuffle, self.seed = shuffle, seed
        self.rank, self.world_size = partition.resolve_rank(rank, world_size)
        placement_module.check_placement(placement, placement_mix)
        self.placement, self.placement_mix = placement, placement_mix
        self.local_world_size: int | None = None
        if placement == "node":
            self.local_world_size = placement_module.resolve_local_world_size(
                self.rank, self.world_size, node=node, local_world_size=local_world_size
            )
        self.equal_batches = equal_batches
        self.inflight = inflight
        self.drop_last = drop_last
        self.connect_timeout_s = connect_timeout_s
        self.job = jobs.job_name(job)
        self.local_reads = choose(local_reads)
        if self.local_reads is not False:
            _say_if_not_compiled()
        self.epoch = 0
        self._conn: Connection | None = None
        self._ring: Ring | None = None
        self._lengths: list[int] | None = None
        self._active: Generator[Batch, None, None] | None = None
        self._stream = f"fast-{uuid.uuid4().hex[:12]}/r{self.rank}"
        # The position of the iteration running (or last run), and a state loaded for the
        # next iteration to resume.
        self._position: Position | None = None
        self._pending: dict[str, Any] | None = None
        # A merged state the iteration resumes, and this rank's share of its epoch's rest.
        self._elastic: dict[str, Any] | None = None
        self._own: list[partition.Part] | None = None

    # -- who reads what -----------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose shard order the next iteration follows."""
        self.epoch = epoch

    @property
    def conn(self) -> Connection:
        """The connection to the daemon (made on first use)."""
        if self._conn is None:
            self._conn = Connection(
                self.endpoint,
                connect_timeout_s=self.connect_timeout_s,
                local_reads=self.local_reads,
            )
        return self._conn

    def lengths(self) -> list[int]:
        """The number of samples of every shard (asks the daemon once)."""
        if self._lengths is None:
            self._lengths = shard_lengths(self.conn, self.urls, self._stream)
        return self._lengths

    def reader(self) -> placement_module.Reader:
        """This rank's place in the job (one reader per rank)."""
        return placement_module.Reader(
            self.rank,
            self.world_size,
            placement=self.placement,
            local_world_size=self.local_world_size or 1,
            mix=self.placement_mix,
        )

    def parts(self, epoch: int) -> list[partition.Part]:
        """The shard ranges this rank reads in ``epoch``, in order."""
        return placement_module.plan(
            len(self.urls),
            self.reader(),
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=epoch,
            lengths=self.lengths if self.equal_batches else None,
        )

    def shard_urls(self, epoch: int) -> list[str]:
        """The shards this rank reads in ``epoch``, in order."""
        return [self.urls[p.shard] for p in self.parts(epoch)]

    def __len__(self) -> int:
        """Batches per epoch (of the current one's plan); known only with ``equal_batches``
        (every epoch the same, unless ``placement_mix`` moves shards between nodes)."""
        if not self.equal_batches:
            raise TypeError("FastLoader has a length only with equal_batches=True")
        samples = sum(p.stop - p.start for p in self.parts(self.epoch) if p.stop is not None)
        full, rest = divmod(samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    # -- resuming ---------------------------------------------------------------------------

    def _identity(self) -> dict[str, Any]:
        """What a saved state must match to be resumed here (see :func:`resume.check`)."""
        return {
            "loader": "FastLoader",
            "version": resume.STATE_VERSION,
            "shards": len(self.urls),
            "urls": resume.fingerprint(self.urls),
            "world_size": self.world_size,
            "rank": self.rank,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "equal_batches": self.equal_batches,
            "placement": self.placement,
            "local_world_size": self.local_world_size,
            "placement_mix": self.placement_mix,
        }

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch taken, as a dict of plain values: the epoch
        and the place in this rank's shard order (part and sample). Before any iteration,
        the start of the current epoch; after a :meth:`load_state_dict`, that state."""
        if self._pending is not None:
            return dict(self._pending)
        if self._elastic is not None and self._own is None:
            return dict(self._elastic)  # not started: the merged state it was loaded from
        position = self._position or Position(self.epoch)
        own = None if self._own is None else elastic.parts_state(self._own)
        return {**self._identity(), **position.state(), "own": own}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume the next iteration at ``state`` (from :meth:`state_dict`), and set the
        epoch to the state's. The iteration reads only what remains of that epoch, and
        yields exactly the batches the uninterrupted one would have from there.

        Raises :class:`~cached_client.errors.UsageError` if the state was saved by another
        reader: other shard URLs, seed, shuffle, rank or world size (a state merged by
        :func:`~cached_client.elastic.elastic_state` resumes on any rank and world size).
        """
        if isinstance(state, Mapping) and state.get("elastic"):
            elastic.check(state, self._identity())
        else:
            resume.check(state, self._identity())
        if self._active is not None:
            self._active.close()  # an iteration in progress would not follow the state
            self._active = None
        self._pending = dict(state)
        self.epoch = int(state["epoch"])

    # -- iteration ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        if self._active is not None:
            # One iteration at a time: the ring is shared. Closing the old one releases
            # its pins; its batches go stale as their slots are reused.
            self._active.close()
        saved, self._pending = self._pending, None
        saved = resume.for_epoch(
            saved,
            self.epoch,
            "FastLoader",
            f"set_epoch({self.epoch}) was called after load_state_dict",
        )
        self._elastic = saved if saved is not None and saved.get("elastic") else None
        if self._elastic is not None:
            saved = None
        own = None if saved is None else saved.get("own")
        self._own = None if own is None else elastic.parts_from(own)
        # Made here, not at the first batch: state_dict describes this iteration at once.
        position = self._position = Position(self.epoch) if saved is None else Position.saved(saved)
        device = with_index(self.device) if self.device is not None else None
        if self._ring is None:
            index = device.index if device is not None and device.type == "cuda" else None
            self._ring = Ring(self.ring_size, pinned=self.pin_memory, device=index)
        host = self._active = self._host_batches(
            self._ring, position, guard_host_copies=device is None
        )
        batches: Iterator[Batch]
        if device is None:
            batches = host
        elif device.type == "cuda":
            batches = self._to_gpu(host, CopyStream(device))
        else:
            batches = (batch.to(device) for batch in host)
        return jobs.timed(batches, report=jobs.reporter(self.job, self.endpoint))

    @staticmethod
    def _to_gpu(batches: Iterator[Batch], copies: CopyStream) -> Iterator[Batch]:
        for batch in batches:
            yield copies.hand_over(*copies.copy(batch))

    def _host_batches(
        self, ring: Ring, position: Position, *, guard_host_copies: bool
    ) -> Generator[Batch, None, None]:
        conn = self.conn
        conn.open()
        if self._elastic is not None and self._own is None:
            self._own = elastic.resumed_share(
                self._elastic,
                self.reader(),
                n_shards=len(self.urls),
                seed=self.seed,
                epoch=self.epoch,
                lengths=self.lengths() if self.equal_batches else None,
            )
        parts = self._own if self._own is not None else self.parts(self.epoch)
        position.start(parts, "FastLoader")
        # From the position on: all of the epoch, or what a resumed one has left.
        spans, owners = resume.resume_spans(self.urls, parts, position)
        # The rest of this epoch and the next: the daemon prefetches across the boundary.
        plan_key = self._stream.split("/")[0]
        ahead = self.shard_urls(self.epoch + 1)
        urls = [s.url for s in spans] + ahead
        plan = plan_key if announce(conn, plan_key, urls, self.job, self.catalog) else None
        filling = Filling(ring.claim())
        reads = pipelined_reads(
            conn, spans, self._stream, inflight=self.inflight, exts=self.exts, plan=plan
        )
        with contextlib.closing(reads):  # leaving early releases the reader's pins now
            for read, rid in reads:
                reply = conn.answer(rid, in_place=True)  # checked; asked again if transient
                part = owners[read.pos]
                first = int(reply.header["start"]) - parts[part].start
                packed = reply.local.rows if reply.local is not None else None
                samples = packed if packed is not None else reply.header["samples"]
                done = 0
                while done < len(samples):
                    # As many of the reply's samples as the batch has room for, at once.
                    take = samples[done : done + self.batch_size - len(filling.keys)]
                    filling.receive(take, reply)
                    done += len(take)
                    filling.last = ((part, first + done - 1), read.last and done == len(samples))
                    if len(filling.keys) == self.batch_size:
                        position.took(*filling.last)  # before the batch is in the user's hands
                        yield from self._hand_out(filling.batch(), guard_host_copies)
                        filling = Filling(ring.claim())
            if filling.keys and not self.drop_last:
                position.took(*filling.last)
                yield from self._hand_out(filling.batch(), guard_host_copies)
        position.finish()

    @staticmethod
    def _hand_out(batch: Batch, guard_host_copies: bool) -> Generator[Batch, None, None]:
        try:
            yield batch
        finally:
            # Resumed: the user is done queueing work on the previous batch.
            slot = batch.slot
            if guard_host_copies and slot is not None and slot.pinned:
                _guard_current_streams(slot)


@functools.cache
def _say_if_not_compiled() -> None:
    """Once per process: where the compiled local reader is not built, FastLoader's local
    reads run in Python, at about two thirds of the speed (docs/operations.md)."""
    if local_module.GATHER is None:
        log.info(
            "the compiled local reader is not installed (cached_client._gather: no C compiler "
            "when the client was installed?); FastLoader reads local shards in Python"
        )


def _guard_current_streams(slot: Slot) -> None:
    """Record an event on the current stream of every device this process uses (a copy
    the user queued from the slot may be on any of them); the slot waits for them."""
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return  # nothing can have been queued
    for index in _devices_in_use():
        with torch.cuda.device(index):
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(index))
            slot.guard(event)


def _devices_in_use() -> list[int]:
    """The CUDA devices with a context in this process (recording on another would
    create one there)."""
    has_context: Any = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if has_context is None:
        return [torch.cuda.current_device()]
    return [i for i in range(torch.cuda.device_count()) if has_context(i)]
