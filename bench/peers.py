"""Peers side by side: cached and the other ways to train from WebDataset shards in S3, on
the same data, the same emulated link and the same 2-worker DataLoader loop.

The link: moto's S3 server behind one token bucket shared by every connection (``tc tbf``
on a veth pair into a network namespace, or a token-bucket proxy where that cannot be set
up; bench/shaping.py) at ``--rates`` MB/s, plus ``--latency-ms`` one way on every request
(a delaying proxy). Bytes are counted at the link (the veth's receive counter, or the
proxy's bucket). Every system reads through the same endpoint:

  cached CachedDataset   a real ``cached serve`` (hot tier = the cache limit), 2 workers
  cached FastLoader      the same daemon, FastLoader in the training process
  webdataset pipe:curl   ``pipe:curl <presigned URL>``, no cache
  webdataset +cache_dir  the same with WebDataset's own file cache (cache_size = the limit)
  Mosaic Streaming       MDS (its conversion, timed separately), cache_limit = the limit
    (default cache)      the same MDS, no cache_limit: Mosaic's default (None, unbounded)
  litdata                litdata.optimize (timed separately), max_cache_size = the limit
    (default cache)      the same chunks, no max_cache_size: litdata's default
  s3torchconnector       S3IterableDataset + webdataset's tar expander, no cache

The "(default cache)" rows run Mosaic and litdata with no cache limit, as their users do;
the rows above them limit it to the hot tier's size. Two scenarios per rate: ``fits`` (the
limit holds the dataset; 2 epochs) and ``2x`` (the dataset is twice the limit; 3 epochs), where
a cache over the limit is marked ``(!)``. Each run is a fresh process and an empty cache; runs
alternate between systems ``--repeats`` times and the tables show medians of wall time,
samples/s, first batch, bytes at the link and CPU per epoch, with ratios to ``cached
CachedDataset`` (docs/benchmarks.md, "Peers side by side").

    python bench/peers.py                      # the full run (make bench-peers)
    python bench/peers.py --small              # the CI smoke run (make bench-peers-small)
    python bench/peers.py --rates 40 --repeats 1 --chart docs/peers.png

Run it with .venv-peers' python (``make bench-peers`` builds it): the peers' packages live
there, not in the project's .venv. A peer that cannot run gets a row saying why. Results go
to ``bench/out/peers-<timestamp>.json`` (and ``.md``, the tables as markdown). It prints
figures and asserts no timing. Only ``--small``, the CI run, exits 1 when a system could
not run or delivered a wrong sample count: there it proves that every path works.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common, shaping
from bench.peers_systems import BASELINE, BY_NAME, SYSTEMS, SystemInfo, base
from cached.config import parse_size

BUCKET = "bench-peers"
SCENARIOS = {"fits": 2, "2x": 3}  # scenario: epochs
LATENCY_MS = 20.0
SMALL_LATENCY_MS = 2.0
MB = 1_000_000


# -- one run ------------------------------------------------------------------------------------


@dataclass
class Run:
    """One system's run: a process, its epochs (or its conversion)."""

    system: str
    rate: float  # MB/s
    scenario: str  # "fits", "2x" or "convert"
    repeat: int
    epochs: list[dict[str, Any]] = field(default_factory=list)
    open_s: float | None = None
    conversion_s: float | None = None
    error: str = ""
    detail: str = ""
    wall_s: float = 0.0
    peak_disk_bytes: int = 0  # the most the run's caches (or hot tier) held on disk
    link_bytes_total: int | None = None  # the store sent over the link, start to end
    # CPU seconds of the emulation during the run: this process (the delaying proxy, and the
    # token-bucket proxy where it shapes) and the moto server. Not any system's.
    store_cpu_s: float = 0.0
    loadavg_before: list[float] = field(default_factory=list)
    loadavg_after: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.error


def run_system(
    spec: base.Spec,
    *,
    python: str,
    link: Callable[[], int] | None,
    log_path: Path,
    rate: float,
    scenario: str,
    repeat: int,
) -> Run:
    """Run one system in a fresh process of ``python``; answer its link marks."""
    run = Run(spec.system, rate, scenario, repeat, loadavg_before=common.loadavg())
    # MAX_CACHE_SIZE would override litdata's max_cache_size (and its default) in every row.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CACHED_", "WDS_")) and k != "MAX_CACHE_SIZE"
    }
    env.update(base.aws_env(spec.endpoint), PEERS_DRIVER="1", PYTHONUNBUFFERED="1")
    # The run's temporary files (Mosaic's file locks, litdata's scratch) stay in its workdir.
    tmp = Path(spec.workdir) / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env["TMPDIR"] = str(tmp)
    started = time.perf_counter()
    link0 = link() if link is not None else None
    store0 = store_cpu_s()
    with open(log_path, "ab") as err:
        proc = subprocess.Popen(
            [python, "-m", "bench.peers_systems.runner", spec.to_json()],
            cwd=common.ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,  # its own process group: workers and daemon end with it
        )
    messages: queue.Queue[tuple[str, Any]] = queue.Queue()
    reader = threading.Thread(target=_read, args=(proc, link, messages, log_path), daemon=True)
    reader.start()
    stop = threading.Event()
    sampler = threading.Thread(
        target=_sample_disk, args=(Path(spec.workdir), run, stop), daemon=True
    )
    sampler.start()
    try:
        proc.wait(spec.timeout_s)
    except subprocess.TimeoutExpired:
        run.error = f"timed out after {spec.timeout_s:.0f}s"
    finally:
        _end_group(proc)
    reader.join(10)
    stop.set()
    sampler.join(5)
    if link is not None and link0 is not None:
        run.link_bytes_total = link() - link0
    run.store_cpu_s = store_cpu_s() - store0
    run.wall_s = time.perf_counter() - started
    while not messages.empty():
        kind, payload = messages.get()
        if kind == "epoch":
            run.epochs.append(payload)
        elif kind == "opened":
            run.open_s = payload["open_s"]
        elif kind == "prepared":
            run.conversion_s = payload["conversion_s"]
        elif kind == "error" and not run.error:
            # The first line says it; the rest (a traceback, a log's end) goes to the JSON.
            lines = payload["error"].strip().splitlines() or ["?"]
            run.error, run.detail = lines[0][:300], payload["error"] + "\n" + payload["detail"]
    if not run.error and proc.returncode != 0:
        run.error = f"exited {proc.returncode} (see {log_path})"
    if not run.error and spec.mode == "epochs" and len(run.epochs) != spec.epochs:
        run.error = f"{len(run.epochs)} of {spec.epochs} epochs reported"
    run.loadavg_after = common.loadavg()
    return run


def _read(
    proc: subprocess.Popen[str],
    link: Callable[[], int] | None,
    out: queue.Queue[tuple[str, Any]],
    log_path: Path,
) -> None:
    """The runner's stdout: answer marks with the link counter, collect messages, copy any
    other output into the run's log."""
    assert proc.stdout is not None and proc.stdin is not None
    with open(log_path, "a") as log:
        for line in proc.stdout:
            if not line.startswith(base.MSG):
                log.write(line)
                continue
            kind, _, payload = line[len(base.MSG) :].partition(" ")
            if kind == "mark":
                with contextlib.suppress(OSError):
                    proc.stdin.write(f"{link() if link is not None else ''}\n")
                    proc.stdin.flush()
            else:
                out.put((kind, json.loads(payload)))


def store_cpu_s() -> float:
    """CPU seconds of this process (its own threads, not its children) and of the moto
    servers it started."""
    total = time.process_time()
    me = str(os.getpid())
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = Path(entry.path, "cmdline").read_bytes()
            if b"moto.server" in cmdline and _descends_from(entry.name, me):
                total += base.tree_cpu_s(int(entry.name))
    return total


def _descends_from(pid: str, ancestor: str) -> bool:
    for _ in range(8):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = stat[stat.rindex(")") + 2 :].split()[1]
        if pid == ancestor:
            return True
    return False


def disk_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (apparent sizes), leaving out its ``tmp``."""
    total = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(path):
            try:
                if entry.is_dir(follow_symlinks=False):
                    if entry.name != "tmp":
                        total += disk_bytes(Path(entry.path))
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
            except OSError:
                continue  # removed while we looked (an eviction)
    return total


def _sample_disk(workdir: Path, run: Run, stop: threading.Event) -> None:
    """Every 0.2 s: what the run's cache directories (or hot tier) hold; keeps the peak.
    Here, not in the runner: the client's CPU seconds do not include it."""
    while not stop.wait(0.2):
        run.peak_disk_bytes = max(run.peak_disk_bytes, disk_bytes(workdir))


def _end_group(proc: subprocess.Popen[str]) -> None:
    """End what is left of the run's process group (the runner started it)."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
            if sig == signal.SIGTERM:
                # The runner is gone; give what it left (workers, a daemon) a moment.
                time.sleep(0.2)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            return
        except subprocess.TimeoutExpired:
            continue


# -- medians and tables -------------------------------------------------------------------------


MEASURES = (
    "wall_s",
    "samples_per_s",
    "first_batch_s",
    "link_bytes",
    "client_cpu_s",
    "daemon_cpu_s",
)


@dataclass
class Row:
    """A system in one configuration: medians per epoch over its completed runs."""

    system: str
    runs: int  # completed runs
    epochs: list[dict[str, float | None]]  # per epoch: measure -> median (None: unknown)
    problems: list[str]  # wrong counts seen (the row is marked)
    error: str  # why there is no figure (every run failed or was skipped)
    peak_disk_bytes: float | None = None  # median of the runs' peaks
    ratio_samples_per_s: list[float | None] = field(default_factory=list)
    ratio_wall: float | None = None
    ratio_cpu: float | None = None

    @property
    def total_wall_s(self) -> float:
        return sum(e["wall_s"] or 0.0 for e in self.epochs)

    @property
    def total_cpu_s(self) -> float:
        return sum((e["client_cpu_s"] or 0.0) + (e["daemon_cpu_s"] or 0.0) for e in self.epochs)

    @property
    def daemon(self) -> bool:
        return any(e["daemon_cpu_s"] is not None for e in self.epochs)


def median_row(
    system: str,
    runs: Sequence[Run],
    epochs: int,
    capacity: int,
    shard_bytes: int,
    *,
    limited: bool = True,
) -> Row:
    """The medians of a system's completed runs; marked if an epoch delivered a wrong count,
    or its cache went over the limit by more than a shard (one download in flight). A row
    not given the limit (``limited`` False: its default cache) is held to it all the same,
    and its mark says so: past the hot tier's size it is not like for like."""
    done = [r for r in runs if r.ok and len(r.epochs) == epochs]
    problems = sorted(
        {f"epoch {e['epoch']}: {e['problem']}" for r in done for e in r.epochs if e["problem"]}
    )
    peak = max((r.peak_disk_bytes for r in done), default=0)
    if peak > capacity + shard_bytes:
        # "its cache" starts every such note: --small does not fail on them.
        limit = (
            f"the limit is {capacity / MB:,.1f} MB"
            if limited
            else f"no limit was set (its default), the hot tier is {capacity / MB:,.1f} MB"
        )
        problems.append(f"its cache held up to {peak / MB:,.1f} MB on disk: {limit}")
    if not done:
        errors = sorted({r.error for r in runs if r.error})
        return Row(system, 0, [], problems, "; ".join(errors) or "not run")
    rows: list[dict[str, float | None]] = []
    for i in range(epochs):
        row: dict[str, float | None] = {}
        for m in MEASURES:
            values = [_measure(r.epochs[i], m) for r in done]
            known = [v for v in values if v is not None]
            row[m] = statistics.median(known) if known else None
        rows.append(row)
    peaks = [r.peak_disk_bytes for r in done]
    return Row(system, len(done), rows, problems, "", statistics.median(peaks))


def _measure(epoch: dict[str, Any], name: str) -> float | None:
    if name == "samples_per_s":
        return float(epoch["samples"] / epoch["wall_s"]) if epoch["wall_s"] > 0 else None
    value = epoch.get(name)
    return None if value is None else float(value)


def set_ratios(rows: Sequence[Row]) -> None:
    """Each row against the baseline (``cached CachedDataset``): samples/s per epoch (above
    1: faster than cached), the wall time of all epochs and CPU seconds (above 1: more)."""
    base_row = next((r for r in rows if r.system == BASELINE and not r.error), None)
    if base_row is None:
        return
    for r in rows:
        if r.error:
            continue
        r.ratio_samples_per_s = [
            (a["samples_per_s"] / b["samples_per_s"])
            if a["samples_per_s"] and b["samples_per_s"]
            else None
            for a, b in zip(r.epochs, base_row.epochs, strict=True)
        ]
        r.ratio_wall = r.total_wall_s / base_row.total_wall_s if base_row.total_wall_s else None
        r.ratio_cpu = r.total_cpu_s / base_row.total_cpu_s if base_row.total_cpu_s else None


def _per_epoch(values: Sequence[float | None], fmt: Callable[[float], str]) -> str:
    return " / ".join("-" if v is None else fmt(v) for v in values)


COLUMNS = (
    "system",
    "epoch s",
    "samples/s",
    "first batch s",
    "fetched MB",
    "client CPU s",
    "daemon CPU s",
    "peak disk MB",
    "samples/s vs cached",
    "time vs cached",
    "CPU vs cached",
)


def row_cells(r: Row) -> list[str]:
    name = r.system + (" (!)" if r.problems else "")
    if r.error:
        return [name, f"did not run: {r.error}"] + [""] * (len(COLUMNS) - 2)

    def col(m: str) -> list[float | None]:
        return [e[m] for e in r.epochs]

    def ratio(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    return [
        name,
        _per_epoch(col("wall_s"), lambda v: f"{v:.2f}"),
        _per_epoch(col("samples_per_s"), lambda v: f"{v:,.0f}"),
        _per_epoch(col("first_batch_s"), lambda v: f"{v:.2f}"),
        _per_epoch(col("link_bytes"), lambda v: f"{v / MB:,.1f}"),
        _per_epoch(col("client_cpu_s"), lambda v: f"{v:.2f}"),
        _per_epoch(col("daemon_cpu_s"), lambda v: f"{v:.2f}") if r.daemon else "-",
        "-" if not r.peak_disk_bytes else f"{r.peak_disk_bytes / MB:,.1f}",
        _per_epoch(r.ratio_samples_per_s, lambda v: f"{v:.2f}x"),
        ratio(r.ratio_wall),
        ratio(r.ratio_cpu),
    ]


def text_table(rows: Sequence[Row]) -> str:
    """A fixed-width table; a row that did not run says why after its name."""
    cells = [list(COLUMNS)] + [row_cells(r) for r in rows if not r.error]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(
            v.ljust(w) if i == 0 else v.rjust(w)
            for i, (v, w) in enumerate(zip(c, widths, strict=True))
        )
        for c in cells
    ]
    lines.insert(1, "-" * len(lines[0]))
    lines += [f"{c[0].ljust(widths[0])}  {c[1]}" for c in (row_cells(r) for r in rows if r.error)]
    return "\n".join(lines)


def markdown_table(rows: Sequence[Row]) -> str:
    lines = [
        "| " + " | ".join(COLUMNS) + " |",
        "|---|" + "---:|" * (len(COLUMNS) - 1),
    ]
    for r in rows:
        c = row_cells(r)
        if r.error:
            lines.append(f"| {c[0]} | {c[1]} |" + " |" * (len(COLUMNS) - 2))
        else:
            lines.append("| " + " | ".join(c) + " |")
    return "\n".join(lines)


# -- the run ------------------------------------------------------------------------------------


@dataclass
class Config:
    """One table: a link rate and a scenario."""

    rate: float  # MB/s
    scenario: str
    epochs: int
    capacity: int
    rows: list[Row] = field(default_factory=list)

    @property
    def title(self) -> str:
        return (
            f"{self.rate:g} MB/s, {self.scenario} ({self.epochs} epochs, cache limit / hot tier "
            f"{common.human(self.capacity)})"
        )


def choose_systems(names: Sequence[str]) -> list[SystemInfo]:
    """The systems named (a case-insensitive substring of a row's name), else all."""
    if not names:
        return list(SYSTEMS)
    chosen = [s for s in SYSTEMS if any(n.lower() in s.name.lower() for n in names)]
    if not chosen:
        raise SystemExit(f"no system matches {', '.join(names)}; known: {', '.join(BY_NAME)}")
    return chosen


def conversions(systems: Sequence[SystemInfo]) -> list[SystemInfo]:
    """The conversions the chosen systems need: one per module (its rows read the same
    converted data), named after the module's first converting row in SYSTEMS, whichever of
    its rows were chosen."""
    modules = {s.module for s in systems if s.converts}
    return [
        next(s for s in SYSTEMS if s.module == m and s.converts)
        for m in dict.fromkeys(s.module for s in SYSTEMS)
        if m in modules
    ]


def uploader(shards: common.ShardSet, keys: Sequence[str]) -> shaping.Populate:
    """Put the WebDataset shards into the (still unshaped) store."""

    def upload(endpoint: str) -> None:
        client = shaping.s3_client(endpoint)
        client.create_bucket(Bucket=BUCKET)
        for path, key in zip(shards.paths, keys, strict=True):
            client.upload_file(str(path), BUCKET, key)

    return upload


def prerequisites(python: str) -> str | None:
    """Why the harness cannot run here at all (one line), or None."""
    try:
        __import__("moto")
    except ImportError:
        return "moto is not installed (the demo extra)"
    done = subprocess.run(
        [python, "-c", "import torch, cached_client, cached"], capture_output=True, check=False
    )
    if done.returncode != 0:
        return f"{python} cannot import torch, cached_client and cached"
    return None


def run_all(args: argparse.Namespace, doc: dict[str, Any], work: Path) -> list[Config]:
    """Every rate: a shaped store, the conversions, then every scenario's runs, alternating
    between the systems ``--repeats`` times."""
    log = common.log
    samples = common.samples_for(args.total, args.sample_size, args.shards, 0)
    shards = common.write_shards(work / "shards", args.shards, samples, args.sample_size)
    keys = [f"wds/{p.name}" for p in shards.paths]
    largest = max(p.stat().st_size for p in shards.paths)
    capacities = {"fits": shards.tar_bytes + 4 * largest, "2x": shards.tar_bytes // 2}
    doc["dataset"] = {
        "shards": len(keys),
        "samples": shards.samples,
        "sample_size": args.sample_size,
        "payload_bytes": shards.payload_bytes,
        "tar_bytes": shards.tar_bytes,
        "largest_shard_bytes": largest,
        "capacities": capacities,
    }
    log(
        f"dataset: {len(keys)} shards, {shards.samples:,} samples of "
        f"{common.human(args.sample_size)}, {shards.tar_bytes / MB:,.1f} MB of tar; cache "
        f"limit = hot tier: fits {common.human(capacities['fits'])}, 2x "
        f"{common.human(capacities['2x'])}; batches of {args.batch_size}, "
        f"{args.workers} DataLoader workers, {args.compute_ms:g} ms compute per batch"
    )
    systems = choose_systems(args.system)
    configs: list[Config] = []
    doc["links"], doc["conversions"], doc["runs"] = {}, [], []

    def spec_for(info: SystemInfo, mode: str, workdir: Path, endpoint: str, **kw: Any) -> base.Spec:
        return base.Spec(
            system=info.name,
            mode=mode,
            endpoint=endpoint,
            bucket=BUCKET,
            tar_keys=keys,
            tar_dir=str(shards.dir),
            samples=shards.samples,
            payload_bytes=shards.payload_bytes,
            tar_bytes=shards.tar_bytes,
            shard_bytes=largest,
            workdir=str(workdir),
            batch_size=args.batch_size,
            workers=args.workers,
            compute_s=args.compute_ms / 1000,
            timeout_s=args.timeout,
            cache_limit=info.cache_limit,
            **kw,
        )

    for rate in args.rates:
        log(f"\n== {rate:g} MB/s ({rate * 8:g} Mbit/s), {args.latency_ms:g} ms one way")
        with shaping.shaped_s3(
            rate * 8,
            latency_ms=args.latency_ms,
            populate=uploader(shards, keys),
            method=args.shaping,
            probe_bytes=min(8_000_000, max(1_000_000, shards.tar_bytes // 8)),
            server_log=work / f"moto-{rate:g}.log",
            log=log,
        ) as s3:
            endpoint = s3.endpoint_url
            doc["links"][f"{rate:g}"] = s3.record()
            log(
                f"link: {s3.method}: a probe download ran at {s3.measured_mbit / 8:,.1f} MB/s "
                f"({s3.measured_mbit / (rate * 8):.0%} of the limit; the store unshaped: "
                f"{s3.unshaped_mbit / 8:,.0f} MB/s); a request took {s3.request_ms:.0f} ms; "
                f"bytes counted {'at the link' if s3.link_bytes else 'nowhere (no counter)'}"
            )
            failed_conversion: dict[str, str] = {}  # module: why its rows cannot run
            for info in conversions(systems):
                where = work / f"r{rate:g}-convert-{info.module}"
                run = run_system(
                    spec_for(info, "prepare", where, endpoint),
                    python=args.python,
                    link=s3.link_bytes,
                    log_path=work / f"r{rate:g}-convert-{info.module}.log",
                    rate=rate,
                    scenario="convert",
                    repeat=0,
                )
                doc["conversions"].append(dataclasses.asdict(run))
                if run.ok:
                    log(f"  conversion {info.name:<32} {run.conversion_s:8.2f} s")
                else:
                    failed_conversion[info.module] = f"its conversion failed: {run.error}"
                    log(f"  conversion {info.name:<32} FAILED: {run.error}\n{_indent(run.detail)}")
            for scenario in args.scenarios:
                epochs = SCENARIOS[scenario]
                runs: dict[str, list[Run]] = {s.name: [] for s in systems}
                for rep in range(args.repeats):
                    log(f"-- {rate:g} MB/s, {scenario}: pass {rep + 1} of {args.repeats}")
                    for i, info in enumerate(systems):
                        if info.converts and info.module in failed_conversion:
                            run = Run(info.name, rate, scenario, rep)
                            run.error = failed_conversion[info.module]
                        else:
                            where = work / f"r{rate:g}-{scenario}-{rep}-{i}"
                            run = run_system(
                                spec_for(
                                    info,
                                    "epochs",
                                    where,
                                    endpoint,
                                    capacity=capacities[scenario],
                                    epochs=epochs,
                                    seed=rep,
                                ),
                                python=args.python,
                                link=s3.link_bytes,
                                log_path=work / f"r{rate:g}-{scenario}-{rep}-{i}.log",
                                rate=rate,
                                scenario=scenario,
                                repeat=rep,
                            )
                            if not args.keep:
                                _remove(where)
                        runs[info.name].append(run)
                        doc["runs"].append(dataclasses.asdict(run))
                        log(run_line(run))
                config = Config(rate, scenario, epochs, capacities[scenario])
                config.rows = [
                    median_row(
                        s.name,
                        runs[s.name],
                        epochs,
                        capacities[scenario],
                        largest,
                        limited=s.cache_limit,
                    )
                    for s in systems
                ]
                set_ratios(config.rows)
                configs.append(config)
                log(f"\n{config.title}, median of {args.repeats}:\n{text_table(config.rows)}\n")
    return configs


def run_line(run: Run) -> str:
    """One log line per run."""
    head = f"  {run.system:<32}"
    if not run.ok:
        fetched = (
            ""
            if run.link_bytes_total is None
            else f" (the store sent {run.link_bytes_total / MB:,.1f} MB over the link)"
        )
        return f"{head} FAILED: {run.error}{fetched}\n{_indent(run.detail)}"
    walls = " / ".join(f"{e['wall_s']:.2f}" for e in run.epochs)
    fetched = " / ".join(
        "-" if e["link_bytes"] is None else f"{e['link_bytes'] / MB:.1f}" for e in run.epochs
    )
    problems = "; ".join(f"epoch {e['epoch']}: {e['problem']}" for e in run.epochs if e["problem"])
    return (
        f"{head} epochs {walls} s, fetched {fetched} MB, first batch "
        f"{run.epochs[0]['first_batch_s']:.2f} s, peak disk {run.peak_disk_bytes / MB:,.0f} MB, "
        f"store+link CPU {run.store_cpu_s:.1f} s, load {run.loadavg_before[0]:.1f}"
        + (f"  WRONG COUNT: {problems}" if problems else "")
    )


def _indent(text: str) -> str:
    return "\n".join("      " + line for line in text.strip().splitlines()[-12:])


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def conversion_rows(doc: dict[str, Any]) -> list[str]:
    lines = ["| rate | system | conversion s |", "|---:|---|---:|"]
    for c in doc.get("conversions", []):
        value = f"{c['conversion_s']:.2f}" if not c["error"] else f"failed: {c['error']}"
        lines.append(f"| {c['rate']:g} MB/s | {c['system']} | {value} |")
    return lines


def markdown(configs: Sequence[Config], doc: dict[str, Any]) -> str:
    """The tables as markdown (for docs/benchmarks.md), with the machine, its load and the
    link as measured."""
    runs = doc.get("runs", [])
    loads = [x for r in runs for x in (r["loadavg_before"][:1] + r["loadavg_after"][:1])]
    out = [
        f"{common.machine_line(doc['machine'])}; at the end "
        f"{' '.join(str(x) for x in doc.get('loadavg_at_end', []))}  ",
        f"load average (1 min) over the runs: {min(loads, default=0):.1f} to "
        f"{max(loads, default=0):.1f}; {doc.get('elapsed_s', 0) / 60:.1f} min in all  ",
    ]
    for rate, link in doc.get("links", {}).items():
        out.append(
            f"link at {rate} MB/s: {link['method']}, a probe download at "
            f"{link['measured_mbit'] / 8:,.1f} MB/s, a request {link['request_ms']:.0f} ms "
            f"(the store unshaped: {link['unshaped_mbit'] / 8:,.0f} MB/s)  "
        )
    out.append("")
    for c in configs:
        out += [f"#### {c.title}", "", markdown_table(c.rows), ""]
        for r in c.rows:
            for p in r.problems:
                out.append(f"(!) {r.system}: {p}  ")
        out.append("")
    out += ["#### Conversions (once per store, written through the link)", ""]
    out += conversion_rows(doc)
    return "\n".join(out) + "\n"


def chart(configs: Sequence[Config], path: Path) -> str | None:
    """A PNG (matplotlib): per configuration, each system's epoch wall times and bytes
    fetched per epoch (medians). Returns why it was not written, or None."""
    import importlib

    try:
        matplotlib: Any = importlib.import_module("matplotlib")
    except ImportError:
        return "matplotlib is not installed here"
    matplotlib.use("Agg")
    plt: Any = importlib.import_module("matplotlib.pyplot")
    fig, axes = plt.subplots(len(configs), 2, figsize=(15, 3.6 * len(configs)), squeeze=False)
    colors = ["#4c72b0", "#dd8452", "#55a868"]
    panels = (
        ("wall_s", 1.0, "epoch wall time, s (lower is better)"),
        ("link_bytes", 1 / MB, "MB fetched over the link per epoch"),
    )
    for row, c in zip(axes, configs, strict=True):
        names = [r.system.replace(" ", "\n", 1) for r in c.rows]
        width = 0.8 / c.epochs
        for ax, (measure, scale, label) in zip(row, panels, strict=True):
            for e in range(c.epochs):
                xs = [i + (e - (c.epochs - 1) / 2) * width for i in range(len(c.rows))]
                ys = [0.0 if r.error else (r.epochs[e][measure] or 0.0) * scale for r in c.rows]
                ax.bar(xs, ys, width, label=f"epoch {e + 1}", color=colors[e % len(colors)])
            for i, r in enumerate(c.rows):
                if r.error:
                    ax.text(i, 0, "did not\nrun", ha="center", va="bottom", fontsize=7, color="red")
                elif r.problems:
                    ax.text(i, 0, "(!)", ha="center", va="bottom", fontsize=8, color="red")
            ax.set_xticks(range(len(c.rows)), names, fontsize=7)
            ax.set_ylabel(label, fontsize=8)
            ax.set_title(c.title, fontsize=9)
            ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--small", action="store_true", help="the CI size: every path, seconds")
    p.add_argument(
        "--rates", help="link rates, MB/s, comma-separated (default 40,400; --small 400)"
    )
    p.add_argument(
        "--latency-ms",
        type=float,
        help=f"one-way delay of the link, ms (default {LATENCY_MS:g}; --small "
        f"{SMALL_LATENCY_MS:g})",
    )
    p.add_argument("--repeats", type=int, help="runs per system and table (default 3; --small 1)")
    p.add_argument("--scenario", action="append", default=[], help="fits and/or 2x (default both)")
    p.add_argument(
        "--system",
        action="append",
        default=[],
        help="only the systems whose name contains this (repeatable; default all)",
    )
    p.add_argument("--shards", type=int, help="tar shards (default 32; --small 16)")
    p.add_argument("--total", help="sample payload (default 213MB; --small 4MB)")
    p.add_argument("--sample-size", help="bytes per sample (default 100KB; --small 64KB)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per batch (32)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (2)")
    p.add_argument("--compute-ms", type=float, default=0.0, help="compute per batch, ms (0)")
    p.add_argument(
        "--shaping",
        choices=("auto", "netns", "proxy"),
        default="auto",
        help="how to limit the rate: netns (tc tbf), proxy, or auto (netns, else proxy)",
    )
    p.add_argument("--timeout", type=float, help="seconds per run (default 300; --small 120)")
    p.add_argument(
        "--python", default=sys.executable, help="the interpreter of the systems' processes"
    )
    p.add_argument("--chart", type=Path, help="write a PNG chart here (e.g. docs/peers.png)")
    p.add_argument("--out", type=Path, default=common.OUT_DIR, help="where the JSON goes")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = p.parse_args(argv)
    args.rates = [float(r) for r in (args.rates or ("400" if args.small else "40,400")).split(",")]
    if args.latency_ms is None:
        args.latency_ms = SMALL_LATENCY_MS if args.small else LATENCY_MS
    args.repeats = args.repeats or (1 if args.small else 3)
    args.scenarios = [s.strip() for v in args.scenario for s in v.split(",") if s.strip()] or list(
        SCENARIOS
    )
    bad = [s for s in args.scenarios if s not in SCENARIOS]
    if bad:
        p.error(f"unknown scenario {', '.join(bad)}; known: {', '.join(SCENARIOS)}")
    args.shards = args.shards or (16 if args.small else 32)
    args.total = parse_size(args.total or ("4MB" if args.small else "213MB"))
    args.sample_size = parse_size(args.sample_size or ("64KB" if args.small else "100KB"))
    args.timeout = args.timeout or (120.0 if args.small else 300.0)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    why = prerequisites(args.python)
    if why is not None:
        print(f"bench/peers.py: skipped: {why}")
        return 0
    head, started = common.start_run("peers", "peers side by side (one shaped S3 link)")
    doc: dict[str, Any] = {
        **head,
        "settings": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("scenario",)
        },
        "systems": {s.name: s.what for s in SYSTEMS},
    }
    doc["source_digest_at_start"] = common.source_digest()
    with common.workdir("cached-bench-peers-", keep=args.keep) as work:
        configs = run_all(args, doc, work)
    common.note_source_change(doc)
    common.log("\n" + "=" * 100)
    for c in configs:
        common.log(f"\n{c.title}, median of {args.repeats}:\n{text_table(c.rows)}")
        for r in c.rows:
            for problem in r.problems:
                common.log(f"  (!) {r.system}: {problem}")
    common.log("\nconversions:\n" + "\n".join(conversion_rows(doc)))
    doc["tables"] = [
        {**dataclasses.asdict(c), "rows": [dataclasses.asdict(r) for r in c.rows]} for c in configs
    ]
    if args.chart is not None:
        why_not = chart(configs, args.chart)
        common.log(f"chart: {why_not}" if why_not else f"chart: wrote {args.chart}")
    common.finish_run("peers", doc, started, args.out)
    md = sorted(args.out.glob("peers-*.json"))[-1].with_suffix(".md")
    md.write_text(markdown(configs, doc))
    common.log(f"wrote {md}")
    broken = sorted(
        {
            f"{r.system} ({c.rate:g} MB/s {c.scenario}): {r.error or 'a wrong sample count'}"
            for c in configs
            for r in c.rows
            if r.error or any(not p.startswith("its cache") for p in r.problems)
        }
    )
    if broken and args.small:
        # The smoke run proves every system's path works here: one that did not fails it.
        common.log("\nFAILED (the smoke run needs every path to work):\n  " + "\n  ".join(broken))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
