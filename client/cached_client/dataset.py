"""``CachedDataset``: WebDataset-style samples from the cached daemon, as a torch
``IterableDataset`` for DataLoaders with worker processes."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import random
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from . import partition
from .reader import RawSample, Span, announce, read_spans, shard_lengths
from .transport import Connection, resolve_endpoint
from .urls import expand_all

Sample = dict[str, Any]


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
            samples within a buffer of ``shuffle_buffer`` (which starts yielding after 100
            samples and fills as it goes, so the first batch does not wait for it).
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
    ) -> None:
        super().__init__()
        self.urls = expand_all(urls)
        self.endpoint = resolve_endpoint(socket)
        self.shuffle = shuffle
        self.seed = seed
        self.rank, self.world_size = partition.resolve_rank(rank, world_size)
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
        # Names this dataset's plans at the daemon; the same in every worker and epoch, so
        # an epoch's plan replaces the previous one (which announced it in advance).
        self._job = uuid.uuid4().hex[:12]

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
            self._conn = Connection(self.endpoint, connect_timeout_s=self.connect_timeout_s)
            self._conn_pid = pid
        self._conn.open()
        return self._conn

    def stream_position(self) -> tuple[int, int]:
        """``(stream, streams)``: this reader's index among all ranks' workers."""
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return self.rank * workers + worker, self.world_size * workers

    def parts(self, epoch: int | None = None) -> list[partition.Part]:
        """The shard ranges this reader reads in ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        stream, streams = self.stream_position()
        return partition.reader_parts(
            len(self.urls),
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=epoch,
            stream=stream,
            streams=streams,
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
        epoch = self.epoch
        stream, _ = self.stream_position()
        samples: Iterator[Sample] = self._samples(epoch, stream)
        if self.shuffle:
            rng = random.Random(f"samples/{self.seed}/{epoch}/{stream}")
            samples = partition.buffered_shuffle(samples, self.shuffle_buffer, rng)
        if self.decode is None:
            yield from samples
        else:
            for sample in samples:
                yield self.decode(sample)

    def _samples(self, epoch: int, stream: int) -> Iterator[Sample]:
        spans = [Span(self.urls[p.shard], p.start, p.stop) for p in self.parts(epoch)]
        conn, sid = self.connection(), self._stream_id()
        # The plan: this epoch's shards, then the next epoch's, so the daemon warms the hot
        # tier across the epoch boundary and knows what not to evict.
        ahead = [self.urls[p.shard] for p in self.parts(epoch + 1)]
        key = f"{self._job}/r{self.rank}/s{stream}"
        plan = key if announce(conn, key, [s.url for s in spans] + ahead, self._job) else None
        for url, raw in read_spans(conn, spans, sid, inflight=self.inflight, plan=plan):
            yield to_sample(url, raw)


def to_sample(url: str, raw: RawSample) -> Sample:
    """A WebDataset-style dict from a raw sample (the bytes are copied out of the frames)."""
    key, members = raw
    sample: Sample = {"__key__": key, "__url__": url}
    for ext, frame in members:
        sample[ext] = frame.bytes
    return sample


def _spawning() -> bool:
    from multiprocessing import context

    return context.get_spawning_popen() is not None
