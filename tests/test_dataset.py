"""``CachedDataset`` end to end: a real moto S3 server, a real ``cached serve`` subprocess,
real ZeroMQ and real DataLoader worker processes. No mocks.

What a user relies on: every sample of an epoch arrives exactly once over all ranks and
workers, byte for byte; the order follows (seed, epoch) and ``set_epoch`` reaches
persistent workers; ``equal_batches`` gives every reader the same count; samples look like
WebDataset's; errors are raised (never hangs) with messages that say what is wrong.
"""

from __future__ import annotations

import gc
import io
import os
import pickle
import random
import tarfile
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cached_client import CachedDataset, DaemonUnavailable, NotATar, ShardNotFound
from torch.utils.data import DataLoader, get_worker_info
from webdataset import tariterators

from tests.daemon import ProcessDaemon, dataset_shards, isolate_env, make_tar, serve_config
from tests.s3server import S3Server

# Uneven shards: 127 samples, which no reader count of 2..8 divides.
COUNTS = [5, 40, 12, 7, 33, 21, 9]
TOTAL = sum(COUNTS)
PATTERN = "shard-{0000..0006}.tar"
# A DataLoader whose worker stops answering raises after this long instead of hanging.
LOADER_TIMEOUT_S = 30


@dataclass(frozen=True)
class Data:
    """The dataset in the bucket, as the test knows it independently of the library."""

    bucket: str
    urls: list[str]
    samples: dict[str, dict[str, bytes]]  # key -> {ext: bytes}
    url_of: dict[str, str]  # key -> shard URL
    keys: list[str]  # natural order: shard order, then sample order

    @property
    def pattern(self) -> str:
        return f"s3://{self.bucket}/{PATTERN}"


@dataclass(frozen=True)
class Node:
    """A running ``cached serve`` and the dataset it serves."""

    socket: str
    daemon: ProcessDaemon
    data: Data


def read_tar(body: bytes) -> list[tuple[str, dict[str, bytes]]]:
    """Samples of a tar as the test sees them (standard library tarfile, WebDataset's
    grouping: key up to the first dot of the basename)."""
    out: list[tuple[str, dict[str, bytes]]] = []
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        for member in tar:
            data = tar.extractfile(member)
            assert data is not None
            key, ext = member.name.split(".", 1)
            if not out or out[-1][0] != key:
                out.append((key, {}))
            out[-1][1][ext] = data.read()
    return out


def start_daemon(directory: Path, endpoint_url: str) -> ProcessDaemon:
    """``cached serve`` with its own socket, hot tier and a free HTTP port."""
    return ProcessDaemon(*serve_config(directory, endpoint_url)).start()


@pytest.fixture(scope="module")
def node(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """One daemon for the module (its start costs seconds), serving 7 uneven shards."""
    bucket = s3_server.new_bucket("dataset")
    urls, samples, url_of, keys = [], {}, {}, []
    for i, body in enumerate(dataset_shards(len(COUNTS), COUNTS)):
        key = f"shard-{i:04d}.tar"
        s3_server.put(bucket, key, body)
        urls.append(f"s3://{bucket}/{key}")
        for sample_key, members in read_tar(body):
            samples[sample_key] = members
            url_of[sample_key] = urls[-1]
            keys.append(sample_key)
    assert len(keys) == TOTAL == len(samples)
    data = Data(bucket, urls, samples, url_of, keys)
    with pytest.MonkeyPatch.context() as mp:
        # Module scope runs before the autouse env fixture: give the daemon a clean env.
        isolate_env(mp)
        daemon = start_daemon(tmp_path_factory.mktemp("node"), s3_server.endpoint_url)
    try:
        yield Node(daemon.socket, daemon, data)
    finally:
        code = daemon.stop()
        assert code == 0, f"daemon exited {code}:\n{daemon.log.read_text()}"


def tag_worker(sample: dict[str, Any]) -> dict[str, Any]:
    """A ``decode`` that records where it ran (module level: picklable)."""
    info = get_worker_info()
    return {**sample, "__worker__": -1 if info is None else info.id, "__pid__": os.getpid()}


def loader(ds: CachedDataset, workers: int, **kwargs: Any) -> DataLoader[Any]:
    """A real DataLoader; one sample per item unless ``batch_size`` is given."""
    kwargs.setdefault("batch_size", None)
    if workers:
        kwargs.setdefault("timeout", LOADER_TIMEOUT_S)
    return DataLoader(ds, num_workers=workers, **kwargs)


def keys_of(items: Any) -> list[str]:
    return [s["__key__"] for s in items]


def dataset(node: Node, **kwargs: Any) -> CachedDataset:
    return CachedDataset(node.data.pattern, socket=node.socket, **kwargs)


def assert_original(data: Data, sample: dict[str, Any]) -> None:
    """The sample is byte for byte the one in the bucket, with its shard's URL."""
    key = sample["__key__"]
    assert sample["__url__"] == data.url_of[key]
    members = {k: v for k, v in sample.items() if not k.startswith("__")}
    assert members == data.samples[key]


def raised(exc_type: type[Exception], items: Any) -> str:
    """Iterate ``items`` (a dataset or a DataLoader) until it raises ``exc_type``; returns
    the message.

    The traceback's frames hold the DataLoader's iterator in a reference cycle; a garbage
    collection would clear the weak references of its queues before its ``__del__``, and
    its shutdown would then wait 5 s per worker. Clearing the frames lets it shut its
    workers down at once.
    """
    it = iter(items)
    try:
        for _ in it:
            pass
    except exc_type as exc:
        traceback.clear_frames(exc.__traceback__)
        return str(exc)
    finally:
        del it
    pytest.fail(f"{exc_type.__name__} was not raised")


def expect_unreachable(endpoint: str) -> str:
    """The message for a daemon that is not running: an ipc endpoint names the missing file."""
    hint = "is `cached serve` running? (or set $CACHED_SOCKET to where it listens)"
    if endpoint.startswith("ipc://"):
        hint = f"no socket at {endpoint[len('ipc://') :]}; {hint}"
    return f"cannot reach the cached daemon at {endpoint}; {hint}"


# -- 1. exactly once -------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_sample_exactly_once(node: Node, world: int, workers: int, shuffle: bool) -> None:
    """Over all ranks and workers, one epoch is the dataset: each key once, bytes intact."""
    seen: list[str] = []
    readers: set[tuple[int, int]] = set()
    for rank in range(world):
        ds = dataset(node, shuffle=shuffle, seed=7, rank=rank, world_size=world, decode=tag_worker)
        if shuffle:
            ds.set_epoch(3)
        for sample in loader(ds, workers):
            assert_original(node.data, sample)
            seen.append(sample["__key__"])
            readers.add((rank, sample["__worker__"]))
    assert Counter(seen) == Counter(node.data.keys)
    # The work really was spread: every worker of every rank that got a shard read it.
    assert {r for r, _ in readers} == set(range(world))
    assert {w for _, w in readers} == ({-1} if workers == 0 else set(range(workers)))


# -- 2. determinism ---------------------------------------------------------------------------


def epoch_order(node: Node, epoch: int, *, seed: int = 3, shuffle: bool = True) -> list[str]:
    """Rank 0 of 2, two workers: the DataLoader's order is deterministic."""
    ds = dataset(node, shuffle=shuffle, seed=seed, rank=0, world_size=2)
    ds.set_epoch(epoch)
    return keys_of(loader(ds, 2))


def test_same_seed_and_epoch_same_order(node: Node) -> None:
    first = epoch_order(node, 1)
    assert len(first) > 10
    assert epoch_order(node, 1) == first
    assert epoch_order(node, 2) != first, "set_epoch must change the order"
    assert epoch_order(node, 1, seed=4) != first, "the seed must change the order"
    assert first != sorted(first), "shuffle=True must shuffle"


def test_unshuffled_is_natural_order(node: Node) -> None:
    """shuffle=False: shard order, then sample order, whatever the epoch."""
    for epoch in (0, 5):
        in_main, in_worker = dataset(node), dataset(node)
        in_main.set_epoch(epoch)
        in_worker.set_epoch(epoch)
        assert keys_of(in_main) == node.data.keys
        assert keys_of(loader(in_worker, 1)) == node.data.keys
    # Several readers: each one's part comes in natural order too.
    natural = {key: i for i, key in enumerate(node.data.keys)}
    for rank in range(2):
        part = keys_of(dataset(node, rank=rank, world_size=2))
        assert part
        assert part == sorted(part, key=natural.__getitem__)


# -- 3. set_epoch reaches persistent workers -------------------------------------------------


@pytest.mark.parametrize(
    ("context", "workers"),
    [("fork", 2), ("spawn", 1)],
)
def test_set_epoch_reaches_persistent_workers(node: Node, context: str, workers: int) -> None:
    """Spawned workers (CUDA users' choice) get the dataset pickled: the epoch must still be
    shared. One spawned worker only: each one imports torch, seconds on a small machine."""
    ds = dataset(node, shuffle=True, seed=11, decode=tag_worker)
    persistent = loader(ds, workers, persistent_workers=True, multiprocessing_context=context)
    epoch0 = list(persistent)
    ds.set_epoch(1)
    epoch1 = list(persistent)
    # The same worker processes served both epochs...
    pids = {s["__pid__"] for s in epoch0}
    assert len(pids) == workers
    assert {s["__pid__"] for s in epoch1} == pids
    # ...and followed the new epoch: the order a fresh loader gives for epoch 1.
    assert keys_of(epoch1) != keys_of(epoch0)
    assert sorted(keys_of(epoch1)) == sorted(node.data.keys)
    fresh = dataset(node, shuffle=True, seed=11)
    fresh.set_epoch(1)
    assert keys_of(epoch1) == keys_of(loader(fresh, workers))


# -- 4. pickling ------------------------------------------------------------------------------


def test_pickle_after_iteration_started(node: Node) -> None:
    ds = dataset(node, shuffle=True, seed=5)
    it = iter(ds)
    first = next(it)  # the main process now holds a connection to the daemon
    blob = pickle.dumps(ds)
    # No socket, context or connection travels: the pickle references no zmq object.
    assert b"zmq" not in blob
    assert b"Connection" not in blob
    clone = pickle.loads(blob)
    order = keys_of(clone)
    assert order == [first["__key__"], *keys_of(it)]  # same seed and epoch: same order
    assert sorted(order) == sorted(node.data.keys)
    # The copy is independent and iterates again, in another epoch's order.
    clone.set_epoch(1)
    again = keys_of(clone)
    assert again != order
    assert sorted(again) == sorted(order)


def test_fork_workers_after_main_process_iteration(node: Node) -> None:
    """Peeking at a sample in the main process, then training with forked workers."""
    ds = dataset(node)
    assert next(iter(ds))["__key__"] == node.data.keys[0]
    # A short timeout turns the hang into an error; the hung worker is then terminated
    # (5 s of join first), here by gc.collect() rather than in whichever test comes next.
    try:
        keys = keys_of(loader(ds, 1, timeout=2))
    except RuntimeError as exc:
        keys = [f"the DataLoader failed: {exc}"]
    gc.collect()
    assert sorted(keys) == sorted(node.data.keys)


# -- 5. equal batches ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("world", "workers", "shuffle"),
    [(1, 2, True), (2, 1, True), (2, 2, False), (3, 2, True)],
)
def test_equal_batches(node: Node, world: int, workers: int, shuffle: bool) -> None:
    streams = world * workers
    each, left_out = divmod(TOTAL, streams)
    assert left_out > 0, "the shards must not divide evenly, or there is nothing to test"
    per_reader: Counter[tuple[int, int]] = Counter()
    batches: list[int] = []
    seen: list[str] = []
    for rank in range(world):
        ds = dataset(
            node,
            shuffle=shuffle,
            seed=1,
            rank=rank,
            world_size=world,
            equal_batches=True,
            decode=tag_worker,
        )
        ds.set_epoch(2)
        n = 0
        for batch in loader(ds, workers, batch_size=4):
            n += 1
            assert len(batch["__key__"]) <= 4
            for key, worker in zip(batch["__key__"], batch["__worker__"].tolist(), strict=True):
                per_reader[rank, worker] += 1
                seen.append(key)
        batches.append(n)
    # Every (rank, worker) reader yields exactly total // readers samples...
    assert per_reader == {(r, w): each for r in range(world) for w in range(workers)}
    # ...each at most once, all but the remainder of the epoch...
    assert len(seen) == len(set(seen)) == TOTAL - left_out
    assert set(seen) <= set(node.data.keys)
    # ...so every rank's DataLoader yields the same number of batches.
    assert len(set(batches)) == 1, batches


def test_equal_batches_samples_are_intact(node: Node) -> None:
    """Reads that start and stop inside shards return the right bytes."""
    for rank in range(3):
        ds = dataset(node, rank=rank, world_size=3, equal_batches=True)
        samples = list(ds)
        assert len(samples) == TOTAL // 3
        for sample in samples:
            assert_original(node.data, sample)


# -- 6. the sample format --------------------------------------------------------------------


def test_samples_are_webdataset_dicts(node: Node) -> None:
    for sample in dataset(node):
        assert set(sample) == {"__key__", "__url__", "bin", "cls"}
        assert isinstance(sample["__key__"], str)
        assert all(isinstance(sample[ext], bytes) for ext in ("bin", "cls"))
        assert_original(node.data, sample)


def test_same_samples_as_webdataset(node: Node, s3_server: S3Server) -> None:
    """Directories in keys, several dots, upper-case extensions: grouped as WebDataset does."""
    members = [
        ("train/img0001", {"JPG": b"\xff\xd8jpeg", "seg.PNG": b"\x89PNGseg", "json": b"{}"}),
        ("train/img0002", {"jpg": b"\xff\xd8second", "txt": b"hello"}),
        ("val/x_3", {"cls": b"3", "input.tar.gz": b"nested"}),
    ]
    body = make_tar(members)
    s3_server.put(node.data.bucket, "odd/names.tar", body)
    url = f"s3://{node.data.bucket}/odd/names.tar"
    # webdataset's own tar reader and grouping, on the same bytes.
    files = tariterators.tar_file_expander([{"url": url, "stream": io.BytesIO(body)}])
    reference = list(tariterators.group_by_keys(files))
    ours = list(CachedDataset(url, socket=node.socket))
    assert len(reference) == 3
    assert ours == reference
    assert set(ours[0]) == {"__key__", "__url__", "jpg", "seg.png", "json"}


def summarize(sample: dict[str, Any]) -> tuple[str, int, int]:
    """A ``decode`` that turns a sample into something else entirely."""
    return sample["__key__"], len(sample["bin"]), os.getpid()


@pytest.mark.parametrize("workers", [0, 2])
def test_decode_runs_in_the_worker(node: Node, workers: int) -> None:
    out = list(loader(dataset(node, decode=summarize), workers))
    assert sorted(k for k, _, _ in out) == sorted(node.data.keys)
    assert all(n == len(node.data.samples[k]["bin"]) for k, n, _ in out)
    pids = {pid for _, _, pid in out}
    if workers == 0:
        assert pids == {os.getpid()}
    else:
        assert len(pids) == workers
        assert os.getpid() not in pids


def freeze_count(sample: dict[str, Any]) -> tuple[str, int, int]:
    """A ``decode`` that tells how many objects the collector of its process leaves alone."""
    return sample["__key__"], gc.get_freeze_count(), os.getpid()


@pytest.mark.parametrize("workers", [0, 2])
def test_workers_freeze_what_they_inherit(node: Node, workers: int) -> None:
    """A forked worker's first full collection would walk every object it inherited from
    the training process, and the kernel would copy every page they are on (D29: most of
    a cold epoch's first batch on loaded cores). Each worker freezes them first, once; the
    training process's collector is left as it was."""
    before, inherited = gc.get_freeze_count(), len(gc.get_objects())
    ds = dataset(node, decode=freeze_count)
    dl = loader(ds, workers, multiprocessing_context="fork" if workers else None)
    out = list(dl) + list(dl)  # a second epoch in the same (non-persistent: new) workers
    assert sorted(k for k, _, _ in out) == sorted(node.data.keys * 2)
    assert gc.get_freeze_count() == before
    if workers == 0:
        assert {count for _, count, _ in out} == {before}
    else:
        counts: dict[int, list[int]] = {}
        for _, count, pid in out:
            counts.setdefault(pid, []).append(count)
        assert len(counts) == 2 * workers
        # What a worker froze is at least most of what the training process had at the
        # fork; frozen once (inherited objects that die leave it; none join it later).
        for seen in counts.values():
            assert seen[0] > inherited // 2, counts
            assert seen == sorted(seen, reverse=True), seen


# -- 7. errors ---------------------------------------------------------------------------------


def read_all_good(node: Node) -> None:
    """The daemon still serves a good dataset, fully, to a new client."""
    assert sorted(keys_of(dataset(node))) == sorted(node.data.keys)


@pytest.mark.timeout(15)
@pytest.mark.parametrize("workers", [0, 2])
def test_daemon_not_running(tmp_path: Path, workers: int) -> None:
    endpoint = f"ipc://{tmp_path}/nobody.sock"
    ds = CachedDataset("s3://bucket/shard-{0..3}.tar", socket=endpoint, connect_timeout_s=1)
    if workers == 0:
        assert raised(DaemonUnavailable, ds) == expect_unreachable(endpoint)
    else:
        # DataLoader re-raises the worker's exception in the main process, same type,
        # with the worker's traceback around the message.
        assert expect_unreachable(endpoint) in raised(DaemonUnavailable, loader(ds, workers))


@pytest.mark.timeout(15)
def test_daemon_not_running_tcp() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on (while it stays bound)
        s.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        ds = CachedDataset("s3://bucket/a.tar", socket=endpoint, connect_timeout_s=1)
        assert raised(DaemonUnavailable, ds) == expect_unreachable(endpoint)


@pytest.mark.timeout(15)
@pytest.mark.parametrize("workers", [0, 1])
def test_missing_shard(node: Node, workers: int) -> None:
    url = f"s3://{node.data.bucket}/no/such-shard-{workers}.tar"
    ds = CachedDataset(url, socket=node.socket)
    assert url in raised(ShardNotFound, loader(ds, workers))
    read_all_good(node)


@pytest.mark.timeout(15)
@pytest.mark.parametrize("workers", [0, 1])
def test_not_a_tar(node: Node, s3_server: S3Server, workers: int) -> None:
    key = f"garbage-{workers}.tar"
    s3_server.put(node.data.bucket, key, random.Random(workers).randbytes(10_000))
    url = f"s3://{node.data.bucket}/{key}"
    assert url in raised(NotATar, loader(CachedDataset(url, socket=node.socket), workers))
    read_all_good(node)


@pytest.mark.timeout(15)
@pytest.mark.parametrize("cut", ["in-data", "in-header"])
def test_truncated_tar(node: Node, s3_server: S3Server, cut: str) -> None:
    body = dataset_shards(1, 20, payload=3000, prefix=f"t{cut}")[0]
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        # A 3000-byte member in the middle: the samples before it are whole.
        member = next(m for m in tar.getmembers()[6:] if m.size == 3000)
    # Cut inside the member's data, or inside its header.
    end = member.offset_data + 1000 if cut == "in-data" else member.offset + 100
    key = f"truncated-{cut}.tar"
    s3_server.put(node.data.bucket, key, body[:end])
    url = f"s3://{node.data.bucket}/{key}"
    got: list[Any] = []

    def read() -> Iterator[Any]:
        for sample in CachedDataset(url, socket=node.socket):
            got.append(sample)
            yield sample

    # Not taken for a good shard the first time, nor silently the second time.
    for _ in range(2):
        assert url in raised(NotATar, read())
    assert got == [], "no sample of a damaged shard may be served"
    read_all_good(node)


def test_error_after_good_shards(node: Node, s3_server: S3Server) -> None:
    """A bad shard late in the list: the good samples before it, then the error."""
    missing = f"s3://{node.data.bucket}/late-missing.tar"
    ds = CachedDataset([*node.data.urls[:2], missing], socket=node.socket)
    got: list[str] = []
    with pytest.raises(ShardNotFound, match=missing):
        for sample in ds:
            got.append(sample["__key__"])
    assert got == node.data.keys[: COUNTS[0] + COUNTS[1]]


@pytest.mark.parametrize(
    "url",
    ["http://host/a.tar", "gs://bucket/a.tar", "/abs/a.tar", "s3://bucket-only", "s3:///key.tar"],
)
def test_bad_url_fails_at_construction(url: str) -> None:
    with pytest.raises(ValueError, match="bad shard URL"):
        CachedDataset(url, socket="ipc:///nonexistent/never-used.sock")
    with pytest.raises(ValueError, match="bad shard URL"):
        CachedDataset(["s3://bucket/ok.tar", url], socket="ipc:///nonexistent/never-used.sock")


# -- 8. URL patterns and the socket ---------------------------------------------------------


def test_brace_pattern_expands_to_the_shards(node: Node) -> None:
    urls = node.data.urls
    assert len(urls) == 7
    assert dataset(node).urls == urls
    halves = [f"s3://{node.data.bucket}/shard-{{0000..0002}}.tar", urls[3], urls[4]]
    halves.append(f"s3://{node.data.bucket}/shard-{{0005..0006}}.tar")
    assert CachedDataset(halves, socket=node.socket).urls == urls


def test_socket_from_environment(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHED_SOCKET", node.socket)
    assert keys_of(CachedDataset(node.data.pattern)) == node.data.keys
