"""What every system of ``bench/peers.py`` shares: the run's spec, the epoch loop and its
measures (wall time, time to the first batch, samples checked by key, CPU seconds of the
client's process tree and of the daemon, bytes at the link).

The loop is the same for every system: iterate the system's loader for one epoch, take each
batch's samples (a key and the bytes of their members), and do ``compute_s`` of nothing per
batch (0 by default: the input pipeline alone is timed). Every sample of the dataset must
come exactly once per epoch; an epoch that delivers another count, or a key twice, is marked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REGION = "us-east-1"
CLK_TCK = os.sysconf("SC_CLK_TCK")
MSG = "@@"  # a line of the protocol between runner and driver starts with this


@dataclass
class Spec:
    """One run of one system: the store, the dataset in it, the cache limit and the loop."""

    system: str
    mode: str  # "prepare" (the system's conversion) or "epochs"
    endpoint: str  # the shaped store
    bucket: str
    tar_keys: list[str]  # the WebDataset shards in the bucket
    tar_dir: str  # the same shards on local disk (the conversions read them)
    samples: int
    payload_bytes: int  # every member's bytes (.bin and .cls) of every sample
    tar_bytes: int
    shard_bytes: int  # the largest shard
    workdir: str  # this run's (cache directories, the daemon's hot tier)
    capacity: int = 0  # the hot tier's capacity = every limited peer's cache limit
    # Pass ``capacity`` to the system as its cache limit; False: the system's default cache
    # (Mosaic and litdata only; the other systems are always limited or have no cache).
    cache_limit: bool = True
    epochs: int = 2
    batch_size: int = 32
    workers: int = 2
    seed: int = 0
    compute_s: float = 0.0
    timeout_s: float = 600.0

    @property
    def tar_urls(self) -> list[str]:
        return [f"s3://{self.bucket}/{k}" for k in self.tar_keys]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Spec:
        return cls(**json.loads(text))


@dataclass
class Epoch:
    """What one epoch measured."""

    epoch: int  # 1-based
    wall_s: float
    first_batch_s: float
    samples: int
    unique: int  # distinct keys
    payload_bytes: int
    link_bytes: int | None  # bytes the store sent over the link during the epoch
    client_cpu_s: float  # the client's process and its children (DataLoader workers)
    daemon_cpu_s: float | None  # the daemon's process (cached only)
    problem: str = ""  # a wrong count: the row is marked

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0


# -- the protocol with the driver ------------------------------------------------------------


def emit(kind: str, payload: Any) -> None:
    """A message to the driver: one line ``@@<kind> <json>`` on stdout."""
    sys.stdout.write(f"{MSG}{kind} {json.dumps(payload)}\n")
    sys.stdout.flush()


def link_mark() -> int | None:
    """Ask the driver for the link's byte counter now (it answers on stdin); None when not
    run by the driver or it has no counter."""
    if os.environ.get("PEERS_DRIVER") != "1":
        return None
    emit("mark", None)
    line = sys.stdin.readline()
    with contextlib.suppress(ValueError):
        return int(line)
    return None


# -- CPU seconds --------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds including reaped children) of a process, None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    # After the name: state ppid ... utime(14) stime(15) cutime(16) cstime(17), 1-based.
    ticks = sum(int(f) for f in fields[11:15])
    return int(fields[1]), ticks / CLK_TCK


def tree_cpu_s(root: int, exclude: Iterable[int] = ()) -> float:
    """CPU seconds of ``root`` and its living descendants (each with its reaped children),
    leaving out the subtrees of ``exclude`` (the daemon: measured on its own)."""
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        got = _stat(int(entry.name))
        if got is not None:
            children.setdefault(got[0], []).append(int(entry.name))
            cpu[int(entry.name)] = got[1]
    skip = set(exclude)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid in skip:
            continue
        total += cpu.get(pid, 0.0)
        todo.extend(children.get(pid, []))
    return total


# -- the systems ----------------------------------------------------------------------------------


Item = tuple[str, int]  # a sample: its key and the bytes of its members


@dataclass
class Peer:
    """A system under test. Subclasses set up their loader in :meth:`open` and yield batches
    in :meth:`batches`; :meth:`items` turns a batch into (key, bytes) per sample."""

    spec: Spec
    daemon_pid: int | None = None  # set by systems with a daemon
    extra_env: dict[str, str] = field(default_factory=dict)

    # -- what a subclass provides --

    def prepare(self) -> float:
        """The system's own conversion of the dataset into the store; its seconds (0: none)."""
        return 0.0

    def open(self) -> None:
        """Build the loader (and start what it needs)."""

    def batches(self, epoch: int) -> Iterable[Any]:
        """One epoch of batches (``epoch`` is 0-based)."""
        raise NotImplementedError

    def items(self, batch: Any) -> Iterator[Item]:
        """(key, bytes of its members) of every sample in a batch of sample dicts."""
        for sample in batch:
            yield sample_item(sample)

    def close(self) -> None:
        """Stop workers and daemons."""

    def failure_detail(self) -> str:
        """What helps to understand a failure (a daemon's log), or nothing."""
        return ""

    # -- the loop --

    @property
    def workdir(self) -> Path:
        return Path(self.spec.workdir)

    def run_epoch(self, epoch: int) -> Epoch:
        """One epoch of the loop, measured (``epoch`` is 0-based; the record's is 1-based)."""
        me = os.getpid()
        exclude = [self.daemon_pid] if self.daemon_pid else []
        link0 = link_mark()
        cpu0 = tree_cpu_s(me, exclude)
        d0 = tree_cpu_s(self.daemon_pid) if self.daemon_pid else None
        samples = nbytes = 0
        keys: set[str] = set()
        first = -1.0
        started = time.perf_counter()
        for batch in self.batches(epoch):
            if first < 0:
                first = time.perf_counter() - started
            for key, size in self.items(batch):
                samples += 1
                nbytes += size
                keys.add(key)
            if self.spec.compute_s > 0:
                time.sleep(self.spec.compute_s)
        wall = time.perf_counter() - started
        cpu1 = tree_cpu_s(me, exclude)
        d1 = tree_cpu_s(self.daemon_pid) if self.daemon_pid else None
        link1 = link_mark()
        problem = ""
        if samples != self.spec.samples or len(keys) != self.spec.samples:
            problem = f"{samples} samples ({len(keys)} distinct), expected {self.spec.samples}"
        elif nbytes != self.spec.payload_bytes:
            problem = f"{nbytes} payload bytes, expected {self.spec.payload_bytes}"
        return Epoch(
            epoch=epoch + 1,
            wall_s=wall,
            first_batch_s=first,
            samples=samples,
            unique=len(keys),
            payload_bytes=nbytes,
            link_bytes=None if link0 is None or link1 is None else link1 - link0,
            client_cpu_s=cpu1 - cpu0,
            daemon_cpu_s=None if d0 is None or d1 is None else d1 - d0,
            problem=problem,
        )


def sample_item(sample: dict[str, Any]) -> Item:
    """A sample dict's key (``__key__``, else ``key``) and the bytes of its members."""
    key = sample.get("__key__", sample.get("key"))
    size = 0
    for name, value in sample.items():
        if name.startswith("__") or name == "key":
            continue
        if isinstance(value, bytes | bytearray | memoryview):
            size += len(value)
        elif isinstance(value, str):
            size += len(value.encode())
    return str(key), size


def data_loader(dataset: Any, spec: Spec) -> Any:
    """The loop's DataLoader, the same for every system that uses one: ``spec.workers``
    persistent workers, batches of ``spec.batch_size`` samples as lists (no collation)."""
    from torch.utils.data import DataLoader

    return DataLoader(
        dataset,
        batch_size=spec.batch_size,
        num_workers=spec.workers,
        persistent_workers=spec.workers > 0,
        collate_fn=list,
    )


def shutdown_workers(loader: Any) -> None:
    """Stop a DataLoader's (persistent) workers now, in this process."""
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()
    with contextlib.suppress(AttributeError):
        loader._iterator = None


def aws_env(endpoint: str) -> dict[str, str]:
    """Credentials and region for every client (moto accepts any), and the endpoint for the
    libraries that read it from the environment."""
    return {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
        "AWS_ENDPOINT_URL": endpoint,
        "S3_ENDPOINT_URL": endpoint,  # Mosaic Streaming reads this one
    }


def s3_client(endpoint: str) -> Any:
    """A boto3 client for the store (path-style addressing, as moto wants)."""
    import importlib

    boto3: Any = importlib.import_module("boto3")
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id="bench",
        aws_secret_access_key="bench",
        config=Config(s3={"addressing_style": "path"}),
    )


def loader_batches(loader: Iterable[Any]) -> Iterator[Any]:
    """The batches of a DataLoader for one epoch."""
    yield from loader
