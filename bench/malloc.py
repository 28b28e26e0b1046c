"""glibc allocator modes (``$CACHED_CLIENT_MALLOC``) for the processes that read.

``cached_client.memory`` tunes malloc once per process: ``keep`` keeps freed memory,
``single-arena`` adds ``M_ARENA_MAX=1``, ``off`` leaves glibc alone. Which is right where?
A warm ``cached serve`` daemon serves local shards (default 256 MiB of 100 KB samples);
for each mode a fresh subprocess, with ``CACHED_CLIENT_MALLOC=<mode>``, measures:

  dataloader   ``CachedDataset`` in a DataLoader with 2 workers (pure readers): MB/s, and
               the minor faults and kernel CPU time of the process and its workers per pass;
  fast         ``FastLoader`` in the process itself: MB/s, minor faults, kernel CPU per pass;
  train alone  a "training" thread allocating as autograd does (torch CPU tensors of 4 KiB to
               4 MiB, touched and freed, small Python objects, 1-16 KiB buffers): ops/s;
  fast+train   ``FastLoader`` while that thread runs: loader MB/s and training ops/s.

Each measurement (``--passes`` passes of FastLoader, a quarter as many of the DataLoader)
follows an untimed warm-up pass; torch runs one intra-op thread. Modes run round-robin
``--repeats`` times (the starting mode rotates); the table shows medians and each mode's
ratio to ``off``. Results also go to ``bench/out/malloc-<timestamp>.json``.

    python bench/malloc.py            # the full run (about 3 minutes on 2 cores)
    python bench/malloc.py --small    # a smoke run (seconds)
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import multiprocessing
import os
import random
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common
from cached.config import parse_size

MODES = ("off", "keep", "single-arena")
ENV = "CACHED_CLIENT_MALLOC"
ROWS = (  # (key, label) of the table
    ("dl_mb_s", "dataloader w=2 MB/s"),
    ("dl_minflt", "dataloader minflt/pass (all procs)"),
    ("dl_sys_ms", "dataloader sys ms/pass (all procs)"),
    ("dl_rss_mib", "dataloader peak RSS MiB (2 workers)"),
    ("fast_mb_s", "fast MB/s"),
    ("fast_minflt", "fast minflt/pass"),
    ("fast_sys_ms", "fast sys ms/pass"),
    ("train_ops_s", "train alone ops/s"),
    ("both_mb_s", "fast+train loader MB/s"),
    ("both_ops_s", "fast+train train ops/s"),
    ("both_minflt", "fast+train minflt/pass"),
    ("both_sys_ms", "fast+train sys ms/pass"),
    ("maxrss_mib", "peak RSS MiB (main process)"),
)

# -- in the subprocess ----------------------------------------------------------------------


def _usage(pids: Sequence[int]) -> tuple[int, float]:
    """(minor faults, kernel CPU seconds) of this process and of ``pids`` (live children)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    faults, sys_s = r.ru_minflt, r.ru_stime
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()  # fields from the 3rd (state) on
        faults, sys_s = faults + int(fields[7]), sys_s + int(fields[12]) / tick
    return faults, sys_s


def _peak_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))


def _measure(
    name: str,
    one_pass: Callable[[], tuple[int, int]],
    passes: int,
    expect: list[int],
    pids: Sequence[int] = (),
) -> dict[str, float]:
    f0, s0 = _usage(pids)
    started = time.perf_counter()
    nbytes = 0
    for _ in range(passes):
        got = one_pass()
        if list(got) != expect:
            raise RuntimeError(f"{name}: a pass delivered {got}, expected {expect}")
        nbytes += got[1]
    secs = time.perf_counter() - started
    f1, s1 = _usage(pids)
    return {
        f"{name}_mb_s": nbytes / secs / common.MB,
        f"{name}_minflt": (f1 - f0) / passes,
        f"{name}_sys_ms": (s1 - s0) * 1000 / passes,
        f"{name}_s": secs,
    }


class Trainer(threading.Thread):
    """Allocation-heavy work as a training step does it: tensors of mixed sizes, touched and
    freed (8 kept alive), small objects as graph nodes, buffers glibc serves."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.ops = 0
        self.halt = threading.Event()

    def run(self) -> None:
        import torch

        rng = random.Random(0)
        live: collections.deque[torch.Tensor] = collections.deque(maxlen=8)
        while not self.halt.is_set():
            nbytes = int(4096 * 1024 ** rng.random())  # 4 KiB .. 4 MiB, log-uniform
            live.append(torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0))
            nodes = [{"op": i, "grad": None, "next": (i, i + 1)} for i in range(64)]
            blob = bytearray(rng.randrange(1024, 16384))
            del nodes, blob
            self.ops += 1

    def rate(self, seconds: float) -> float:
        """Operations per second over the next ``seconds``."""
        ops = self.ops
        time.sleep(seconds)
        return (self.ops - ops) / seconds


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Every measurement of one mode, in this (fresh) process."""
    from cached_client.memory import tune_malloc

    mode = tune_malloc()  # before any thread starts, as the first connection would
    import torch
    from cached_client import CachedDataset, FastLoader
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    out: dict[str, Any] = {"mode": mode}
    urls, socket, expect, passes = spec["urls"], spec["socket"], spec["expect"], spec["passes"]
    # The DataLoader first, while this process has no threads of its own to fork from.
    loader = DataLoader(
        CachedDataset(urls, socket=socket), batch_size=None, num_workers=2, persistent_workers=True
    )
    common.loader_pass(loader)  # warm-up: workers start and connect
    workers = [p.pid for p in multiprocessing.active_children() if p.pid is not None]
    dl_pass = functools.partial(common.loader_pass, loader)
    out.update(_measure("dl", dl_pass, max(1, passes // 4), expect, workers))
    out["dl_rss_mib"] = sum(_peak_rss_kib(pid) for pid in workers) / 1024
    del loader  # the workers exit

    fast = FastLoader(urls, batch_size=spec["batch_size"], socket=socket)
    common.fast_pass(fast)  # warm-up: buffers grow
    fast_pass = functools.partial(common.fast_pass, fast)
    out.update(_measure("fast", fast_pass, passes, expect))
    trainer = Trainer()
    trainer.start()
    out["train_ops_s"] = trainer.rate(spec["train_s"])
    ops = trainer.ops
    out.update(_measure("both", fast_pass, passes, expect))
    out["both_ops_s"] = (trainer.ops - ops) / out["both_s"]
    trainer.halt.set()
    trainer.join()
    out["maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


# -- the benchmark ------------------------------------------------------------------------------


def run_child(mode: str, spec: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        env={**os.environ, ENV: mode},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{mode}: the subprocess failed ({done.returncode}):\n{done.stderr}")
    got: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if got["mode"] != mode:
        raise RuntimeError(f"asked for {ENV}={mode}, the subprocess ran {got['mode']}")
    return got


def table(medians: dict[str, dict[str, float]], repeats: int) -> str:
    head = f"{f'median of {repeats}':<36}" + "".join(f"{m:>19}" for m in MODES)
    lines = [head, "-" * len(head)]
    for key, label in ROWS:
        base = medians["off"][key]
        cells = "".join(
            f"{medians[m][key]:>12,.1f} {medians[m][key] / base if base else 0:>5.2f}x"
            for m in MODES
        )
        lines.append(f"{label:<36}{cells}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--small", action="store_true", help="a smoke run: 8 MiB, 1 repeat")
    p.add_argument("--repeats", type=int, help="rounds over the modes (default 5; --small 1)")
    p.add_argument("--total", help="sample payload (default 256MiB; --small 8MiB)")
    p.add_argument("--sample-size", default="100KB", help="sample size (default 100KB)")
    p.add_argument("--shards", type=int, help="shards (default 64; --small 4)")
    p.add_argument(
        "--passes",
        type=int,
        help="FastLoader passes per measurement, a quarter of them for "
        "the DataLoader (default 8; --small 1)",
    )
    p.add_argument("--train-s", type=float, help="train-alone seconds (default 2)")
    p.add_argument("--batch-size", type=int, default=64, help="FastLoader batch size")
    p.add_argument("--out", type=Path, default=common.OUT_DIR, help="where the JSON goes")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.repeats = args.repeats or (1 if args.small else 5)
    args.total = parse_size(args.total or ("8MiB" if args.small else "256MiB"))
    args.sample_size = parse_size(args.sample_size)
    args.shards = args.shards or (4 if args.small else 64)
    args.passes = args.passes or (1 if args.small else 8)
    args.train_s = args.train_s or (0.3 if args.small else 2.0)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    head, started = common.start_run("malloc", "glibc allocator modes of the readers")
    log = common.log
    n = common.samples_for(args.total, args.sample_size, args.shards, 0)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    with common.workdir("cached-bench-malloc-", keep=args.keep) as work:
        shards = common.write_shards(work / "shards", args.shards, n, args.sample_size)
        capacity = shards.tar_bytes * 5 // 4 + (256 << 20)
        socket = f"ipc://{work}/cached.sock"
        with common.Daemon(work / "daemon", socket, work / "hot", capacity) as daemon:
            log(
                f"{shards.samples:,} samples of {common.human(args.sample_size)} in "
                f"{len(shards.paths)} shards; prefetched in {daemon.prefetch(shards.urls):.1f}s"
            )
            spec = {
                "urls": shards.urls,
                "socket": socket,
                "expect": [shards.samples, shards.payload_bytes],
                "batch_size": args.batch_size,
                "passes": args.passes,
                "train_s": args.train_s,
            }
            for r in range(args.repeats):
                for mode in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:
                    got = run_child(mode, spec)
                    runs[mode].append(got)
                    log(
                        f"  round {r + 1} {mode:<13} dataloader {got['dl_mb_s']:7.1f} MB/s  "
                        f"fast {got['fast_mb_s']:7.1f} MB/s  train {got['train_ops_s']:7.0f}"
                        f" ops/s  fast+train {got['both_mb_s']:7.1f} MB/s"
                        f" {got['both_ops_s']:7.0f} ops/s"
                    )
    medians = {
        m: {key: statistics.median(run[key] for run in runs[m]) for key, _ in ROWS} for m in MODES
    }
    log(f"\n{table(medians, args.repeats)}\n(ratio: against off)")
    settings = {k: v for k, v in vars(args).items() if k not in ("child", "out", "keep")}
    doc = {**head, "settings": settings, "medians": medians, "runs": runs}
    common.finish_run("malloc", doc, started, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
