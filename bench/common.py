"""Shared helpers of the benchmarks: synthetic shards, a `cached serve` subprocess, timing,
tables, the machine's description and the JSON record.

Run the benchmarks as scripts (``python bench/serve.py``); they put the repository root on
``sys.path`` themselves, so ``bench.common`` imports either way.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import json
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cached.config import parse_size
from cached_demo.stack import DaemonProcess, write_config

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "bench" / "out"
MB = 1_000_000  # MB/s in the tables are 10^6 bytes of sample payload per second


# -- sizes --------------------------------------------------------------------------------------


def parse_sizes(values: Sequence[str]) -> list[int]:
    """Sizes from repeated flags, each possibly a comma-separated list."""
    return [parse_size(part) for v in values for part in v.split(",") if part.strip()]


def parse_ints(values: Sequence[str]) -> list[int]:
    """Integers from repeated flags, each possibly a comma-separated list."""
    return [int(part) for v in values for part in v.split(",") if part.strip()]


def human(n: float) -> str:
    """Bytes for humans: ``102400 -> '100.0 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# -- the machine ----------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """Where the figures come from: CPU, cores, memory, kernel, library versions."""
    model = platform.processor() or "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = 0
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
                break
    info: dict[str, Any] = {
        "cpu_model": model,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "memory_bytes": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_at_start": loadavg(),
    }
    for name in ("torch", "zmq", "webdataset", "numpy"):
        with contextlib.suppress(Exception):
            info[name] = __import__(name).__version__
    with contextlib.suppress(Exception):
        import zmq

        info["libzmq"] = zmq.zmq_version()
    with contextlib.suppress(Exception):
        from cached_client.device import pinned_memory_available

        info["pinned_memory"] = pinned_memory_available()
    return info


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages (other tenants of a shared machine show here)."""
    return [round(x, 2) for x in os.getloadavg()]


def machine_line(info: dict[str, Any]) -> str:
    """One header line describing the machine."""
    return (
        f"machine: {info['cpu_model']}, {info['cores']} cores "
        f"({info['cores_usable']} usable), {human(info['memory_bytes'])} RAM, "
        f"Linux {info['kernel']}; python {info['python']}, torch {info.get('torch', '?')}, "
        f"pyzmq {info.get('zmq', '?')} (libzmq {info.get('libzmq', '?')}), "
        f"webdataset {info.get('webdataset', '?')}, "
        f"pinned memory {'yes' if info.get('pinned_memory') else 'no'}; "
        f"load average {' '.join(str(x) for x in info['loadavg_at_start'])}"
    )


# -- shards ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardSet:
    """WebDataset tar shards on local disk: every sample is ``<key>.bin`` of
    ``sample_size`` random bytes and ``<key>.cls``, a short decimal label."""

    dir: Path
    paths: list[Path]
    sample_size: int
    samples: int
    payload_bytes: int  # sum of every member's bytes (what the readers count)
    tar_bytes: int

    @property
    def urls(self) -> list[str]:
        """``file://`` URLs of the shards."""
        return [p.resolve().as_uri() for p in self.paths]


_TAR_RECORD = 10240  # tarfile pads archives to whole records of this size


def _tar_header(name: bytes, size: int, templates: dict[int, bytes]) -> bytes:
    """The GNU tar header ``tarfile`` writes for a regular file ``name`` of ``size`` bytes
    (mode 0644, uid/gid 0, mtime 0), built from a template: ~10x faster than ``addfile``."""
    template = templates.get(len(name))
    if template is None:
        info = tarfile.TarInfo("x" * len(name))
        info.mtime = 0
        template = info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")
        templates[len(name)] = template
    h = bytearray(template)
    h[0 : len(name)] = name
    h[124:136] = b"%011o\0" % size
    h[148:156] = b"        "
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def tar_bytes_bound(shards: int, samples: int, sample_size: int) -> int:
    """An upper bound on the tar bytes :func:`write_shards` writes (to size a hot tier)."""
    per_sample = 3 * 512 + -(-sample_size // 512) * 512  # two headers, data, a short .cls
    return samples * per_sample + shards * (_TAR_RECORD + 1024)


def write_shards(directory: Path, shards: int, samples: int, sample_size: int) -> ShardSet:
    """Write ``samples`` samples of ``sample_size`` bytes spread evenly over ``shards`` tars.

    The files are byte for byte what ``tarfile`` (GNU format) writes for the same members,
    written without it for speed (hundreds of thousands of small members).
    """
    directory.mkdir(parents=True, exist_ok=True)
    samples = max(shards, samples)
    need, free = tar_bytes_bound(shards, samples, sample_size), shutil.disk_usage(directory).free
    if need + (1 << 30) > free:  # leave the file system (shared with others) 1 GiB
        raise RuntimeError(
            f"{samples} samples of {sample_size} bytes need {human(need)} in {directory}, "
            f"which has {human(free)} free"
        )
    rng = random.Random(sample_size)
    pool = rng.randbytes(sample_size + 4096)  # incompressible; slices differ per sample
    templates: dict[int, bytes] = {}
    zeros = bytes(512)
    paths, payload, tar_bytes, done = [], 0, 0, 0
    for s in range(shards):
        n = samples // shards + (1 if s < samples % shards else 0)
        path = directory / f"shard-{s:06d}.tar"
        with open(path, "wb") as fh:
            for i in range(n):
                key = b"s%06d-%07d" % (s, i)
                at = (done + i) % 4096
                for ext, data in (
                    (b"bin", pool[at : at + sample_size]),
                    (b"cls", b"%d" % ((done + i) % 1000)),
                ):
                    fh.write(_tar_header(key + b"." + ext, len(data), templates))
                    fh.write(data)
                    fh.write(zeros[: -len(data) % 512])
                    payload += len(data)
            fh.write(bytes(1024))  # end-of-archive marker
            fh.write(bytes(-fh.tell() % _TAR_RECORD))
            tar_bytes += fh.tell()
        done += n
        paths.append(path)
    return ShardSet(directory, paths, sample_size, samples, payload, tar_bytes)


def read_files(paths: Sequence[Path], buffer_size: int = 8 << 20) -> int:
    """Read every file once into one reused buffer (fills the page cache); returns bytes."""
    buf = bytearray(buffer_size)
    view = memoryview(buf)
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as fh:
            while n := fh.readinto(view):
                total += n
    return total


# -- the daemon -----------------------------------------------------------------------------


def free_tcp_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def s3_daemon(
    run: Path,
    endpoint: str,
    capacity: str,
    *,
    s3: dict[str, Any] | None = None,
    prefetch: dict[str, Any] | None = None,
    server: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> DaemonProcess:
    """A daemon (not started) in the fresh directory ``run``: its socket, config and hot
    tier there, reading ``endpoint``; ``s3``, ``prefetch``, ``server``: more of those
    sections."""
    run.mkdir(parents=True)
    socket = f"ipc://{run}/cached.sock"
    config = write_config(
        run / "config.toml",
        {
            "server": {"socket": socket, "http": "127.0.0.1:0", **(server or {})},
            "cache": {"dir": str(run / "hot"), "capacity": capacity, "min_free": 0},
            "s3": {"endpoint_url": endpoint, **(s3 or {})},
            "prefetch": prefetch or {},
        },
    )
    return DaemonProcess(config, socket, env=env)


def process_cpu(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of process ``pid`` so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks


def processes_cpu(pids: Iterable[int]) -> float:
    """User and system CPU seconds of the processes ``pids`` so far, together (one that
    has exited counts nothing)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            total += sum(process_cpu(pid))
    return total


class Daemon(DaemonProcess):
    """``cached serve`` for a benchmark: its config, log and hot tier in ``workdir``."""

    def __init__(
        self, workdir: Path, socket: str, cache_dir: Path, capacity: int, name: str = "daemon"
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        config = write_config(
            workdir / f"{name}.toml",
            {
                # The benchmarks' shards are local files: file:// is not allowed by default.
                "server": {"socket": socket, "http": "127.0.0.1:0", "allow": ["s3://", "file:///"]},
                "cache": {"dir": str(cache_dir), "capacity": capacity, "min_free": 0},
            },
        )
        super().__init__(config, socket, log=workdir / f"{name}.log")

    def __exit__(self, *exc: object) -> None:
        self.stop()
        exc_type = exc[0] if exc else None
        if isinstance(exc_type, type) and not issubclass(exc_type, KeyboardInterrupt | SystemExit):
            print(f"--- end of {self.log}:\n{self.log_tail()}", file=sys.stderr)

    def cpu_s(self) -> float:
        """User + system CPU seconds the daemon process has used so far."""
        assert self.proc is not None
        return sum(process_cpu(self.proc.pid))

    def prefetch(self, urls: Sequence[str]) -> float:
        """``cached prefetch URL...`` into this daemon's hot tier; returns seconds taken."""
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "cached", "prefetch", "--config", str(self.config), *urls],
            env=self.env,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"cached prefetch failed ({done.returncode}):\n{done.stderr[-4000:]}"
            )
        return time.perf_counter() - started


# -- timing ---------------------------------------------------------------------------------

Pass = Callable[[], tuple[int, int]]  # one full pass over the data: (samples, bytes)


def metered(daemon: Daemon, cpu: list[float], one_pass: Pass) -> tuple[int, int]:
    """One pass, adding the daemon's CPU seconds for it to ``cpu``."""
    before = daemon.cpu_s()
    got = one_pass()
    cpu.append(daemon.cpu_s() - before)
    return got


@dataclass
class Result:
    """Repeated timings of one configuration over one shard set."""

    config: str
    group: str  # "raw", "webdataset", "cached", "fast"
    samples: int
    bytes: int
    runs_s: list[float]
    workers: int | None = None
    note: str = ""
    ratio: float | None = None  # samples/s against the baseline of its table

    @property
    def median_s(self) -> float:
        return statistics.median(self.runs_s)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.median_s

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.median_s / MB

    def record(self) -> dict[str, Any]:
        """A JSON-able record."""
        out = asdict(self)
        out.update(median_s=self.median_s, samples_per_s=self.samples_per_s, mb_per_s=self.mb_per_s)
        return out


@dataclass
class Spec:
    """One configuration to time: a full pass over the data, returning (samples, bytes)."""

    config: str
    group: str
    one_pass: Pass
    warmup: bool = True  # one untimed pass first (worker start-up, connections, buffers)
    workers: int | None = None
    note: str = ""


def measure_all(
    specs: Sequence[Spec],
    *,
    repeats: int,
    expect: tuple[int, int],
    log: Callable[[str], None] = print,
) -> list[Result]:
    """Time ``repeats`` full passes of every configuration, interleaved round-robin (all
    configurations once, then again...), so load from other tenants of a shared machine
    spreads over all of them instead of skewing one. Warm-up passes come first. Every pass
    must deliver exactly ``expect`` = (samples, bytes)."""
    for spec in specs:
        if spec.warmup:
            _check(spec.config, spec.one_pass(), expect)
    runs: list[list[float]] = [[] for _ in specs]
    for _ in range(repeats):
        for spec, secs in zip(specs, runs, strict=True):
            started = time.perf_counter()
            got = spec.one_pass()
            secs.append(time.perf_counter() - started)
            _check(spec.config, got, expect)
    results = []
    for spec, secs in zip(specs, runs, strict=True):
        r = Result(spec.config, spec.group, expect[0], expect[1], secs, spec.workers, spec.note)
        log(
            f"  {r.config:<30} {r.samples_per_s:>11,.0f} samples/s {r.mb_per_s:>9,.1f} MB/s"
            f"   runs {' '.join(f'{s:.2f}' for s in r.runs_s)}"
        )
        results.append(r)
    return results


def _check(config: str, got: tuple[int, int], expect: tuple[int, int]) -> None:
    if got != expect:
        raise RuntimeError(
            f"{config}: a pass delivered {got[0]} samples / {got[1]} bytes, "
            f"expected {expect[0]} / {expect[1]}"
        )


def set_ratios(results: Sequence[Result], baseline: float) -> None:
    """Each result's samples/s against ``baseline`` samples/s."""
    for r in results:
        r.ratio = r.samples_per_s / baseline if baseline > 0 else None


def table(results: Sequence[Result], ratio_label: str) -> str:
    """A fixed-width table: config, samples/s, MB/s, ratio, runs."""
    head = f"{'config':<34} {'samples/s':>11} {'MB/s':>9} {ratio_label:>12}  runs (s)"
    lines = [head, "-" * len(head)]
    for r in results:
        ratio = "" if r.ratio is None else f"{r.ratio:.2f}x"
        runs = " ".join(f"{s:.2f}" for s in r.runs_s)
        lines.append(
            f"{r.config:<34} {r.samples_per_s:>11,.0f} {r.mb_per_s:>9,.1f} {ratio:>12}  {runs}"
        )
    return "\n".join(lines)


# -- passes -----------------------------------------------------------------------------------


def count_dicts(samples: Iterable[dict[str, Any]]) -> tuple[int, int]:
    """(samples, bytes of every ``bytes`` value) of WebDataset-style dicts."""
    n = nbytes = 0
    for sample in samples:
        n += 1
        for value in sample.values():
            if isinstance(value, bytes):
                nbytes += len(value)
    return n, nbytes


def loader_pass(loader: Iterable[dict[str, Any]]) -> tuple[int, int]:
    """One epoch of a DataLoader of sample dicts."""
    return count_dicts(loader)


def fast_pass(loader: Any) -> tuple[int, int]:
    """One epoch of a FastLoader: samples and bytes received into its buffers."""
    n = nbytes = 0
    for batch in loader:
        n += len(batch.keys)
        for t in batch.data.values():
            nbytes += t.numel()
    return n, nbytes


def samples_for(total: int, size: int, shards: int, max_samples: int) -> int:
    """Samples in a shard set of ``size``-byte samples: ``total`` bytes' worth, at most
    ``max_samples`` (0: no cap), at least one per shard."""
    n = total // size
    if max_samples:
        n = min(n, max_samples)
    return max(shards, n)


# -- running ----------------------------------------------------------------------------------


@contextlib.contextmanager
def workdir(prefix: str, keep: bool = False) -> Iterator[Path]:
    """A temporary directory under ``$TMPDIR`` (default /tmp: a short path, for the
    daemons' ipc:// sockets), removed afterwards unless ``keep``. Point TMPDIR at another
    file system to measure on it (the hot tiers and the peers' caches live here)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=os.environ.get("TMPDIR") or "/tmp"))
    try:
        yield path
    finally:
        if keep:
            print(f"kept {path}", file=sys.stderr)
        else:
            shutil.rmtree(path, ignore_errors=True)


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit, so ``finally`` blocks stop daemons and remove files."""

    def handler(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def write_json(name: str, doc: dict[str, Any], out_dir: Path = OUT_DIR) -> Path:
    """Write ``doc`` to ``<out_dir>/<name>-<timestamp>.json``; returns the path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"{name}-{stamp}.json"
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    return path


# -- a run ------------------------------------------------------------------------------------


def log(line: str) -> None:
    """Print a line at once (benchmarks run for minutes; output must not sit in a buffer)."""
    print(line, flush=True)


def start_run(name: str, title: str) -> tuple[dict[str, Any], float]:
    """Begin a benchmark run: exit cleanly on SIGTERM, print the title, the machine and the
    command. Returns the result document's head (``benchmark``, ``machine``, ``argv``)
    and the start time (``time.perf_counter``) for :func:`finish_run`."""
    exit_on_sigterm()
    started = time.perf_counter()
    info = machine()
    log(title)
    log(machine_line(info))
    log(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    return {"benchmark": name, "machine": info, "argv": sys.argv}, started


def plan(args: Any) -> tuple[dict[int, int], int]:
    """Samples per shard set (by sample size) and a hot tier capacity that holds them all."""
    counts = {
        size: samples_for(args.total, size, args.shards, args.max_samples)
        for size in args.sample_sizes
    }
    tar_bytes = sum(tar_bytes_bound(args.shards, n, size) for size, n in counts.items())
    return counts, tar_bytes * 5 // 4 + (256 << 20)


def source_digest() -> str:
    """A digest of the daemon's and the client's Python source, where they are imported
    from: others may edit a shared checkout while a benchmark runs, and each fresh
    ``cached serve`` would then run another version; :func:`note_source_change` says so."""
    import cached_client

    import cached

    h = hashlib.sha256()
    for top in (Path(m.__file__ or "").parent for m in (cached, cached_client)):
        for path in sorted(top.rglob("*.py")):
            h.update(str(path.relative_to(top.parent)).encode() + b"\0")
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def note_source_change(doc: dict[str, Any]) -> None:
    """Record the source digest at the end beside ``doc["source_digest_at_start"]`` and
    warn when they differ (the runs may mix versions of the daemon and the client)."""
    doc["source_digest_at_end"] = source_digest()
    if doc["source_digest_at_end"] != doc["source_digest_at_start"]:
        log("WARNING: the source of cached/ or client/ changed during the run")


def finish_run(name: str, doc: dict[str, Any], started: float, out_dir: Path) -> None:
    """Record the elapsed time and load, write the JSON record and say where."""
    doc["elapsed_s"] = time.perf_counter() - started
    doc["loadavg_at_end"] = loadavg()
    out = write_json(name, doc, out_dir)
    log(
        f"\nwrote {out} ({doc['elapsed_s']:.0f}s in all; load average at the end "
        f"{' '.join(str(x) for x in doc['loadavg_at_end'])})"
    )


SHARD_SET_SIZES = ("100KB", "1KB")


def shard_set_parser(doc: str | None, small_help: str) -> argparse.ArgumentParser:
    """The options every shard-set benchmark takes (``serve``): sizes,
    repeats, output. Resolve them with :func:`shard_set_args`."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--small", action="store_true", help=small_help)
    p.add_argument("--shards", type=int, help="shards per shard set (default 64; --small 8)")
    p.add_argument("--total", help="sample payload per shard set (default 256MiB; --small 2MiB)")
    p.add_argument(
        "--sample-size",
        action="append",
        default=[],
        help="sample size(s), repeatable or comma-separated (default 100KB,1KB)",
    )
    p.add_argument(
        "--max-samples",
        type=int,
        default=32768,
        help="cap on samples per shard set, 0 for none (default 32768: the 1 KB set is 32 MiB)",
    )
    p.add_argument("--batch-size", type=int, default=64, help="FastLoader batch size (default 64)")
    p.add_argument("--out", type=Path, default=OUT_DIR, help="where the JSON goes")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    return p


def shard_set_args(p: argparse.ArgumentParser, argv: Sequence[str] | None, repeats: int) -> Any:
    """Parse and fill in the defaults (``--small`` picks the CI sizes and one repeat)."""
    args = p.parse_args(argv)
    args.shards = args.shards or (8 if args.small else 64)
    args.total = parse_size(args.total or ("2MiB" if args.small else "256MiB"))
    args.sample_sizes = parse_sizes(args.sample_size or SHARD_SET_SIZES)
    args.repeats = args.repeats or (1 if args.small else repeats)
    return args
