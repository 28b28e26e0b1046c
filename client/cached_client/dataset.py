"""``CachedDataset``: WebDataset-style samples from the cached daemon, as a torch
``IterableDataset`` for DataLoaders with worker processes."""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from cached_wire.catalog import Catalog
from cached_wire.urls import expand_all
from torch.utils.data import IterableDataset, get_worker_info

from . import elastic, jobs, partition, resume
from . import placement as placement_module
from .dataset_pass import EpochPass, Sample
from .endpoint import resolve_endpoint
from .local import choose
from .reader import RawSample, announce, pipelined_reads, raw_samples, shard_lengths
from .resume import Ref
from .transport import Connection

# The process (by pid) whose objects from before its first iteration were frozen.
_frozen_pid = 0


class CachedDataset(IterableDataset[Any]):
    """Samples of WebDataset tar shards, served by the local cached daemon.

    Each sample is ``{"__key__": str, "__url__": str, "<ext>": bytes, ...}`` as WebDataset
    yields it (``decode`` may turn it into anything else).

    Args:
        urls: shard URLs (``s3://bucket/key.tar``, ``file:///path.tar``) or brace patterns
            (``s3://b/train-{000000..000127}.tar``), one or a list.
        socket: the daemon's ZeroMQ endpoint; None means ``$CACHED_SOCKET``, else
            ``ipc:///run/cached/cached.sock``.
        shuffle: shuffle the shard order per epoch (fixed by ``seed`` and the epoch) and the
            samples within a buffer of ``shuffle_buffer``. The buffer starts once the
            reader's first shard is all in (or after 100 samples), gives out half of it at
            once and fills as it goes, so a cold epoch's first batch waits for one shard's
            download per worker, not for a full buffer.
        seed: the shuffle seed; the same seed and epoch give the same order.
        rank, world_size: this process's place in distributed training; None means
            ``torch.distributed`` when initialized, else ``$RANK``/``$WORLD_SIZE``, else 0/1.
        equal_batches: every (rank, worker) reader yields exactly the same number of
            samples, so every rank yields the same number of batches and none waits for
            another at the end of an epoch (DDP). Costs: the sample count of every shard
            must be known before the first sample (the daemon fetches and indexes each
            shard once), and up to ``world_size * num_workers - 1`` samples of each epoch
            are left out. Without it, every sample is read exactly once but ranks may get
            different numbers of samples.
        decode: a function applied to each sample in the worker (e.g. image decoding).
        inflight: read requests in flight per reader.
        connect_timeout_s: how long to wait for the daemon's first answer.
        job: the name under which the daemon shows this training job (its plans, and the
            loop's wait for data that ``StallMeter`` or ``DeviceLoader`` measure around a
            DataLoader over this dataset); None means ``$CACHED_JOB``, else a name made
            from the script and the launch, the same in every rank (see
            :func:`cached_client.jobs.job_name`).
        placement: ``"global"`` (the default): every epoch spreads all shards over all
            readers, so a shard is read on a different node each epoch. ``"node"``: each
            node owns a fixed set of shards (from ``seed`` and the node count) and shuffles
            within it, so that after the first epoch a node's daemon has its shards cached
            and the store sees about one dataset per run, not one per epoch
            (docs/placement.md). The node comes from torchrun's ``LOCAL_WORLD_SIZE`` (and
            is checked against ``GROUP_RANK`` and ``LOCAL_RANK``); ranks are numbered node
            by node.
        placement_mix: with ``placement="node"``, the fraction of shards handed to
            another node each epoch (fixed by seed and epoch), for a better shuffle across
            nodes; it costs about that fraction of the dataset in store egress per epoch.
        node, local_world_size: the node index and ranks per node, overriding
            ``GROUP_RANK`` and ``LOCAL_WORLD_SIZE``.
        local_reads: on the daemon's node, read the sample bytes straight from the hot
            tier's files, the socket carrying only the control messages (docs/protocol.md,
            "Local reads"). None (the default) means ``$CACHED_LOCAL_READS`` (``auto``,
            ``on`` or ``off``), else auto: local where this process can open the files (as
            a member of the daemon's group), else through the socket. True requires it
            (``LocalReadsUnavailable`` where it cannot), False never does it.

    Resuming: :meth:`state_dict` and :meth:`load_state_dict` save and restore the reader's
    exact position (epoch, shard, sample, shuffle buffer) in the process that iterates:
    in each DataLoader worker under ``torchdata``'s ``StatefulDataLoader``, which collects
    and restores them per worker, or in the main process with ``num_workers=0``. A resumed
    iteration reads only the samples that remain, in the order the uninterrupted one would
    have given them. On another number of nodes, ranks or workers, load the state that
    :func:`cached_client.elastic.elastic_state` merges from every reader's: the rest of
    that epoch is read once, spread over the new readers.
    """

    def __init__(
        self,
        urls: str | Iterable[str],
        *,
        socket: str | None = None,
        shuffle: bool = False,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle_buffer: int = 1000,
        equal_batches: bool = False,
        decode: Callable[[Sample], Any] | None = None,
        inflight: int = 4,
        connect_timeout_s: float = 5.0,
        job: str | None = None,
        local_reads: bool | None = None,
        placement: str = "global",
        placement_mix: float = 0.0,
        node: int | None = None,
        local_world_size: int | None = None,
    ) -> None:
        super().__init__()
        self.urls = expand_all(urls)
        self.catalog = Catalog(self.urls)  # told to the daemon once; plans name positions
        self.endpoint = resolve_endpoint(socket)
        self.shuffle = shuffle
        self.seed = seed
        self.rank, self.world_size = partition.resolve_rank(rank, world_size)
        placement_module.check_placement(placement, placement_mix)
        self.placement, self.placement_mix = placement, placement_mix
        self.local_world_size: int | None = None
        if placement == "node":
            self.local_world_size = placement_module.resolve_local_world_size(
                self.rank, self.world_size, node=node, local_world_size=local_world_size
            )
        self.shuffle_buffer = shuffle_buffer
        self.equal_batches = equal_batches
        self.decode = decode
        self.inflight = inflight
        self.connect_timeout_s = connect_timeout_s
        # Shared with DataLoader workers (persistent ones too), so set_epoch reaches them.
        # Raw: one aligned int64 needs no lock, and a fork-context lock cannot be sent to
        # spawn or forkserver workers.
        self._epoch: ctypes.c_int64 | int = multiprocessing.RawValue(ctypes.c_int64, 0)
        self._conn: Connection | None = None
        self._conn_pid = 0
        self._lengths: list[int] | None = None
        # The iteration running (or last run) in this process, for state_dict; and a state
        # loaded for the next iteration to resume.
        self._pass: EpochPass | None = None
        self._pending: dict[str, Any] | None = None
        # Names this dataset's plans at the daemon; the same in every worker and epoch, so
        # an epoch's plan replaces the previous one (which announced it in advance).
        self._plans = uuid.uuid4().hex[:12]
        self.job = jobs.job_name(job)
        self.local_reads = choose(local_reads)

    # -- epochs -----------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration follows (call before each epoch)."""
        if isinstance(self._epoch, int):
            self._epoch = epoch
        else:
            self._epoch.value = epoch

    @property
    def epoch(self) -> int:
        """The epoch the next iteration follows."""
        return self._epoch if isinstance(self._epoch, int) else int(self._epoch.value)

    # -- pickling into workers ---------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_conn"] = None  # sockets never cross processes; each worker opens its own
        state["_pass"] = None  # a position is the process's own (its worker's)
        if not _spawning():
            # Shared memory crosses only into a process being started; elsewhere, the value.
            state["_epoch"] = self.epoch
        return state

    # -- iteration ----------------------------------------------------------------------------

    def connection(self) -> Connection:
        """This process's connection to the daemon (opened on first use)."""
        pid = os.getpid()
        if self._conn is not None and self._conn_pid != pid:
            # Inherited over fork (a DataLoader worker of a process that iterated before):
            # a ZeroMQ socket is unusable after fork, and pyzmq's close is a no-op here.
            self._conn = None
        if self._conn is None:
            self._conn = Connection(
                self.endpoint,
                connect_timeout_s=self.connect_timeout_s,
                local_reads=self.local_reads,
            )
            self._conn_pid = pid
        self._conn.open()
        return self._conn

    def stream_position(self) -> tuple[int, int]:
        """``(stream, streams)``: this reader's index among all ranks' workers."""
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return self.rank * workers + worker, self.world_size * workers

    def reader(self) -> placement_module.Reader:
        """This reader's place in the job (rank, DataLoader worker, node)."""
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return placement_module.Reader(
            self.rank,
            self.world_size,
            worker,
            workers,
            self.placement,
            self.local_world_size or 1,
            self.placement_mix,
        )

    def parts(self, epoch: int | None = None) -> list[partition.Part]:
        """The shard ranges this reader reads in ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        return placement_module.plan(
            len(self.urls),
            self.reader(),
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=epoch,
            lengths=self.lengths if self.equal_batches else None,
        )

    def lengths(self) -> list[int]:
        """The number of samples of every shard (asks the daemon once per process)."""
        if self._lengths is None:
            self._lengths = shard_lengths(self.connection(), self.urls, self._stream_id())
        return self._lengths

    def _stream_id(self) -> str:
        return f"{uuid.uuid4().hex[:12]}/r{self.rank}"

    def __iter__(self) -> Iterator[Any]:
        # Not a generator function: the pass (and so state_dict) must describe this
        # iteration from the moment iter() returns, as StatefulDataLoader asks for the
        # state right after it. Nothing here talks to the daemon: errors come at next().
        if get_worker_info() is not None:
            _freeze_inherited()
        stream, _ = self.stream_position()
        saved, self._pending = self._pending, None
        if saved is not None:
            # Checked again here: a state loaded in the main process may reach a worker.
            self._check(saved)
            saved = resume.for_epoch(
                saved, self.epoch, "CachedDataset", f"the dataset is set to epoch {self.epoch}"
            )
        run = self._pass = EpochPass(self.epoch, saved)
        return self._iterate(run, stream)

    def _iterate(self, run: EpochPass, stream: int) -> Iterator[Any]:
        samples: Iterator[Sample]
        if self.shuffle:
            shuffled = run.shuffled(
                lambda picks: self._read(run, stream, picks),
                seed=self.seed,
                size=self.shuffle_buffer,
                stream=stream,
            )
            samples = (sample for _, sample in shuffled)
        else:
            samples = (sample for _, sample in self._read(run, stream, []))
        if self.decode is None:
            yield from samples
        else:
            for sample in samples:
                yield self.decode(sample)
        run.position.finish()

    # -- resuming ---------------------------------------------------------------------------

    def _identity(self) -> dict[str, Any]:
        """What a saved state must match to be resumed here (see :func:`resume.check`)."""
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return {
            "loader": "CachedDataset",
            "version": resume.STATE_VERSION,
            "shards": len(self.urls),
            "urls": resume.fingerprint(self.urls),
            "world_size": self.world_size,
            "rank": self.rank,
            "workers": workers,
            "worker": worker,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "equal_batches": self.equal_batches,
            "shuffle_buffer": self.shuffle_buffer,
            "placement": self.placement,
            "local_world_size": self.local_world_size,
            "placement_mix": self.placement_mix,
        }

    def _check(self, state: Any) -> None:
        if isinstance(state, Mapping) and state.get("elastic"):
            elastic.check(state, self._identity())
        else:
            resume.check(state, self._identity())

    def state_dict(self) -> dict[str, Any]:
        """This reader's position: where the iteration running in this process is (or the
        last one ended), as a dict of plain values (ints, strings, lists).

        It holds the epoch, the position in the reader's shard order (part and sample),
        the samples read but not yet given out (the shuffle buffer, by index) and the
        shuffle's random state. Called in a DataLoader worker it is that worker's; under
        ``torchdata.stateful_dataloader.StatefulDataLoader`` every worker's is collected
        after each batch and restored into the same worker. Before any iteration it is
        the start of the current epoch.
        """
        if self._pending is not None:
            return dict(self._pending)
        run = self._pass or EpochPass(self.epoch, None)
        if run.elastic is not None and run.own is None:
            return dict(run.elastic)  # not started: the merged state it was loaded from
        return {**self._identity(), **run.state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume the next iteration at ``state`` (from :meth:`state_dict`): it reads only
        the samples that remain of that epoch, and yields exactly what the uninterrupted
        iteration would have from there.

        Raises :class:`~cached_client.errors.UsageError` if the state was saved by another
        reader: other shard URLs, seed, shuffle, rank, world size or DataLoader workers
        (a state merged by :func:`~cached_client.elastic.elastic_state` resumes on any of
        those, and its rest of the epoch is spread over the new readers). In the main
        process it also sets the epoch to the state's; in a worker (where the
        epoch is shared with the main process) the epoch must already be the state's, as
        a training loop's ``set_epoch`` makes it.
        """
        self._check(state)
        self._pending = dict(state)
        if get_worker_info() is None:
            self.set_epoch(int(state["epoch"]))

    def _read(
        self, run: EpochPass, stream: int, picks: Sequence[Ref]
    ) -> Iterator[tuple[Ref, Sample]]:
        """``picks`` (samples before the position), then the rest of the pass from the
        position, each as ``(ref, sample)``; the position moves as the rest is taken."""
        parts = run.begin(
            lengths=self.lengths if self.equal_batches else None,
            reader=self.reader,
            n_shards=len(self.urls),
            seed=self.seed,
            plan=self.parts,
        )
        spans, owners = resume.resume_spans(self.urls, parts, run.position, picks)
        conn, sid = self.connection(), self._stream_id()
        # The plan: what is left of this epoch (a resumed reader's rest), then the next
        # epoch's shards, so the daemon warms the hot tier across the epoch boundary and
        # knows what not to evict.
        ahead = [self.urls[p.shard] for p in self.parts(run.epoch + 1)]
        key = f"{self._plans}/r{self.rank}/s{stream}"
        told = announce(conn, key, [s.url for s in spans] + ahead, self.job, self.catalog)
        plan = key if told else None
        reads = pipelined_reads(conn, spans, sid, inflight=self.inflight, plan=plan)
        left = len(picks)
        for read, rid in reads:
            reply, frames = conn.wait(rid)
            part = owners[read.pos]
            first = int(reply["start"]) - parts[part].start
            raws = list(raw_samples(reply, frames))
            for i, raw in enumerate(raws):
                ref = (part, first + i)
                if left:  # a picked sample: before the position, which stays
                    left -= 1
                else:
                    run.position.took(ref, read.last and i == len(raws) - 1)
                yield ref, to_sample(read.url, raw)


def to_sample(url: str, raw: RawSample) -> Sample:
    """A WebDataset-style dict from a raw sample (the bytes are copied out of the frames)."""
    key, members = raw
    sample: Sample = {"__key__": key, "__url__": url}
    for ext, frame in members:
        sample[ext] = frame.bytes
    return sample


def _freeze_inherited() -> None:
    """In a DataLoader worker, once per process: move every object it holds so far (a
    forked worker's are the training process's: torch, the model, the loader) into the
    collector's permanent generation (``gc.freeze``), before the worker's first full
    collection.

    That collection would walk all of them, writing to each object's header, so the
    kernel copies every page of the inherited heap (copy on write): 0.4-0.8 s of a cold
    epoch's first batch on two loaded cores, where the worker's own work took
    milliseconds (docs/decisions.md, D29). Frozen objects are never collected: garbage
    cycles among what the worker inherited stay, shared with the parent, as the pages
    they are on. What the worker allocates afterwards is collected as usual.
    """
    global _frozen_pid
    pid = os.getpid()
    if _frozen_pid != pid:
        gc.freeze()
        _frozen_pid = pid


def _spawning() -> bool:
    from multiprocessing import context

    return context.get_spawning_popen() is not None
