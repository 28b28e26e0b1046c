"""Where a warm FastLoader pass over local reads goes: the same pass with parts left out.

Issue 11 asks FastLoader to read warm local shards at 0.7x a raw ``readinto`` of the same
files. This says which part keeps it from that. One ``cached serve`` daemon (a subprocess)
holds the shards in its hot tier; one FastLoader in this process reads them locally
(D25, D26, D32), alternated with a raw read of the files, in four forms:

  raw             ``readinto`` of every shard file into one reused buffer (page cache)
  full            FastLoader as shipped: requests, and each reply laid out, read by
                  ``preadv`` runs and checked (XXH3) by the compiled reader (D32)
  no-checks       the same without the XXH3 check of each member
  python          the same as ``full`` in Python: the reads where the compiled reader is
                  not built (no C compiler at install), as before D32

Each form's pass is timed, with the process's CPU time and the daemon's; medians of
``--repeats`` alternated rounds. In ``full`` and ``no-checks`` the time inside the
compiled reader's calls (copies and checks, without the GIL) is timed too: the rest of
the pass is Python, requests and waiting for the daemon. The forms other than ``full``
patch the client module in this process only (its checksum table, its compiled reader):
a measurement, never a way to run.

    python bench/fast_parts.py               # 64 shards of 4 MB (256 MB), 9 rounds
    python bench/fast_parts.py --small       # the CI run: every path, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cached_client.local as local_reads
from cached_client.fast import FastLoader

from bench import common

FORMS = ("raw", "full", "no-checks", "python")


class _Timed:
    """The compiled reader with the time inside its ``read`` calls added up."""

    def __init__(self, compiled: Any) -> None:
        self._compiled = compiled
        self.layout_packed = compiled.layout_packed
        self.seconds = 0.0

    def read(self, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._compiled.read(*args)
        finally:
            self.seconds += time.perf_counter() - t0


@contextlib.contextmanager
def _form(name: str) -> Iterator[_Timed | None]:
    """Leave out the parts the form ``name`` leaves out, for the duration; yields the
    timed compiled reader (None in the ``python`` form)."""
    digests = dict(local_reads._DIGESTS)
    compiled = local_reads.GATHER
    if compiled is None:
        raise RuntimeError("cached_client._gather is not built: pip install -e ./client")
    timed = _Timed(compiled) if name != "python" else None
    local_reads.GATHER = timed  # type: ignore[assignment]  # shaped like the module
    if name == "no-checks":
        local_reads._DIGESTS.clear()
    try:
        yield timed
    finally:
        local_reads.GATHER = compiled
        local_reads._DIGESTS.update(digests)


def measure(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """Time every form over the same warm shards; returns the figures."""
    with tempfile.TemporaryDirectory(prefix="cached-fast-parts-") as tmp:
        work = Path(tmp)
        shards = common.write_shards(work / "shards", args.shards, args.samples, args.sample_size)
        socket = f"ipc://{work}/cached.sock"
        capacity = 2 * shards.tar_bytes + (64 << 20)
        with common.Daemon(work / "daemon", socket, work / "hot", capacity) as daemon:
            daemon.prefetch(shards.urls)
            fast = FastLoader(shards.urls, batch_size=args.batch_size, socket=socket)
            common.read_files(shards.paths)
            got = common.fast_pass(fast)  # warm: connections, the daemon's layouts
            if got != (shards.samples, shards.payload_bytes):
                raise RuntimeError(f"a pass read {got}, want {shards.samples} samples")
            wall: dict[str, list[float]] = {f: [] for f in FORMS}
            cpu: dict[str, list[float]] = {f: [] for f in FORMS}
            dcpu: dict[str, list[float]] = {f: [] for f in FORMS}
            reads: dict[str, list[float]] = {f: [] for f in FORMS}
            for _ in range(args.repeats):
                for name in FORMS:
                    c0, d0, t0 = time.process_time(), daemon.cpu_s(), time.perf_counter()
                    if name == "raw":
                        common.read_files(shards.paths)
                    else:
                        with _form(name) as timed:
                            common.fast_pass(fast)
                        if timed is not None:
                            reads[name].append(timed.seconds)
                    wall[name].append(time.perf_counter() - t0)
                    cpu[name].append(time.process_time() - c0)
                    dcpu[name].append(daemon.cpu_s() - d0)
    raw = statistics.median(wall["raw"])
    rows: dict[str, dict[str, Any]] = {}
    log(
        f"{'form':<12} {'pass ms':>8} {'x raw':>6} {'in C ms':>8} {'client CPU ms':>14} "
        f"{'daemon CPU ms':>14}"
    )
    for name in FORMS:
        median = statistics.median(wall[name])
        in_c = statistics.median(reads[name]) if reads[name] else None
        rows[name] = {
            "pass_s": median,
            "vs_raw": raw / median,
            "compiled_read_s": in_c,
            "client_cpu_s": statistics.median(cpu[name]),
            "daemon_cpu_s": statistics.median(dcpu[name]),
            "runs_s": wall[name],
        }
        r = rows[name]
        c_ms = f"{in_c * 1e3:8.1f}" if in_c is not None else f"{'':>8}"
        log(
            f"{name:<12} {median * 1e3:8.1f} {raw / median:5.2f}x {c_ms} "
            f"{r['client_cpu_s'] * 1e3:14.0f} {r['daemon_cpu_s'] * 1e3:14.0f}"
        )
    full, no_checks = rows["full"], rows["no-checks"]
    log(
        f"the parts of a full pass: copies {no_checks['compiled_read_s'] * 1e3:.1f} ms and "
        f"checks {(full['compiled_read_s'] - no_checks['compiled_read_s']) * 1e3:.1f} ms in "
        f"the compiled reader, the rest (Python, requests, the daemon) "
        f"{(full['pass_s'] - full['compiled_read_s']) * 1e3:.1f} ms; the raw read "
        f"{raw * 1e3:.1f} ms; in Python the pass takes {rows['python']['pass_s'] * 1e3:.1f} ms"
    )
    return {"samples": shards.samples, "payload_bytes": shards.payload_bytes, "forms": rows}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--small", action="store_true", help="CI size: 4 shards, 2 rounds")
    p.add_argument("--shards", type=int, default=64)
    p.add_argument("--samples", type=int, help="samples in all (default 40 a shard)")
    p.add_argument("--sample-size", type=int, default=100_000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, help="alternated rounds (default 9; --small 2)")
    p.add_argument("--out", type=Path, default=common.OUT_DIR)
    args = p.parse_args(argv)
    if args.small:
        args.shards, args.sample_size = 4, 20_000
    args.samples = args.samples or 40 * args.shards
    args.repeats = args.repeats or (2 if args.small else 9)
    info = common.machine()
    log = common.log
    log("FastLoader's local pass, part by part")
    log(common.machine_line(info))
    log(
        f"{args.shards} shards, {args.samples} samples of {args.sample_size} B, batches of "
        f"{args.batch_size}; medians of {args.repeats} alternated rounds"
    )
    began = time.monotonic()
    figures = measure(args, log)
    result = {
        "benchmark": "fast_parts",
        "machine": info,
        "argv": sys.argv[1:] if argv is None else list(argv),
        **figures,
        "elapsed_s": time.monotonic() - began,
        "loadavg_at_end": common.loadavg(),
    }
    path = common.write_json("fast-parts", result, args.out)
    log(
        f"wrote {path} ({result['elapsed_s']:.0f}s in all; load average at the end "
        f"{' '.join(f'{x:.2f}' for x in result['loadavg_at_end'])})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
