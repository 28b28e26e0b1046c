"""Resume without replay: ``state_dict``/``load_state_dict`` on ``CachedDataset`` (per
DataLoader worker, through torchdata's ``StatefulDataLoader``, and in the main process with
a plain DataLoader) and on ``FastLoader``. A real ``cached serve``, real moto S3, real
worker processes.

What a user relies on: after a resume the loader yields exactly what the uninterrupted
run would have from the checkpoint on (keys and bytes, in order, across the epoch
boundary), and the daemon serves only that: the samples before the checkpoint are not
read again. The contract is at most one shard's worth of samples re-served per reader;
the client reads by sample index, so the measured excess is zero. A state saved by
another reader (world size, rank, workers, URLs, seed) is refused with ``UsageError``.
"""

from __future__ import annotations

import gc
import hashlib
import json
import random
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from cached_client import CachedDataset, FastLoader, UsageError
from cached_client.buffers import Batch
from cached_client.partition import ShuffleBuffer
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from tests.daemon import ProcessDaemon, dataset_shards, isolate_env, serve_config
from tests.s3server import S3Server

pytestmark = [
    # torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates; not ours to fix.
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

# Uneven shards: 241 samples over 10 shards, so readers get different parts and counts.
COUNTS = [23, 31, 12, 40, 17, 28, 9, 35, 20, 26]
PATTERN = "res-{0000..0009}.tar"
BATCH = 5
# Small enough that the buffer fills, runs full and drains within a reader's part: a
# checkpoint then holds samples of two or three shards in the buffer.
SHUFFLE_BUFFER = 24
LOADER_TIMEOUT_S = 30

Item = tuple[str, str]  # (key, digest of the sample's bytes)


@dataclass(frozen=True)
class Node:
    daemon: ProcessDaemon
    pattern: str

    @property
    def socket(self) -> str:
        return self.daemon.socket

    def served(self) -> int:
        """Samples the daemon has served, once it has finished serving what was asked
        (an interrupted reader's reads in flight are served after it lets go)."""
        last = -1.0
        while True:
            now = float(self.daemon.status()["counters"]["served_samples"])
            if now == last:
                return int(now)
            last = now
            time.sleep(0.2)


@pytest.fixture(scope="module")
def node(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    bucket = s3_server.new_bucket("resume")
    for i, body in enumerate(dataset_shards(len(COUNTS), COUNTS, payload=300, prefix="r")):
        s3_server.put(bucket, f"res-{i:04d}.tar", body)
    with pytest.MonkeyPatch.context() as mp:
        isolate_env(mp)  # module scope runs before the autouse env fixture
        config, socket = serve_config(tmp_path_factory.mktemp("resume"), s3_server.endpoint_url)
        daemon = ProcessDaemon(config, socket).start()
    try:
        yield Node(daemon, f"s3://{bucket}/{PATTERN}")
    finally:
        assert daemon.stop() == 0, daemon.log_tail()


def item(sample: dict[str, Any]) -> Item:
    members = b"".join(sample[ext] for ext in sorted(sample) if not ext.startswith("__"))
    return sample["__key__"], hashlib.sha256(members).hexdigest()[:16]


def as_items(samples: list[dict[str, Any]]) -> list[Item]:
    """The collate function: a batch as its samples' keys and digests (module level:
    picklable into workers)."""
    return [item(s) for s in samples]


def flat(batches: list[list[Item]]) -> list[Item]:
    return [i for b in batches for i in b]


# -- CachedDataset under StatefulDataLoader -------------------------------------------------


def dataset(node: Node, **kwargs: Any) -> CachedDataset:
    kwargs.setdefault("shuffle", True)
    kwargs.setdefault("shuffle_buffer", SHUFFLE_BUFFER)
    return CachedDataset(node.pattern, socket=node.socket, seed=5, **kwargs)


def stateful(ds: CachedDataset, workers: int) -> StatefulDataLoader[Any]:
    timeout = LOADER_TIMEOUT_S if workers else 0
    return StatefulDataLoader(
        ds, batch_size=BATCH, num_workers=workers, collate_fn=as_items, timeout=timeout
    )


def two_epochs(ds: CachedDataset, loader: Any) -> list[list[list[Item]]]:
    """Epochs 0 and 1 through one loader, as a training loop runs them."""
    out = []
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        out.append(list(loader))
    return out


def checkpoint_at(where: str, batches: int) -> int:
    return {"middle": batches * 2 // 5, "near_end": batches - 2, "at_end": batches}[where]


@pytest.mark.parametrize("where", ["middle", "near_end", "at_end"])
@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_exactly_without_replay(
    node: Node, workers: int, where: str
) -> None:
    ds = dataset(node)
    reference = two_epochs(ds, stateful(ds, workers))
    stop = checkpoint_at(where, len(reference[0]))

    # The interrupted run: `stop` batches of epoch 0, then a checkpoint.
    first = dataset(node)
    loader = stateful(first, workers)
    it = iter(loader)
    head = [next(it) for _ in range(stop)]
    state = loader.state_dict()
    del it, loader  # shuts its workers down
    gc.collect()
    state = json.loads(json.dumps(state))  # plain values: any checkpoint format holds them

    # The resumed run, in new processes: the rest of epoch 0, then epoch 1.
    again = dataset(node)
    loader = stateful(again, workers)
    loader.load_state_dict(state)
    before = node.served()
    tail = two_epochs(again, loader)
    served = node.served() - before

    assert head + tail[0] == reference[0]
    assert tail[1] == reference[1]
    if where == "at_end":
        assert tail[0] == []
    delivered = len(flat(tail[0] + tail[1]))
    readers = max(1, workers)
    assert served - delivered <= max(COUNTS) * readers  # the contract
    assert served == delivered, f"served {served} to deliver {delivered}"  # what we get


def test_equal_batches_after_resume(node: Node) -> None:
    """Two ranks of two workers each, checkpointed at the same step: every rank still
    yields the same number of batches over the epoch, and exactly the uninterrupted ones."""
    world, workers = 2, 2
    for rank in range(world):
        ds = dataset(node, rank=rank, world_size=world, equal_batches=True)
        reference = list(stateful(ds, workers))
        stop = 3
        first = dataset(node, rank=rank, world_size=world, equal_batches=True)
        loader = stateful(first, workers)
        it = iter(loader)
        head = [next(it) for _ in range(stop)]
        state = loader.state_dict()
        del it, loader
        again = dataset(node, rank=rank, world_size=world, equal_batches=True)
        loader = stateful(again, workers)
        loader.load_state_dict(state)
        before = node.served()
        tail = list(loader)
        assert node.served() - before == len(flat(tail))
        assert head + tail == reference
        each = sum(COUNTS) // (world * workers)  # per (rank, worker) reader
        assert len(head) + len(tail) == workers * -(-each // BATCH)


def test_the_resumed_plan_is_what_remains(node: Node) -> None:
    """The daemon is told the rest of the epoch (then the next one), not the whole epoch."""
    ds = dataset(node)
    ds.set_epoch(2)
    it = iter(DataLoader(ds, batch_size=BATCH, collate_fn=as_items))
    for _ in range(15):
        next(it)
    state = ds.state_dict()
    del it
    again = dataset(node)
    again.load_state_dict(state)
    assert again.epoch == 2  # in the main process, loading sets the epoch
    it = iter(DataLoader(again, batch_size=BATCH, collate_fn=as_items))
    next(it)
    plans = {p["stream"].split("/")[0]: p for p in node.daemon.status()["plans"]}
    # Shards still to read: those of the buffered samples before the position, and the
    # position's shard on; then all of epoch 3's.
    earlier = {part for part, _ in state["buffer"] if part < state["part"]}
    remaining = len(earlier) + state["parts"] - state["part"]
    assert 0 < remaining < state["parts"]
    assert plans[again._plans]["shards"] == remaining + len(COUNTS)
    del it


def test_plain_dataloader_in_the_main_process(node: Node) -> None:
    """Without workers the dataset's own state_dict is the position: no torchdata needed."""
    ds = dataset(node)
    reference = list(DataLoader(ds, batch_size=BATCH, collate_fn=as_items))
    first = dataset(node)
    it = iter(DataLoader(first, batch_size=BATCH, collate_fn=as_items))
    head = [next(it) for _ in range(20)]
    state = first.state_dict()
    del it
    assert state["epoch"] == 0 and state["buffer"]  # mid-shuffle: the buffer is saved
    again = dataset(node)
    again.load_state_dict(state)
    before = node.served()
    tail = list(DataLoader(again, batch_size=BATCH, collate_fn=as_items))
    assert node.served() - before == len(flat(tail))
    assert head + tail == reference


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
def test_resume_at_every_sample(node: Node, shuffle: bool) -> None:
    """One reader's whole part, resumed after each of a spread of samples."""
    ds = dataset(node, shuffle=shuffle, rank=1, world_size=2)
    ds.set_epoch(1)
    reference = [item(s) for s in ds]
    for stop in [0, 1, 7, 23, 24, 25, 60, len(reference) - 1, len(reference)]:
        first = dataset(node, shuffle=shuffle, rank=1, world_size=2)
        first.set_epoch(1)
        it = iter(first)
        head = [item(next(it)) for _ in range(stop)]
        state = first.state_dict()
        del it
        again = dataset(node, shuffle=shuffle, rank=1, world_size=2)
        again.load_state_dict(state)
        assert head + [item(s) for s in again] == reference, stop


def test_the_shuffle_starts_at_the_readers_first_shard(node: Node) -> None:
    """A 1000-sample buffer over shards of 9-40 samples: the first outputs come from the
    reader's first shard alone (half of it at once), so a cold first batch waits for one
    download, not for the 100 samples of three or four; the same order every time."""
    ds = CachedDataset(node.pattern, socket=node.socket, shuffle=True, seed=5)
    order = [s["__url__"] for s in ds]
    first_shard = order[0]
    count = order.count(first_shard)
    assert order[: count - count // 2] == [first_shard] * (count - count // 2)
    again = CachedDataset(node.pattern, socket=node.socket, shuffle=True, seed=5)
    assert [s["__url__"] for s in again] == order


@pytest.mark.parametrize("stop", [21, 60, 200])
def test_a_version_1_state_resumes_exactly(node: Node, stop: int) -> None:
    """A state saved by the previous client (version 1: no ``started`` or ``owed``) is
    taken, and resumes what an uninterrupted run gives: it was saved between two samples
    given out, where the buffer had started and owed nothing."""
    reference = [item(s) for s in dataset(node, shuffle_buffer=1000)]
    first = dataset(node, shuffle_buffer=1000)
    it = iter(first)
    head = [item(next(it)) for _ in range(stop)]
    state = first.state_dict()
    del it
    assert state["started"] and not state["owed"]  # past the start: what version 1 saved
    old = {k: v for k, v in state.items() if k not in ("started", "owed")}
    old["version"] = 1
    again = dataset(node, shuffle_buffer=1000)
    again.load_state_dict(old)
    assert head + [item(s) for s in again] == reference


# -- FastLoader ----------------------------------------------------------------------------


def fast(node: Node, **kwargs: Any) -> FastLoader:
    kwargs.setdefault("rank", 1)
    kwargs.setdefault("world_size", 2)
    return FastLoader(
        node.pattern, batch_size=7, socket=node.socket, shuffle=True, seed=3, **kwargs
    )


def batch_items(batch: Batch) -> list[Item]:
    """Keys and digests, taken at once (a host batch lives in the loader's ring)."""
    out = []
    for j, key in enumerate(batch.keys):
        data = b"".join(
            batch.data[ext][batch.offsets[ext][j] : batch.offsets[ext][j + 1]].numpy().tobytes()
            for ext in sorted(batch.data)
        )
        out.append((key, hashlib.sha256(data).hexdigest()[:16]))
    return out


def fast_epochs(loader: FastLoader, epochs: tuple[int, ...] = (0, 1)) -> list[list[list[Item]]]:
    out = []
    for epoch in epochs:
        loader.set_epoch(epoch)
        out.append([batch_items(b) for b in loader])
    return out


@pytest.mark.parametrize("where", ["middle", "near_end", "at_end"])
@pytest.mark.parametrize("equal", [False, True], ids=["default", "equal_batches"])
def test_fast_loader_resumes_exactly_without_replay(node: Node, where: str, equal: bool) -> None:
    reference = fast_epochs(fast(node, equal_batches=equal))
    stop = checkpoint_at(where, len(reference[0]))

    first = fast(node, equal_batches=equal)
    it = iter(first)
    head = [batch_items(next(it)) for _ in range(stop)]
    state = json.loads(json.dumps(first.state_dict()))
    del it, first

    again = fast(node, equal_batches=equal)
    again.load_state_dict(state)
    assert again.epoch == 0
    before = node.served()
    tail = [[batch_items(b) for b in again]]
    tail += fast_epochs(again, (1,))
    served = node.served() - before

    assert head + tail[0] == reference[0]
    assert tail[1] == reference[1]
    if equal:
        assert len(head) + len(tail[0]) == len(again)  # the epoch's batches, resume or not
    delivered = len(flat(tail[0] + tail[1]))
    assert served - delivered <= max(COUNTS)  # the contract: one shard's worth at most
    assert served == delivered, f"served {served} to deliver {delivered}"


# -- refusing another reader's state -------------------------------------------------------


def test_state_of_another_world_size_is_refused(node: Node) -> None:
    ds = dataset(node, rank=1, world_size=2)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    del it
    with pytest.raises(UsageError, match=r"world_size: saved 2, here 3"):
        dataset(node, rank=1, world_size=3).load_state_dict(state)
    with pytest.raises(UsageError, match=r"rank: saved 1, here 0"):
        dataset(node, rank=0, world_size=2).load_state_dict(state)
    other_seed = CachedDataset(
        node.pattern, socket=node.socket, shuffle=True, seed=6, rank=1, world_size=2
    )
    with pytest.raises(UsageError, match="seed: saved 5, here 6"):
        other_seed.load_state_dict(state)
    other_urls = CachedDataset(
        node.pattern.replace("0009", "0008"), socket=node.socket, rank=1, world_size=2
    )
    with pytest.raises(UsageError, match="number of shards: saved 10, here 9"):
        other_urls.load_state_dict(state)

    fast_state = fast(node, world_size=2).state_dict()
    with pytest.raises(UsageError, match=r"world_size: saved 2, here 3"):
        fast(node, world_size=3).load_state_dict(fast_state)
    with pytest.raises(UsageError, match="FastLoader"):
        fast(node).load_state_dict(state)  # a CachedDataset's state
    with pytest.raises(UsageError, match="not its state_dict"):
        fast(node).load_state_dict({"anything": 1})


def test_state_of_other_workers_is_refused(node: Node) -> None:
    """A main-process state given to DataLoader workers: each worker would read another
    reader's samples. The worker raises, and the DataLoader re-raises it, type intact."""
    ds = dataset(node)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    del it
    again = dataset(node)
    again.load_state_dict(state)
    loader = DataLoader(again, batch_size=BATCH, num_workers=2, timeout=LOADER_TIMEOUT_S)
    it = iter(loader)
    try:
        with pytest.raises(UsageError, match=r"DataLoader workers per rank .*saved 1, here 2") as e:
            next(it)
        # The traceback holds the DataLoader's iterator in a cycle: a later garbage
        # collection would shut its workers down slowly (5 s each). Let go of it now.
        traceback.clear_frames(e.value.__traceback__)
    finally:
        del it


def test_a_part_way_epoch_is_not_silently_skipped(node: Node) -> None:
    ds = dataset(node)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    del it
    again = dataset(node)
    again.load_state_dict(state)
    again.set_epoch(1)
    with pytest.raises(UsageError, match=r"set_epoch\(0\)"):
        iter(again)
    loader = fast(node)
    fast_state = loader.state_dict()  # before any batch: the start of epoch 0
    other = fast(node)
    other.load_state_dict(fast_state)
    other.set_epoch(4)
    with pytest.raises(UsageError, match="part-way through epoch 0"):
        iter(other)


def test_a_finished_epoch_gives_way_to_the_next(node: Node) -> None:
    """A state saved at an epoch's end, then set_epoch(next): the next epoch, whole."""
    loader = fast(node)
    whole = [k for b in loader for k in b.keys]
    state = loader.state_dict()
    again = fast(node)
    again.load_state_dict(state)
    again.set_epoch(1)
    expected = fast(node)
    expected.set_epoch(1)
    assert [k for b in again for k in b.keys] == [k for b in expected for k in b.keys]
    assert whole


# -- the shuffle buffer, resumed anywhere (no daemon) --------------------------------------


class Counted:
    """The items 0..n-1 from ``start`` on, counting how many of all n have been taken."""

    def __init__(self, n: int, start: int = 0) -> None:
        self.n, self.taken = n, start

    def __iter__(self) -> Iterator[int]:
        for x in range(self.taken, self.n):
            self.taken = x + 1
            yield x


def early_after(source: Counted, first: int | None) -> Callable[[], bool] | None:
    """The early start of a reader whose first part has ``first`` items (None: none)."""
    return None if first is None else lambda: source.taken >= first


@pytest.mark.parametrize(
    ("n", "size", "initial", "first"),
    [(300, 100, 10, None), (50, 1000, 100, None), (40, 8, 3, None), (300, 100, 100, 37)],
)
def test_shuffle_buffer_resumes_at_every_item(
    n: int, size: int, initial: int, first: int | None
) -> None:
    """A buffer saved after any item and rebuilt from its state (``first``: it starts early
    when the first part's ``first`` items are in) yields what the uninterrupted one does."""
    source = Counted(n)
    whole = list(
        ShuffleBuffer[int](size, random.Random(3), initial, early=early_after(source, first)).run(
            source
        )
    )
    for k in range(n + 1):
        source = Counted(n)
        buffer = ShuffleBuffer[int](
            size, random.Random(3), initial, early=early_after(source, first)
        )
        run = buffer.run(source)
        head = [next(run) for _ in range(k)]
        rng = random.Random()
        rng.setstate(buffer.rng.getstate())
        rest = Counted(n, source.taken)
        again = ShuffleBuffer(
            size,
            rng,
            initial,
            early=early_after(rest, first),
            buffer=list(buffer.buffer),
            started=buffer.started,
            owed=buffer.owed,
            draining=buffer.draining,
        )
        assert head + list(again.run(rest)) == whole, k
