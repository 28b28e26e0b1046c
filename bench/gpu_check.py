"""GPU check for a GPU node: byte-exact batches on the GPU under a slow consumer, and
what the host-to-device path costs. ``make gpu-check``; at most ~3 minutes on one GPU.

Against a real ``cached serve`` (``file://`` shards, hot tier warmed by ``cached
prefetch``) it runs:

  correctness   every element of every batch is compared, on the GPU, with bytes built
                there from the sample's key (shard, index) by a fixed formula; the
                compute stream is slowed by ``torch.cuda._sleep`` before each comparison
                (or copy), so the loader runs ahead and reuses its ring slots and device
                memory while the GPU still has work queued on earlier batches:
                  - ``FastLoader(device="cuda:K")``
                  - ``DeviceLoader(FastLoader(device=None), "cuda:K")``
                  - host mode ``FastLoader(device=None, pin_memory=True)``, the user copying
                    with ``batch.view(...).to("cuda", non_blocking=True)`` and with
                    ``batch.to("cuda")`` (checks that the loader guards reused slots
                    with events)
                With two GPUs, K runs over 0 and 1 while the current device stays 0.
  daemon metrics  the daemon's /metrics has NVML's series for every GPU
                (``cached_gpu_*``), and the GPU loops' job reports (``cached_job_*``).
  bandwidth     pinned and pageable host-to-device MB/s; the fraction of copy time hidden
                behind compute (copies on a side stream overlapping ``_sleep`` on the
                compute stream: ``hidden = 1 - (t_overlapped - t_compute) / t_copy``);
                FastLoader's MB/s into GPU memory as a ratio of a raw pinned copy of the
                same bytes in the same batch-sized pieces (the ceiling).

Every sample ``s{shard:05d}-{index:06d}`` holds ``x.u8``, ``--sample-size`` bytes
``(7 * arange(size) + 131 * shard + 17 * index) % 251``, and ``id.i64``, the pair
``(shard, index)`` as int64. The same generator (:func:`expected_x`) writes the shards
and builds the expected bytes, on the CPU or the GPU.

Exit status: 0 when every check passed; 1 on any mismatch or failed check; 2 on bad
arguments. Without CUDA the CPU parts (dataset, daemon, a CPU FastLoader epoch compared
with the generator) still run and then the script prints ``no CUDA: GPU parts skipped``
and exits 0 -- a *skip*, not a pass: ``--require-cuda`` makes it exit 1 instead (use it
on GPU nodes, where a CPU-only torch would otherwise skip silently). ``--dry-run`` runs
only the CPU parts even where CUDA is available.

    python bench/gpu_check.py                 # the full check (GPU node)
    python bench/gpu_check.py --dry-run       # CPU parts only
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common
from cached.config import parse_size
from cached_demo.tars import make_tar

if TYPE_CHECKING:
    from cached_client import Batch

X_EXT = "x.u8"  # the payload member: fixed size, a function of (shard, index)
ID_EXT = "id.i64"  # (shard, index) as two int64
ID_BYTES = 16
MB = common.MB
BUDGET_S = 180.0  # the bound on the whole run

# (x, ids) out of a batch: ``[batch, size]`` uint8 and ``[batch, 2]`` int64, on the device
# the comparison runs on.
Extract = Callable[["Batch"], tuple[torch.Tensor, torch.Tensor]]


# -- arguments ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The options; sizes accept suffixes (``256MiB``). Exits 2 on a bad value."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shards", type=int, default=16, help="shards (default 16)")
    p.add_argument(
        "--samples-per-shard", type=int, default=128, help="samples per shard (default 128)"
    )
    p.add_argument(
        "--sample-size",
        default="100003",
        help="bytes of each x.u8 member (default 100003: odd, so members straddle tar blocks)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=48,
        help="batch size (default 48: batches span shards, the last one is short)",
    )
    p.add_argument("--ring", type=int, default=4, help="FastLoader ring slots (default 4)")
    p.add_argument(
        "--consumer-ms",
        type=float,
        default=10.0,
        help="GPU time the slow consumer sleeps per batch on the compute stream (default 10)",
    )
    p.add_argument(
        "--bandwidth-size",
        default="256MiB",
        help="buffer size of the host-to-device measures (default 256MiB)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per measure (default 3)")
    p.add_argument("--dry-run", action="store_true", help="CPU parts only, even with CUDA")
    p.add_argument("--require-cuda", action="store_true", help="exit 1 (not 0) when CUDA is absent")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = p.parse_args(argv)
    try:
        args.sample_size = parse_size(args.sample_size)
        args.bandwidth_size = parse_size(args.bandwidth_size)
    except ValueError as exc:
        p.error(str(exc))
    for name in ("shards", "samples_per_shard", "sample_size", "batch_size", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.ring < 2:
        p.error("--ring must be at least 2")
    if args.consumer_ms < 0 or args.bandwidth_size < 1:
        p.error("--consumer-ms must be >= 0 and --bandwidth-size positive")
    return args


# -- the dataset and its expected bytes --------------------------------------------------------


@dataclass(frozen=True)
class DataSpec:
    """The synthetic dataset's shape."""

    shards: int
    per_shard: int
    sample_size: int

    @property
    def samples(self) -> int:
        return self.shards * self.per_shard

    @property
    def payload_bytes(self) -> int:
        return self.samples * (self.sample_size + ID_BYTES)

    def keys(self) -> set[str]:
        """Every sample's key."""
        return {sample_key(s, i) for s in range(self.shards) for i in range(self.per_shard)}


def sample_key(shard: int, index: int) -> str:
    """The key of sample ``index`` of ``shard``."""
    return f"s{shard:05d}-{index:06d}"


def parse_key(key: str) -> tuple[int, int]:
    """``(shard, index)`` from a key of :func:`sample_key`; ValueError for anything else."""
    shard, sep, index = key[1:].partition("-")
    if not (key.startswith("s") and sep and shard.isdigit() and index.isdigit()):
        raise ValueError(f"not a gpu-check sample key: {key!r}")
    return int(shard), int(index)


def key_ids(keys: Sequence[str], device: torch.device) -> torch.Tensor:
    """``[len(keys), 2]`` int64 of (shard, index) on ``device``. The copy to a GPU is
    non-blocking from pinned memory, so a host loop stays ahead of a slowed stream."""
    ids = torch.tensor([parse_key(k) for k in keys], dtype=torch.int64).reshape(-1, 2)
    if device.type == "cuda":
        return ids.pin_memory().to(device, non_blocking=True)
    return ids.to(device)


def expected_x(ids: torch.Tensor, size: int) -> torch.Tensor:
    """The ``x.u8`` bytes of the samples ``ids`` (``[n, 2]`` int64 of shard, index), built
    on ``ids.device``: ``[n, size]`` uint8, ``(7 * j + 131 * shard + 17 * index) % 251``."""
    col = torch.arange(size, dtype=torch.int64, device=ids.device) * 7
    base = ids[:, 0:1] * 131 + ids[:, 1:2] * 17
    return ((col.unsqueeze(0) + base) % 251).to(torch.uint8)


@dataclass(frozen=True)
class Dataset:
    """The shards on disk."""

    spec: DataSpec
    paths: list[Path]

    @property
    def urls(self) -> list[str]:
        """``file://`` URLs the daemon serves directly."""
        return [p.resolve().as_uri() for p in self.paths]

    @property
    def tar_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.paths)


def write_dataset(directory: Path, spec: DataSpec) -> Dataset:
    """Write the shards with :func:`cached_demo.tars.make_tar`, bytes from :func:`expected_x`."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in range(spec.shards):
        ids = torch.tensor([(shard, i) for i in range(spec.per_shard)], dtype=torch.int64).reshape(
            -1, 2
        )
        xs = expected_x(ids, spec.sample_size).numpy()
        id_bytes = ids.numpy()
        samples = (
            (sample_key(shard, i), {X_EXT: xs[i].tobytes(), ID_EXT: id_bytes[i].tobytes()})
            for i in range(spec.per_shard)
        )
        path = directory / f"shard-{shard:05d}.tar"
        path.write_bytes(make_tar(samples))
        paths.append(path)
    return Dataset(spec, paths)


@contextmanager
def serve(work: Path, dataset: Dataset) -> Iterator[common.Daemon]:
    """``cached serve`` on an ipc socket in ``work``, its hot tier warmed with the shards."""
    capacity = dataset.tar_bytes * 5 // 4 + (64 << 20)
    socket = f"ipc://{work}/cached.sock"
    with common.Daemon(work / "daemon", socket, work / "hot", capacity) as daemon:
        daemon.prefetch(dataset.urls)
        yield daemon


# -- the comparison ----------------------------------------------------------------------------


@dataclass
class CheckResult:
    """One check: what it saw, and what was wrong (``problems`` or ``mismatches``)."""

    name: str
    device: str
    batches: int = 0
    samples: int = 0
    mismatches: int = 0  # elements of x.u8 and id.i64 that differ from the expected
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and self.mismatches == 0


class Tally:
    """Compares batches with the generator on ``device`` without synchronising: the
    counts stay on the device until :meth:`finish`."""

    def __init__(self, spec: DataSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device
        self.per_batch: list[torch.Tensor] = []
        self.first_keys: list[str] = []
        self.keys: Counter[str] = Counter()
        self.problems: list[str] = []

    def add(self, keys: Sequence[str], x: torch.Tensor, ids: torch.Tensor) -> None:
        """Queue the comparison of one batch: ``x`` ``[n, size]`` uint8 and ``ids``
        ``[n, 2]`` int64 against the expected bytes of ``keys``."""
        n = len(keys)
        self.keys.update(keys)
        self.first_keys.append(keys[0] if keys else "")
        for name, t, shape in (
            (X_EXT, x, (n, self.spec.sample_size)),
            (ID_EXT, ids, (n, 2)),
        ):
            if t.device != self.device or tuple(t.shape) != shape:
                self.problems.append(
                    f"batch {len(self.per_batch)}: {name} is {tuple(t.shape)} on {t.device}, "
                    f"expected {shape} on {self.device}"
                )
                self.per_batch.append(torch.zeros((), dtype=torch.int64, device=self.device))
                return
        want = key_ids(keys, self.device)
        bad = (x != expected_x(want, self.spec.sample_size)).sum() + (ids != want).sum()
        self.per_batch.append(bad)

    def finish(self, result: CheckResult) -> CheckResult:
        """Wait for the comparisons; fill in ``result`` (counts, coverage, problems)."""
        counts = torch.stack(self.per_batch).tolist() if self.per_batch else []
        result.batches = len(counts)
        result.samples = sum(self.keys.values())
        result.mismatches = int(sum(counts))
        bad = [i for i, c in enumerate(counts) if c]
        if bad:
            shown = ", ".join(f"#{i} (from {self.first_keys[i]}): {counts[i]}" for i in bad[:3])
            result.problems.append(f"{len(bad)} batches differ: {shown}")
        result.problems.extend(self.problems[:3])
        want = self.spec.keys()
        missing = len(want - self.keys.keys())
        extra = len(self.keys.keys() - want)
        repeated = sum(c - 1 for c in self.keys.values() if c > 1)
        if missing or extra or repeated:
            result.problems.append(
                f"samples: {missing} missing, {extra} unexpected, {repeated} repeated"
            )
        return result


def verify_epoch(
    name: str,
    batches: Iterable[Batch],
    spec: DataSpec,
    device: torch.device,
    extract: Extract,
    *,
    sleep_cycles: int = 0,
) -> CheckResult:
    """One epoch of ``batches``: per batch, ``sleep_cycles`` of ``_sleep`` on ``device``'s
    compute stream, then ``extract`` (a copy, or views of device tensors) and the
    comparison. Exceptions become the result's problems."""
    result = CheckResult(name, str(device))
    tally = Tally(spec, device)
    started = time.perf_counter()
    try:
        for batch in batches:
            if sleep_cycles:
                slow_down(device, sleep_cycles)
            x, ids = extract(batch)
            tally.add(batch.keys, x, ids)
        tally.finish(result)
    except Exception as exc:
        result.problems.append(f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    result.seconds = time.perf_counter() - started
    return result


def views(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's members as ``[n, size]`` uint8 and ``[n, 2]`` int64, where they are."""
    return batch.view(X_EXT, torch.uint8), batch.view(ID_EXT, torch.int64, (2,))


class HostCopy:
    """Host mode: the user copies each host batch to ``device`` -- the views with
    ``.to(device, non_blocking=True)``, or (``whole``) the batch with ``batch.to(device)``.
    Counts the batches whose host tensors were not pinned (``pin_memory=True`` asked)."""

    def __init__(self, device: str, whole: bool) -> None:
        self.device = device
        self.whole = whole
        self.unpinned = 0

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        if not all(t.is_pinned() for t in batch.data.values()):
            self.unpinned += 1
        if self.whole:
            return views(batch.to(self.device))
        x, ids = views(batch)
        return x.to(self.device, non_blocking=True), ids.to(self.device, non_blocking=True)


# -- the checks --------------------------------------------------------------------------------


def cpu_checks(dataset: Dataset, socket: str, batch_size: int, ring: int) -> list[CheckResult]:
    """What runs everywhere: a host FastLoader epoch matches the generator byte for byte;
    without CUDA, ``FastLoader(device="cuda")`` raises ``DeviceUnavailable``."""
    from cached_client import FastLoader

    loader = FastLoader(dataset.urls, batch_size=batch_size, ring=ring, socket=socket)
    cpu = torch.device("cpu")
    results = [verify_epoch("fast host (cpu)", loader, dataset.spec, cpu, views)]
    # A device that is not there: "cuda" without CUDA, else one past the last GPU.
    missing = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    results.append(check_device_unavailable(dataset, socket, missing))
    return results


def check_device_unavailable(dataset: Dataset, socket: str, device: str) -> CheckResult:
    """``FastLoader(device=...)`` of a device that does not exist here must raise
    ``DeviceUnavailable`` at construction."""
    from cached_client import DeviceUnavailable, FastLoader

    result = CheckResult(f'FastLoader(device="{device}") refused', "cpu")
    try:
        FastLoader(dataset.urls, batch_size=1, socket=socket, device=device)
    except DeviceUnavailable:
        return result
    except Exception as exc:
        result.problems.append(f"raised {type(exc).__name__}, not DeviceUnavailable: {exc}")
        return result
    result.problems.append(f"constructed with no {device} here; expected DeviceUnavailable")
    return result


def gpu_devices() -> list[torch.device]:
    """``cuda:0``, and ``cuda:1`` when there are two GPUs; the current device is set to 0."""
    torch.cuda.set_device(0)
    return [torch.device("cuda", i) for i in range(min(2, torch.cuda.device_count()))]


def gpu_checks(
    dataset: Dataset, socket: str, batch_size: int, ring: int, consumer_ms: float
) -> list[CheckResult]:
    """The slow-consumer epochs, compared on the GPU (see the module's docstring)."""
    from cached_client import DeviceLoader, FastLoader

    spec, urls = dataset.spec, dataset.urls
    results = []
    devices = gpu_devices()
    cycles = {dev: round(consumer_ms * sleep_cycles_per_ms(dev)) for dev in devices}
    for dev in devices:
        fast = FastLoader(urls, batch_size=batch_size, ring=ring, socket=socket, device=str(dev))
        results.append(
            verify_epoch(f"fast device={dev}", fast, spec, dev, views, sleep_cycles=cycles[dev])
        )
        host = FastLoader(urls, batch_size=batch_size, ring=ring, socket=socket, pin_memory=True)
        wrapped = DeviceLoader(host, str(dev))
        results.append(
            verify_epoch(
                f"DeviceLoader -> {dev}", wrapped, spec, dev, views, sleep_cycles=cycles[dev]
            )
        )
    current = torch.device("cuda", torch.cuda.current_device())
    host_modes = [
        ('view().to("cuda", non_blocking)', "cuda", False),
        ('batch.to("cuda")', "cuda", True),
    ]
    if len(devices) > 1:  # a copy to another device than the current one: guarded too
        host_modes.append((f'view().to("{devices[1]}", non_blocking)', str(devices[1]), False))
    for label, target, whole in host_modes:
        dev = torch.device(target) if target != "cuda" else current
        copy = HostCopy(target, whole=whole)
        host = FastLoader(urls, batch_size=batch_size, ring=ring, socket=socket, pin_memory=True)
        result = verify_epoch(
            f"host pinned, {label}", host, spec, dev, copy, sleep_cycles=cycles[dev]
        )
        if copy.unpinned:
            result.problems.append(f"pin_memory=True: {copy.unpinned} batches not pinned")
        results.append(result)
    return results


def check_daemon_metrics(daemon: common.Daemon) -> CheckResult:
    """The daemon's view of this node's GPUs (NVML) and of the GPU loops above (their
    reports): a series per GPU, and the job's batches and wait counted."""
    from prometheus_client.parser import text_string_to_metric_families

    result = CheckResult("daemon metrics: GPUs, job wait", "cuda")
    started = time.perf_counter()
    time.sleep(2.5)  # the reporters' interval: the last epoch's totals are in
    with urllib.request.urlopen(f"{daemon.status()['http']}/metrics", timeout=10) as r:
        text = r.read().decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    by_gpu = {
        s.labels["gpu"]: s.value for s in samples if s.name == "cached_gpu_memory_total_bytes"
    }
    utilization = [s for s in samples if s.name == "cached_gpu_utilization_ratio"]
    for i in range(torch.cuda.device_count()):
        if by_gpu.get(str(i), 0) <= 0:
            result.problems.append(f"no cached_gpu_memory_total_bytes for GPU {i} (NVML?)")
    if len(utilization) != torch.cuda.device_count():
        result.problems.append(f"{len(utilization)} cached_gpu_utilization_ratio series")
    batches = sum(s.value for s in samples if s.name == "cached_job_batches_total")
    if batches <= 0:
        result.problems.append("no cached_job_batches_total: the GPU loops' reports are missing")
    result.batches = int(batches)
    result.seconds = time.perf_counter() - started
    return result


# -- bandwidth ---------------------------------------------------------------------------------


def slow_down(device: torch.device, cycles: int) -> None:
    """Queue ``cycles`` GPU clock cycles of sleep on ``device``'s current stream."""
    with torch.cuda.device(device):
        torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]


def stream_ms(stream: torch.cuda.Stream, work: Callable[[], object]) -> float:
    """GPU milliseconds ``work`` takes on ``stream`` (events around it)."""
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        start.record(stream)
        work()
        end.record(stream)
    end.synchronize()
    ms: float = start.elapsed_time(end)
    return ms


def sleep_cycles_per_ms(device: torch.device) -> float:
    """How many ``_sleep`` cycles one millisecond of GPU time is on ``device``."""
    stream = torch.cuda.current_stream(device)
    cycles = 2_000_000
    slow_down(device, 1000)  # first launch: module load
    ms = min(stream_ms(stream, lambda: slow_down(device, cycles)) for _ in range(3))
    return cycles / max(ms, 1e-3)


def h2d_mb_per_s(device: torch.device, nbytes: int, pinned: bool, repeats: int) -> float:
    """Host-to-device MB/s of one ``nbytes`` copy, best of ``repeats`` (wall clock)."""
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned)  # pages touched
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = math.inf
    for _ in range(repeats + 1):  # the first is a warm-up
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=pinned)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / MB


@dataclass(frozen=True)
class Overlap:
    """Copy on a side stream against ``_sleep`` of the same length on the compute stream."""

    copy_ms: float
    compute_ms: float
    overlapped_ms: float

    @property
    def hidden(self) -> float:
        """Share of the copy time hidden behind compute, in [0, 1]."""
        if self.copy_ms <= 0:
            return 0.0
        return min(1.0, max(0.0, 1 - (self.overlapped_ms - self.compute_ms) / self.copy_ms))


def overlap(device: torch.device, nbytes: int, pinned: bool, repeats: int) -> Overlap:
    """Time the copy alone, the compute alone (sleep as long as the copy), then both at
    once; best of ``repeats`` each."""
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    main = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def copy() -> None:
        dst.copy_(src, non_blocking=True)

    copy()
    copy_ms = min(stream_ms(side, copy) for _ in range(repeats))
    cycles = round(copy_ms * sleep_cycles_per_ms(device))
    compute_ms = min(stream_ms(main, lambda: slow_down(device, cycles)) for _ in range(repeats))

    def both() -> None:
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(main)
        side.wait_event(ready)
        slow_down(device, cycles)  # compute stream
        with torch.cuda.stream(side):
            copy()
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(side)
        main.wait_event(done)

    overlapped_ms = min(stream_ms(main, both) for _ in range(repeats))
    return Overlap(copy_ms, compute_ms, overlapped_ms)


def loader_mb_per_s(
    dataset: Dataset, socket: str, device: torch.device, *, batch_size: int, ring: int, repeats: int
) -> float:
    """FastLoader epochs straight into GPU memory: payload MB/s, best of ``repeats``
    after a warm-up epoch; each epoch ends when the last copy has landed."""
    from cached_client import FastLoader

    loader = FastLoader(
        dataset.urls, batch_size=batch_size, ring=ring, socket=socket, device=str(device)
    )
    best = math.inf
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        nbytes = sum(t.numel() for batch in loader for t in batch.data.values())
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
        if nbytes != dataset.spec.payload_bytes:
            raise RuntimeError(f"an epoch gave {nbytes} bytes, not {dataset.spec.payload_bytes}")
    return dataset.spec.payload_bytes / best / MB


def pinned_ceiling_mb_per_s(device: torch.device, total: int, piece: int, repeats: int) -> float:
    """A raw pinned copy of ``total`` bytes in ``piece``-byte copies (a loader's batches),
    back to back: the most a loader can deliver to this GPU. MB/s, best of ``repeats``."""
    src = torch.ones(piece, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(piece, dtype=torch.uint8, device=device)
    sizes = [piece] * (total // piece) + ([total % piece] if total % piece else [])
    best = math.inf
    for _ in range(repeats + 1):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for n in sizes:
            dst[:n].copy_(src[:n], non_blocking=True)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return total / best / MB


def bandwidth(dataset: Dataset, socket: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    """The bandwidth measures as (label, value) rows, on the last GPU of :func:`gpu_devices`."""
    dev = gpu_devices()[-1]
    size, reps = args.bandwidth_size, args.repeats
    pinned = h2d_mb_per_s(dev, size, True, reps)
    pageable = h2d_mb_per_s(dev, size, False, reps)
    ov_pinned = overlap(dev, size, True, reps)
    ov_pageable = overlap(dev, size, False, reps)
    fast = loader_mb_per_s(
        dataset, socket, dev, batch_size=args.batch_size, ring=args.ring, repeats=reps
    )
    piece = args.batch_size * (dataset.spec.sample_size + ID_BYTES)
    ceiling = pinned_ceiling_mb_per_s(dev, dataset.spec.payload_bytes, piece, reps)

    def hidden(o: Overlap) -> str:
        return (
            f"{o.hidden:.2f} (copy {o.copy_ms:.1f} ms, compute {o.compute_ms:.1f} ms, "
            f"both {o.overlapped_ms:.1f} ms)"
        )

    at = f"{common.human(size)} to {dev}"
    return [
        (f"H2D pinned, {at}", f"{pinned:,.0f} MB/s"),
        (f"H2D pageable, {at}", f"{pageable:,.0f} MB/s ({pinned / pageable:.1f}x slower)"),
        ("copy hidden behind compute, pinned", hidden(ov_pinned)),
        ("copy hidden behind compute, pageable", hidden(ov_pageable)),
        (f"FastLoader -> {dev}", f"{fast:,.0f} MB/s"),
        (f"pinned copy ceiling ({common.human(piece)} pieces)", f"{ceiling:,.0f} MB/s"),
        ("FastLoader / ceiling", f"{fast / ceiling:.3f}"),
    ]


# -- the table and the run ---------------------------------------------------------------------


def check_table(results: Sequence[CheckResult]) -> str:
    """The correctness checks, one line each, then each failure's problems."""
    head = (
        f"{'check':<44} {'device':<7} {'batches':>7} {'samples':>8} {'mismatch':>9}"
        f" {'time':>7}  result"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.name:<44} {r.device:<7} {r.batches:>7} {r.samples:>8} {r.mismatches:>9}"
            f" {r.seconds:>6.2f}s  {'ok' if r.ok else 'FAIL'}"
        )
    for r in results:
        lines.extend(f"  {r.name}: {p}" for p in r.problems)
    return "\n".join(lines)


def value_table(rows: Sequence[tuple[str, str]]) -> str:
    """Label and value columns."""
    width = max((len(label) for label, _ in rows), default=0)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the checks; the exit status is described in the module's docstring."""
    args = parse_args(argv)
    started = time.perf_counter()
    log = common.log
    cuda = torch.cuda.is_available()
    gpu = cuda and not args.dry_run
    log("cached GPU check")
    log(common.machine_line(common.machine()))
    if cuda:
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        log(f"GPUs: {', '.join(names)}")
    spec = DataSpec(args.shards, args.samples_per_shard, args.sample_size)
    rows: list[tuple[str, str]] = []
    with common.workdir("cached-gpu-check-", keep=args.keep) as work:
        dataset = write_dataset(work / "shards", spec)
        log(
            f"{spec.samples:,} samples in {spec.shards} shards, "
            f"{common.human(spec.payload_bytes)} payload; batches of {args.batch_size}, "
            f"ring {args.ring}"
        )
        with serve(work, dataset) as daemon:
            results = cpu_checks(dataset, daemon.socket, args.batch_size, args.ring)
            if gpu:
                results += gpu_checks(
                    dataset, daemon.socket, args.batch_size, args.ring, args.consumer_ms
                )
                results.append(check_daemon_metrics(daemon))
                try:
                    rows = bandwidth(dataset, daemon.socket, args)
                except Exception as exc:  # still print the correctness table
                    traceback.print_exc()
                    failure = CheckResult("bandwidth measures", "cuda")
                    failure.problems.append(f"{type(exc).__name__}: {exc}")
                    results.append(failure)
    log(f"\ncorrectness (slow consumer: {args.consumer_ms:g} ms of GPU sleep per batch)")
    log(check_table(results))
    if rows:
        log(f"\nbandwidth\n{value_table(rows)}")
    elapsed = time.perf_counter() - started
    log(
        f"\n{elapsed:.0f}s in all"
        + (f" (over the {BUDGET_S:.0f}s budget)" if elapsed > BUDGET_S else "")
    )
    failed = [r.name for r in results if not r.ok]
    if failed:
        log(f"FAILED: {', '.join(failed)}")
        return 1
    if not cuda:
        log(
            "no CUDA: GPU parts skipped"
            + (" (--require-cuda: failing)" if args.require_cuda else "")
        )
        return 1 if args.require_cuda else 0
    if args.dry_run:
        log("--dry-run: GPU parts skipped")
    else:
        log("all checks passed")
    return 0


if __name__ == "__main__":
    common.exit_on_sigterm()
    sys.exit(main())
