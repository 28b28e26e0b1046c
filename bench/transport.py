"""The daemon's socket: ``ipc://`` (a Unix domain socket) against ``tcp://127.0.0.1``.

Two ``cached serve`` subprocesses with the same configuration except ``[server] socket``
(one ``ipc://<tmp>/cached.sock``, one ``tcp://127.0.0.1:<free port>``), each with its own
hot tier warmed by ``cached prefetch`` from the same local shards. For 100 KB and 1 KB
samples it measures:

  fast b=B     ``FastLoader`` (payload frames received in place), batches of B;
  cached w=0   ``CachedDataset`` through a DataLoader with no workers, ``batch_size=None``.

Passes are interleaved round-robin over the four configurations, so a noisy neighbour
on a shared machine slows both sockets alike; each configuration gets one untimed warm-up
pass, and the table shows medians and the ratio tcp/ipc of samples/s. Results also
go to ``bench/out/transport-<timestamp>.json``.

    python bench/transport.py             # full size (minutes)
    python bench/transport.py --small     # a smoke run (seconds)
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common
from bench.common import Result, ShardSet


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = common.shard_set_parser(__doc__, "tiny sizes for CI, 1 repeat")
    p.add_argument("--repeats", type=int, help="timed passes per configuration (default 5)")
    args: argparse.Namespace = common.shard_set_args(p, argv, repeats=5)
    return args


def measure_set(
    daemons: dict[str, common.Daemon], shards: ShardSet, args: argparse.Namespace, log: Any
) -> list[Result]:
    """FastLoader and CachedDataset(w=0) against every daemon, passes interleaved."""
    from cached_client import CachedDataset
    from cached_client.fast import FastLoader
    from torch.utils.data import DataLoader

    expect = (shards.samples, shards.payload_bytes)
    fast_specs, cached_specs = [], []
    for name, daemon in daemons.items():
        fast = FastLoader(shards.urls, batch_size=args.batch_size, socket=daemon.socket)
        loader = DataLoader(CachedDataset(shards.urls, socket=daemon.socket), batch_size=None)
        fast_specs.append(
            common.Spec(
                f"fast b={args.batch_size} {name}",
                name,
                functools.partial(common.fast_pass, fast),
                workers=0,
            )
        )
        cached_specs.append(
            common.Spec(
                f"cached w=0 {name}", name, functools.partial(common.loader_pass, loader), workers=0
            )
        )
    results = common.measure_all(
        [*fast_specs, *cached_specs], repeats=args.repeats, expect=expect, log=log
    )
    # Ratio: tcp against ipc for the same client configuration (ipc rows are 1.00x).
    by = {r.config: r for r in results}
    for r in results:
        base = by[r.config.rsplit(" ", 1)[0] + " ipc"]
        r.ratio = r.samples_per_s / base.samples_per_s
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    head, started = common.start_run(
        "transport", "cached transport benchmark: ipc:// vs tcp://127.0.0.1"
    )
    log = common.log
    counts, capacity = common.plan(args)
    doc: dict[str, Any] = {
        **head,
        "settings": {
            "shards": args.shards,
            "total_bytes": args.total,
            "max_samples": args.max_samples,
            "sample_sizes": args.sample_sizes,
            "repeats": args.repeats,
            "fast_batch_size": args.batch_size,
        },
        "variants": [],
    }
    with common.workdir("cached-bench-transport-", keep=args.keep) as work:
        sockets = {
            "ipc": f"ipc://{work}/cached.sock",
            "tcp": f"tcp://127.0.0.1:{common.free_tcp_port()}",
        }
        daemons = {
            name: common.Daemon(work / name, socket, work / f"hot-{name}", capacity, name=name)
            for name, socket in sockets.items()
        }
        try:
            for daemon in daemons.values():
                daemon.start()
            log("sockets: " + ", ".join(f"{n} {d.socket}" for n, d in daemons.items()))
            for size, n in counts.items():
                shards = common.write_shards(work / f"shards-{size}", args.shards, n, size)
                log(
                    f"\n== {common.human(size)} samples: {shards.samples:,} samples in "
                    f"{len(shards.paths)} shards, {common.human(shards.payload_bytes)} payload"
                )
                try:
                    prefetch = {name: d.prefetch(shards.urls) for name, d in daemons.items()}
                    results = measure_set(daemons, shards, args, log)
                finally:
                    for path in shards.paths:
                        path.unlink(missing_ok=True)
                log(
                    f"\n{common.human(size)} samples ({shards.samples:,} samples, "
                    f"{common.human(shards.payload_bytes)}), median of {args.repeats}; "
                    f"ratio = samples/s against the same client over ipc\n"
                    + common.table(results, "vs ipc")
                )
                doc["variants"].append(
                    {
                        "sample_size": size,
                        "shards": len(shards.paths),
                        "samples": shards.samples,
                        "payload_bytes": shards.payload_bytes,
                        "tar_bytes": shards.tar_bytes,
                        "sockets": sockets,
                        "prefetch_s": prefetch,
                        "results": [r.record() for r in results],
                    }
                )
        except BaseException:
            for daemon in daemons.values():
                if daemon.proc is not None:
                    print(f"--- end of {daemon.log}:\n{daemon.log_tail()}", file=sys.stderr)
            raise
        finally:
            for daemon in daemons.values():
                daemon.stop()
    common.finish_run("transport", doc, started, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
