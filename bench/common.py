"""Shared helpers of the benchmarks: synthetic shards, a `cached serve` subprocess, timing,
tables, the machine's description and the JSON record.

Run the benchmarks as scripts (``python bench/serve.py``); they put the repository root on
``sys.path`` themselves, so ``bench.common`` imports either way.
"""

from __future__ import annotations

import contextlib
import datetime as dt
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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cached_client.errors import DaemonUnavailable
from cached_client.transport import Connection

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "bench" / "out"
MB = 1_000_000  # MB/s in the tables are 10^6 bytes of sample payload per second


# -- sizes --------------------------------------------------------------------------------------

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
}


def parse_size(text: str) -> int:
    """``"256MiB"``, ``"100KB"``, ``"1k"`` or ``"4096"`` -> bytes (KB = 1000, KiB = 1024)."""
    s = text.strip().lower()
    digits = s.rstrip("abcdefghijklmnopqrstuvwxyz").strip()
    unit = s[len(digits) :].strip()
    if unit not in _UNITS or not digits:
        raise ValueError(f"not a size: {text!r} (e.g. 256MiB, 100KB, 1000)")
    return int(float(digits) * _UNITS[unit])


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


def machine_line(info: dict[str, Any]) -> str:
    """One header line describing the machine."""
    return (
        f"machine: {info['cpu_model']}, {info['cores']} cores "
        f"({info['cores_usable']} usable), {human(info['memory_bytes'])} RAM, "
        f"Linux {info['kernel']}; python {info['python']}, torch {info.get('torch', '?')}, "
        f"pyzmq {info.get('zmq', '?')} (libzmq {info.get('libzmq', '?')}), "
        f"webdataset {info.get('webdataset', '?')}, "
        f"pinned memory {'yes' if info.get('pinned_memory') else 'no'}"
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


def write_shards(directory: Path, shards: int, total: int, sample_size: int) -> ShardSet:
    """Write ``shards`` tar files holding about ``total`` bytes of ``sample_size`` samples.

    The files are byte for byte what ``tarfile`` (GNU format) writes for the same members,
    written without it for speed (hundreds of thousands of small members).
    """
    directory.mkdir(parents=True, exist_ok=True)
    samples = max(shards, total // sample_size)
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


def write_config(path: Path, cfg: dict[str, dict[str, Any]]) -> Path:
    """A TOML config from nested dicts of strings, numbers and booleans."""
    lines = []
    for section, values in cfg.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if isinstance(value, bool):
                lines.append(f"{key} = {'true' if value else 'false'}")
            elif isinstance(value, int | float):
                lines.append(f"{key} = {value}")
            else:
                lines.append(f"{key} = {json.dumps(str(value))}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _clean_env() -> dict[str, str]:
    # A developer's CACHED_* variables would override the benchmark's config.
    return {k: v for k, v in os.environ.items() if not k.startswith("CACHED_")}


@dataclass
class Daemon:
    """``cached serve --config`` as a subprocess, on ``socket`` with its hot tier in
    ``cache_dir``. ``with Daemon(...) as d:`` starts it and always stops it."""

    workdir: Path
    socket: str
    cache_dir: Path
    capacity: int
    name: str = "daemon"
    proc: subprocess.Popen[bytes] | None = None
    config: Path = field(init=False)
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log = self.workdir / f"{self.name}.log"
        self.config = write_config(
            self.workdir / f"{self.name}.toml",
            {
                "server": {"socket": self.socket, "http": "127.0.0.1:0"},
                "cache": {
                    "dir": str(self.cache_dir),
                    "capacity": self.capacity,
                    "min_free": 0,
                },
            },
        )

    def __enter__(self) -> Daemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 60.0) -> Daemon:
        """Start it and wait until it answers a handshake."""
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cached", "serve", "--config", str(self.config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_clean_env(),
                cwd=self.workdir,
            )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"cached serve exited {self.proc.returncode}:\n{self.log_tail()}")
            conn = Connection(self.socket, connect_timeout_s=0.5)
            try:
                conn.open()
                return self
            except DaemonUnavailable:
                if time.monotonic() > deadline:
                    self.stop()
                    raise
            finally:
                conn.close()

    def stop(self) -> int | None:
        """SIGTERM (drain), then SIGKILL after 20 s; returns the exit code."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def prefetch(self, urls: Sequence[str]) -> float:
        """``cached prefetch URL...`` into this daemon's hot tier; returns seconds taken."""
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "cached", "prefetch", "--config", str(self.config), *urls],
            env=_clean_env(),
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"cached prefetch failed ({done.returncode}):\n{done.stderr[-4000:]}")
        return time.perf_counter() - started

    def status(self) -> dict[str, Any]:
        """The daemon's status reply."""
        conn = Connection(self.socket, connect_timeout_s=5.0)
        try:
            header, _ = conn.request({"op": "status"})
        finally:
            conn.close()
        status: dict[str, Any] = header["status"]
        return status

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the daemon's log."""
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-chars:]
        return ""


# -- timing ---------------------------------------------------------------------------------

Pass = Callable[[], tuple[int, int]]  # one full pass over the data: (samples, bytes)


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
        out.update(
            median_s=self.median_s, samples_per_s=self.samples_per_s, mb_per_s=self.mb_per_s
        )
        return out


def measure(
    config: str,
    group: str,
    one_pass: Pass,
    *,
    repeats: int,
    expect: tuple[int, int],
    warmup: bool = True,
    workers: int | None = None,
    note: str = "",
) -> Result:
    """Time ``repeats`` full passes (after one untimed warm-up pass when ``warmup``);
    every pass must deliver exactly ``expect`` = (samples, bytes)."""
    if warmup:
        _check(config, one_pass(), expect)
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        got = one_pass()
        runs.append(time.perf_counter() - started)
        _check(config, got, expect)
    return Result(config, group, expect[0], expect[1], runs, workers, note)


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


# -- running ----------------------------------------------------------------------------------


@contextlib.contextmanager
def workdir(prefix: str, keep: bool = False) -> Iterator[Path]:
    """A temporary directory under /tmp, removed afterwards unless ``keep``."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
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
