"""What checking every served member's checksum costs: serve throughput with and without.

Two ``cached serve`` daemons run side by side on the same shards, one as shipped (every
read checks the XXH3 checksum of each member it sends, ``[cache] verify_reads``), one with
the check off; each has its own warm hot tier. ``FastLoader`` and ``CachedDataset`` (no
workers) read every shard set from both, passes interleaved round-robin, and the table
shows medians, the on/off ratio and the daemon's CPU seconds per GB served (from
/proc, so a loaded machine moves it less than wall time). Results also go to
``bench/out/verify-<timestamp>.json``. The figures are in docs/decisions.md, D21.

    python bench/verify.py                # 100 KB, 1 KB and 4 MB samples, 5 repeats
    python bench/verify.py --small        # a smoke run (seconds)
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common

MODES = ("on", "off")


class ModeDaemon(common.Daemon):
    """A benchmark daemon whose per-read checks are on or off."""

    def __init__(self, work: Path, mode: str, capacity: int) -> None:
        socket = f"ipc://{work}/{mode}.sock"
        super().__init__(work / mode, socket, work / f"hot-{mode}", capacity, name=mode)
        self.mode = mode
        # [cache] verify_reads, through the environment (it overrides the config file).
        self.env["CACHED_CACHE_VERIFY_READS"] = "true" if mode == "on" else "false"


def check_cost(shards: common.ShardSet, repeats: int) -> dict[str, float]:
    """CPU seconds per GB of payload for the daemon's read path alone, in this process:
    slicing the members out of the shard's mapping in reads of about 4 MiB, then with
    ``first_bad`` (what ``HotTier.read`` adds), and with candidate hashes in its place.
    No sockets, so the figures are steady where the end-to-end ones move with the load."""
    import hashlib
    import mmap
    import zlib

    import xxhash

    from cached.tiers.index import Member, TarIndexer
    from cached.tiers.verify import ALGORITHM, StreamSums, first_bad

    maps, indexes = [], []
    for path in shards.paths:
        data = path.read_bytes()
        indexer, sums = TarIndexer(str(path)), StreamSums()
        indexer.feed(data)
        sums.update(data, indexer.found)
        indexes.append(indexer.finish().with_checksums(sums.member_sums, ALGORITHM))
        with open(path, "rb") as fh:
            maps.append(memoryview(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)))
    step = max(1, (4 << 20) // max(1, shards.sample_size))  # samples per read

    def check(view: memoryview, picked: list[Member]) -> None:
        assert first_bad(view, picked) is None

    def hashing(fn: Any) -> Any:
        def run(view: memoryview, picked: list[Member]) -> None:
            for m in picked:
                fn(view[m.offset : m.offset + m.size])

        return run

    variants: dict[str, Any] = {
        "slice only": None,
        "first_bad (xxh3_64)": check,
        "xxh3_64": hashing(xxhash.xxh3_64_intdigest),
        "crc32": hashing(zlib.crc32),
        "sha256": hashing(lambda b: hashlib.sha256(b).digest()),
        "blake2b-128": hashing(lambda b: hashlib.blake2b(b, digest_size=16).digest()),
    }

    def one_pass(extra: Any) -> float:
        started = time.process_time()
        for view, index in zip(maps, indexes, strict=True):
            members = [m for s in index.samples for m in s.members]
            for at in range(0, len(members), step):
                picked = members[at : at + step]
                if extra is not None:
                    extra(view, picked)
                _ = [view[m.offset : m.offset + m.size] for m in picked]
        return time.process_time() - started

    gb = shards.payload_bytes / 1e9
    out = {name: min(one_pass(fn) for _ in range(repeats)) / gb for name, fn in variants.items()}
    base = out["slice only"]
    common.log(
        "read path alone, CPU s/GB on top of slicing ("
        + ", ".join(f"{k} +{v - base:.3f}" for k, v in out.items() if k != "slice only")
        + f"; slicing {base:.3f})"
    )
    return out


def run_set(daemons: dict[str, ModeDaemon], shards: common.ShardSet, args: Any) -> dict[str, Any]:
    """Every reader against both daemons on one shard set; returns its record."""
    from cached_client import CachedDataset
    from cached_client.fast import FastLoader

    expect = (shards.samples, shards.payload_bytes)
    specs: list[common.Spec] = []
    cpu: dict[str, list[float]] = {}
    for mode, d in daemons.items():
        d.prefetch(shards.urls)
        for reader, one in (
            (
                "fast",
                functools.partial(
                    common.fast_pass,
                    FastLoader(shards.urls, batch_size=args.batch_size, socket=d.socket),
                ),
            ),
            (
                "cached w=0",
                functools.partial(common.count_dicts, CachedDataset(shards.urls, socket=d.socket)),
            ),
        ):
            name = f"{reader} verify={mode}"
            cpu[name] = []
            specs.append(
                common.Spec(name, reader, functools.partial(common.metered, d, cpu[name], one))
            )
    results = common.measure_all(specs, repeats=args.repeats, expect=expect, log=common.log)
    rows = []
    for r in results:
        # Warm-up passes come first in cpu[...]: leave them out.
        timed = cpu[r.config][-args.repeats :]
        cpu_per_gb = statistics.median(timed) / (shards.payload_bytes / 1e9)
        rows.append({**r.record(), "daemon_cpu_s_per_gb": cpu_per_gb})
    by = {r["config"]: r for r in rows}
    ratios = {}
    for reader in ("fast", "cached w=0"):
        on, off = by[f"{reader} verify=on"], by[f"{reader} verify=off"]
        ratios[reader] = {
            "throughput_on_over_off": on["samples_per_s"] / off["samples_per_s"],
            # CPU time comes in clock ticks: a tiny (--small) pass may read 0 (no ratio).
            "cpu_per_gb_on_over_off": (
                on["daemon_cpu_s_per_gb"] / off["daemon_cpu_s_per_gb"]
                if off["daemon_cpu_s_per_gb"] > 0
                else None
            ),
        }
    head = f"{'config':<22} {'MB/s':>9} {'daemon CPU s/GB':>16}  runs (s)"
    common.log(f"\n{common.human(shards.sample_size)} samples, median of {args.repeats}")
    common.log(head + "\n" + "-" * len(head))
    for row in rows:
        runs = " ".join(f"{s:.2f}" for s in row["runs_s"])
        common.log(
            f"{row['config']:<22} {row['mb_per_s']:>9,.1f} {row['daemon_cpu_s_per_gb']:>16.3f}  "
            f"{runs}"
        )
    for reader, ratio in ratios.items():
        cpu = ratio["cpu_per_gb_on_over_off"]
        common.log(
            f"{reader}: on/off throughput {ratio['throughput_on_over_off']:.3f}x, "
            f"daemon CPU per GB " + (f"{cpu:.3f}x" if cpu is not None else "n/a (too short)")
        )
    return {
        "sample_size": shards.sample_size,
        "samples": shards.samples,
        "payload_bytes": shards.payload_bytes,
        "results": rows,
        "ratios": ratios,
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = common.shard_set_parser(__doc__, "tiny sizes for CI: 8 shards x 2 MiB, 1 repeat")
    p.add_argument("--repeats", type=int, help="timed passes per configuration (default 5)")
    args = common.shard_set_args(p, argv, repeats=5)
    if not any("--sample-size" in a for a in argv):
        args.sample_sizes = [100_000, 1_000, 4_000_000]
    head, started = common.start_run("verify", "cost of checking served members' CRC-32s")
    doc: dict[str, Any] = {**head, "settings": vars(args) | {"out": str(args.out)}, "sets": []}
    counts, capacity = common.plan(args)
    with common.workdir("cached-bench-verify-", keep=args.keep) as work:
        daemons = {mode: ModeDaemon(work, mode, capacity) for mode in MODES}
        try:
            for d in daemons.values():
                d.start()
            for size, n in counts.items():
                shards = common.write_shards(work / f"shards-{size}", args.shards, n, size)
                common.read_files(shards.paths)
                try:
                    record = run_set(daemons, shards, args)
                    record["read_path"] = check_cost(shards, args.repeats)
                    doc["sets"].append(record)
                finally:
                    for path in shards.paths:
                        path.unlink(missing_ok=True)
        finally:
            for d in daemons.values():
                d.stop()
    common.finish_run("verify", doc, started, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
