"""Epochs against a slow store: lookahead on and off, eviction policies, one run.

A real ``cached serve`` reads WebDataset shards from moto's S3 server behind a shaped
link (``bench/shaping.py``): its rate is limited by ``tc tbf`` on a veth pair into a
network namespace (or a token-bucket proxy where that cannot be set up), and a delaying
TCP proxy in front adds ``--latency-ms`` one way, so every request costs a round trip
before its first byte, as S3 in another region does. A training loop reads
the shards through ``CachedDataset(shuffle=True, seed=0)`` in a DataLoader (1 worker),
for several epochs (``set_epoch(e)`` each), and "computes" for a fixed time per batch,
sized so the loop consumes bytes about as fast as the link delivers them.

Every configuration gets a fresh daemon with an empty hot tier:

  scenario  fits   the hot tier holds the whole dataset: epoch 0 misses everything, later
                   epochs hit. The question: does lookahead cut epoch 0's data wait?
            2x     the dataset is twice the hot tier, so every shuffled epoch fetches again.
                   The question: how many bytes each policy fetches per epoch.
  lookahead on     ``[prefetch] lookahead`` = a share of the hot tier (default 25 %)
            off    ``lookahead = 0``: fetch on demand only
  policy           ``[cache] policy`` = belady or lru (a policy the daemon's config rejects
                   is skipped, with the reason)

Per epoch: wall time of the loop, the data-wait fraction (time blocked in ``next()`` on
the DataLoader / loop time, as ``StallMeter`` measures it), bytes fetched from the store
(the daemon's ``fetched_bytes`` counter, before and after), hits, misses, evictions.
The configurations run round-robin ``--repeats`` times (medians are shown). Then the
ratios: epoch-0 wait fraction lookahead on / off, bytes fetched per epoch belady / lru.
Results also go to ``bench/out/epochs-<timestamp>.json``. See docs/benchmarks.md.

    python bench/epochs.py                  # the full run (a few minutes)
    python bench/epochs.py --latency-ms 0   # the link's rate alone
    python bench/epochs.py --small          # a smoke run for CI (seconds)
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common, shaping
from cached.config import parse_size
from cached_demo.stack import DaemonProcess, write_config

BUCKET = "bench-epochs"
POLICIES = ("belady", "lru")
SCENARIOS = ("fits", "2x")
SEED = 0
# The defaults put the cold epoch where the question has an answer. One way; a request's
# round trip is twice it: 100 ms is S3 in another region (200 ms before each GET's first
# byte). A 1 MiB shard crosses the 64 Mbit/s link in about 140 ms, so the link stays full
# only with about 1 + 200/140 = 2.4 downloads in flight: the ratio of a 100 MB shard on a
# ~6 Gbit/s node link to the same store. One DataLoader worker: a reader keeps 2 downloads
# in flight by demand alone (the shard it waits for and the next), below that need and
# below the daemon's 4 download slots, which lookahead can fill. (Two workers' demands
# already take all 4 slots; see docs/benchmarks.md.) --small keeps a token delay: the
# proxy is exercised, the smoke run stays fast.
LATENCY_MS = 100.0
SMALL_LATENCY_MS = 2.0


# -- what runs ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """One daemon configuration of the matrix."""

    scenario: str  # "fits" or "2x"
    lookahead: bool
    policy: str

    @property
    def name(self) -> str:
        return f"{self.scenario} lookahead={'on' if self.lookahead else 'off'} {self.policy}"


@dataclass
class Epoch:
    """What one epoch of one run measured."""

    epoch: int
    wall_s: float
    wait_s: float
    first_batch_s: float  # until the first batch: (worker start-up and) the first shard
    batches: int
    samples: int
    payload_bytes: int
    fetched_bytes: int
    hits: int
    misses: int
    evictions: int
    prefetches: int  # prefetch downloads the daemon started ahead of the readers

    @property
    def wait_fraction(self) -> float:
        return self.wait_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class Run:
    """One configuration, once: a fresh daemon, ``--epochs`` epochs."""

    config: Config
    capacity: int
    lookahead_bytes: int
    epochs: list[Epoch] = field(default_factory=list)
    fetched_after: int = 0  # fetched after the last epoch ended (lookahead past the end)
    start_s: float = 0.0  # the daemon's start, until it answered
    total_s: float = 0.0  # the whole run: start, epochs, settling, stop
    error: str = ""

    def record(self) -> dict[str, Any]:
        return {
            "capacity_bytes": self.capacity,
            "lookahead_bytes": self.lookahead_bytes,
            "epochs": [
                {**vars(e), "wait_fraction": round(e.wait_fraction, 4)} for e in self.epochs
            ],
            "fetched_after_last_epoch": self.fetched_after,
            "daemon_start_s": round(self.start_s, 3),
            "total_s": round(self.total_s, 3),
            "error": self.error,
        }


@dataclass
class Plan:
    """The dataset and the loop: sizes and timings shared by every configuration."""

    urls: list[str]
    shards: common.ShardSet
    batch_compute_s: float
    capacities: dict[str, int]
    shuffle_buffer: int


# -- the daemon ---------------------------------------------------------------------------------


class Daemon(DaemonProcess):
    """``cached serve`` against the shaped endpoint; config, log and hot tier in ``workdir``."""

    def __init__(
        self, workdir: Path, endpoint: str, capacity: int, lookahead: int, policy: str
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        socket = f"ipc://{workdir}/cached.sock"
        config = write_config(
            workdir / "daemon.toml",
            {
                "server": {"socket": socket, "http": "127.0.0.1:0"},
                "cache": {
                    "dir": str(workdir / "hot"),
                    "capacity": capacity,
                    "min_free": 0,
                    "policy": policy,
                },
                "s3": {"endpoint_url": endpoint, "addressing_style": "path"},
                "prefetch": {"lookahead": lookahead},
            },
        )
        env = {
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        super().__init__(config, socket, env=env, log=workdir / "daemon.log")

    def counters(self) -> dict[str, int]:
        """The daemon's counters, and its prefetch count where it has one."""
        status = self.status()
        out = {k: int(v) for k, v in status["counters"].items()}
        out["prefetches"] = int((status.get("prefetch") or {}).get("prefetches") or 0)
        return out

    def settle(self, timeout_s: float) -> None:
        """Wait until no download is in flight (lookahead past the last epoch), at most
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.status()["hot"]["fetching_shards"] and time.monotonic() < deadline:
            time.sleep(0.2)


def rejected(policy: str, config_path: Path) -> str | None:
    """Why the daemon would refuse ``policy`` (its config check or its registry), or None."""
    from cached.config import load
    from cached.errors import ConfigError
    from cached.policy import make_policy

    try:
        load(config_path, env={})
        make_policy(policy)
    except (ConfigError, KeyError) as exc:
        return str(exc).strip("'\"")
    return None


# -- one run ------------------------------------------------------------------------------------


def run_config(
    cfg: Config, plan: Plan, endpoint: str, work: Path, args: argparse.Namespace
) -> Run | str:
    """A fresh daemon and ``args.epochs`` epochs of the loop; a string if the policy is
    rejected (skipped)."""
    capacity = plan.capacities[cfg.scenario]
    lookahead = int(capacity * args.lookahead_share) if cfg.lookahead else 0
    run = Run(cfg, capacity, lookahead)
    daemon = Daemon(work, endpoint, capacity, lookahead, cfg.policy)
    why = rejected(cfg.policy, daemon.config)
    if why is not None:
        return why
    started = time.perf_counter()
    try:
        with daemon:
            run.start_s = time.perf_counter() - started
            loop(daemon, plan, run, args)
            before = daemon.counters()["fetched_bytes"]
            daemon.settle(10.0)
            run.fetched_after = daemon.counters()["fetched_bytes"] - before
    except Exception as exc:
        run.error = f"{type(exc).__name__}: {exc}"
        common.log(f"  FAILED {cfg.name}: {run.error}\n--- end of {daemon.log}:")
        common.log(daemon.log_tail(3000))
    run.total_s = time.perf_counter() - started
    return run


def loop(daemon: Daemon, plan: Plan, run: Run, args: argparse.Namespace) -> None:
    """The training loop: ``args.epochs`` shuffled epochs, a fixed compute time per batch;
    appends each epoch's measures to ``run.epochs``."""
    from cached_client import CachedDataset
    from cached_client.device import StallMeter
    from torch.utils.data import DataLoader

    ds = CachedDataset(
        plan.urls,
        socket=daemon.socket,
        shuffle=True,
        seed=SEED,
        shuffle_buffer=plan.shuffle_buffer,
    )
    loader = DataLoader(
        ds,
        batch_size=args.batch_size,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        collate_fn=list,  # a batch is the list of sample dicts: nothing to stack
    )
    meter = StallMeter()
    try:
        for epoch in range(args.epochs):
            ds.set_epoch(epoch)
            meter.reset()
            before = daemon.counters()
            samples = nbytes = 0
            first_s, t0 = -1.0, time.perf_counter()
            for batch in meter.wrap(loader):
                if first_s < 0:
                    first_s = time.perf_counter() - t0
                samples += len(batch)
                nbytes += sum(len(v) for s in batch for v in s.values() if isinstance(v, bytes))
                time.sleep(plan.batch_compute_s)  # the model's step: GPU busy, loop idle
            after = daemon.counters()
            if samples != plan.shards.samples:
                raise RuntimeError(
                    f"epoch {epoch} delivered {samples} samples, expected {plan.shards.samples}"
                )
            delta = {k: after[k] - before.get(k, 0) for k in after}
            e = Epoch(
                epoch=epoch,
                wall_s=meter.total_s,
                wait_s=meter.wait_s,
                first_batch_s=first_s,
                batches=meter.batches,
                samples=samples,
                payload_bytes=nbytes,
                fetched_bytes=delta["fetched_bytes"],
                hits=delta["hits"],
                misses=delta["misses"],
                evictions=delta["evictions"],
                prefetches=delta["prefetches"],
            )
            run.epochs.append(e)
            common.log(
                f"  {run.config.name:<28} epoch {epoch}: {e.wall_s:6.2f}s, waited "
                f"{e.wait_fraction:4.0%} (first batch {e.first_batch_s:.2f}s), fetched "
                f"{common.human(e.fetched_bytes):>10}, "
                f"{e.hits} hits / {e.misses} misses / {e.evictions} evictions / "
                f"{e.prefetches} prefetches"
            )
    finally:
        # Stop the workers now, in this process. Left to the garbage collector (a failed
        # epoch's traceback keeps the iterator alive), its __del__ can run in the next
        # configuration's forked workers instead, and fails there ("can only test a child
        # process").
        it = getattr(loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        loader._iterator = None
        del loader, it
        gc.collect()


# -- the tables ---------------------------------------------------------------------------------


def median_epochs(runs: Sequence[Run], epochs: int) -> list[dict[str, float]]:
    """Per epoch, the median of every measure over the runs that completed."""
    done = [r for r in runs if not r.error and len(r.epochs) == epochs]
    out = []
    for i in range(epochs):
        es = [r.epochs[i] for r in done]
        if not es:
            break
        out.append(
            {
                "epoch": i,
                "wall_s": statistics.median(e.wall_s for e in es),
                "wait_fraction": statistics.median(e.wait_fraction for e in es),
                "first_batch_s": statistics.median(e.first_batch_s for e in es),
                "fetched_bytes": statistics.median(e.fetched_bytes for e in es),
                "hits": statistics.median(e.hits for e in es),
                "misses": statistics.median(e.misses for e in es),
                "evictions": statistics.median(e.evictions for e in es),
                "prefetches": statistics.median(e.prefetches for e in es),
                "runs": len(es),
            }
        )
    return out


def table(medians: dict[Config, list[dict[str, float]]], dataset_bytes: int) -> str:
    head = (
        f"{'scenario':<8} {'lookahead':<9} {'policy':<7} {'epoch':>5} {'wall s':>7} "
        f"{'waited':>7} {'first s':>7} {'fetched':>11} {'x data':>7} {'hits':>5} "
        f"{'misses':>6} {'evict':>6} {'prefetch':>8}"
    )
    lines = [head, "-" * len(head)]
    for cfg, rows in medians.items():
        for row in rows:
            lines.append(
                f"{cfg.scenario:<8} {'on' if cfg.lookahead else 'off':<9} {cfg.policy:<7} "
                f"{row['epoch']:>5.0f} {row['wall_s']:>7.2f} {row['wait_fraction']:>7.1%} "
                f"{row['first_batch_s']:>7.2f} "
                f"{common.human(row['fetched_bytes']):>11} "
                f"{row['fetched_bytes'] / dataset_bytes:>6.2f}x {row['hits']:>5.0f} "
                f"{row['misses']:>6.0f} {row['evictions']:>6.0f} {row['prefetches']:>8.0f}"
            )
    return "\n".join(lines)


def ratios(medians: dict[Config, list[dict[str, float]]]) -> tuple[dict[str, Any], list[str]]:
    """The comparisons the benchmark exists for, as numbers and as lines to print."""
    out: dict[str, Any] = {}
    lines: list[str] = []
    by = {(c.scenario, c.lookahead, c.policy): rows for c, rows in medians.items()}
    scenarios = sorted({c.scenario for c in medians}, key=SCENARIOS.index)
    policies = sorted({c.policy for c in medians}, key=POLICIES.index)
    for scenario in scenarios:
        for policy in policies:
            on, off = by.get((scenario, True, policy)), by.get((scenario, False, policy))
            if not on or not off:
                continue
            w_on, w_off = on[0]["wait_fraction"], off[0]["wait_fraction"]
            ratio = w_on / w_off if w_off > 0 else None
            out[f"{scenario}/{policy}/epoch0_wait_on_over_off"] = ratio
            out[f"{scenario}/{policy}/epoch0_wall_on_over_off"] = on[0]["wall_s"] / off[0]["wall_s"]
            lines.append(
                f"{scenario:<4} {policy:<6}: epoch-0 data wait, lookahead on / off: "
                f"{w_on:.1%} / {w_off:.1%} = "
                + ("n/a" if ratio is None else f"{ratio:.2f}x")
                + f"; epoch-0 wall {on[0]['wall_s']:.2f}s / {off[0]['wall_s']:.2f}s"
            )
    for scenario in scenarios:
        for lookahead in (True, False):
            bel, lru = by.get((scenario, lookahead, "belady")), by.get((scenario, lookahead, "lru"))
            if not bel or not lru:
                continue
            per = []
            total_b, total_l = (sum(r["fetched_bytes"] for r in rows) for rows in (bel, lru))
            for b, lr in zip(bel, lru, strict=False):
                r = b["fetched_bytes"] / lr["fetched_bytes"] if lr["fetched_bytes"] else None
                out[
                    f"{scenario}/lookahead={'on' if lookahead else 'off'}/epoch{b['epoch']:.0f}"
                    "_fetched_belady_over_lru"
                ] = r
                per.append("n/a" if r is None else f"{r:.2f}x")
            total = total_b / total_l if total_l else None
            out[
                f"{scenario}/lookahead={'on' if lookahead else 'off'}/all_fetched_belady_over_lru"
            ] = total
            lines.append(
                f"{scenario:<4} lookahead {'on ' if lookahead else 'off'}: bytes fetched per "
                f"epoch, belady / lru: {' '.join(per)}"
                + ("" if total is None else f" (all epochs {total:.2f}x)")
            )
    return out, lines


# -- the run ------------------------------------------------------------------------------------


def prepare(args: argparse.Namespace, work: Path) -> tuple[common.ShardSet, list[str]]:
    """Write the shards locally; returns them and their s3:// URLs (uploaded later)."""
    samples = max(args.shards, args.shards * args.shard_size // args.sample_size)
    shards = common.write_shards(work / "shards", args.shards, samples, args.sample_size)
    urls = [f"s3://{BUCKET}/epochs/{p.name}" for p in shards.paths]
    return shards, urls


def uploader(shards: common.ShardSet) -> shaping.Populate:
    """Put the shards into the (still unshaped) store."""

    def upload(endpoint: str) -> None:
        client = shaping.s3_client(endpoint)
        client.create_bucket(Bucket=BUCKET)
        for path in shards.paths:
            client.upload_file(str(path), BUCKET, f"epochs/{path.name}")

    return upload


def matrix(args: argparse.Namespace) -> list[Config]:
    return [
        Config(scenario, lookahead, policy)
        for scenario in args.scenarios
        for lookahead in (True, False)
        for policy in args.policies
    ]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--small", action="store_true", help="tiny sizes for CI (seconds)")
    p.add_argument("--shards", type=int, help="shards in the dataset (default 48; --small 16)")
    p.add_argument("--shard-size", help="payload per shard (default 1MiB; --small 64KiB)")
    p.add_argument("--sample-size", help="bytes per sample (default 100KB; --small 8KB)")
    p.add_argument("--rate", type=float, help="link limit, Mbit/s per direction (default 64)")
    p.add_argument(
        "--latency-ms",
        type=float,
        help="one-way delay of the link, ms: a request's round trip is twice it (default "
        f"{LATENCY_MS:g}; --small {SMALL_LATENCY_MS:g}; 0: the rate limit alone)",
    )
    p.add_argument("--epochs", type=int, help="epochs per configuration (default 3; --small 2)")
    p.add_argument("--workers", type=int, help="DataLoader workers (default 1)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per batch (8)")
    p.add_argument(
        "--compute-ratio",
        type=float,
        default=1.0,
        help="compute time per batch / the link's time for the batch's bytes (1.0: the "
        "loop consumes as fast as the link delivers)",
    )
    p.add_argument(
        "--shuffle-buffer",
        type=int,
        help="CachedDataset shuffle_buffer in samples (default: one shard's samples; the "
        "client's own default, 1000, holds back every sample of a small epoch until the "
        "reader's whole share is fetched, which hides any overlap of fetching and compute)",
    )
    p.add_argument(
        "--lookahead-share",
        type=float,
        default=0.25,
        help="lookahead 'on' = this share of the hot tier's capacity (0.25)",
    )
    p.add_argument(
        "--policy",
        action="append",
        default=[],
        help="eviction policies, repeatable or comma-separated (default belady,lru)",
    )
    p.add_argument(
        "--scenario",
        action="append",
        default=[],
        help="fits (dataset fits the hot tier) and/or 2x (dataset = 2x the hot tier)",
    )
    p.add_argument("--repeats", type=int, default=1, help="runs per configuration (1)")
    p.add_argument(
        "--shaping",
        choices=("auto", "netns", "proxy"),
        default="auto",
        help="how to slow the link: netns (tc tbf), proxy, or auto (netns, else proxy)",
    )
    p.add_argument("--out", type=Path, default=common.OUT_DIR, help="where the JSON goes")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = p.parse_args(argv)
    args.shards = args.shards or (16 if args.small else 48)
    args.shard_size = parse_size(args.shard_size or ("64KiB" if args.small else "1MiB"))
    args.sample_size = parse_size(args.sample_size or ("8KB" if args.small else "100KB"))
    args.rate = args.rate or 64.0
    if args.latency_ms is None:
        args.latency_ms = SMALL_LATENCY_MS if args.small else LATENCY_MS
    args.epochs = args.epochs or (2 if args.small else 3)
    args.workers = args.workers if args.workers is not None else 1
    args.policies = _names(args.policy, POLICIES, "policy")
    args.scenarios = _names(args.scenario, SCENARIOS, "scenario", known=SCENARIOS)
    if args.epochs < 1 or args.repeats < 1:
        p.error("--epochs and --repeats must be at least 1")
    if args.latency_ms < 0:
        p.error("--latency-ms must not be negative")
    return args


def _names(
    values: Sequence[str], default: Sequence[str], what: str, known: Sequence[str] = ()
) -> list[str]:
    names = [v.strip() for vs in values for v in vs.split(",") if v.strip()] or list(default)
    bad = [n for n in names if known and n not in known]
    if bad:
        raise SystemExit(f"unknown {what} {', '.join(bad)}; known: {', '.join(known)}")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    head, started = common.start_run("epochs", "cached epochs benchmark (a rate-shaped S3 store)")
    log = common.log
    doc: dict[str, Any] = {
        **head,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "policy", "scenario")},
    }
    doc["settings"]["out"] = str(args.out)
    doc["source_digest_at_start"] = common.source_digest()
    with common.workdir("cached-bench-epochs-", keep=args.keep) as work:
        shards, urls = prepare(args, work)
        log(
            f"dataset: {len(urls)} shards, {shards.samples:,} samples of "
            f"{common.human(args.sample_size)}, {common.human(shards.tar_bytes)} of tar"
        )
        with shaping.shaped_s3(
            args.rate,
            latency_ms=args.latency_ms,
            populate=uploader(shards),
            method=args.shaping,
            probe_bytes=min(4_000_000, max(1_000_000, shards.tar_bytes // 4)),
            server_log=work / "moto.log",
            log=log,
        ) as s3:
            doc["shaping"] = s3.record()
            log(
                f"shaping: {s3.method}: {s3.detail}\nshaping: a probe download ran at "
                f"{s3.measured_mbit:.1f} Mbit/s through it ({s3.measured_mbit / args.rate:.0%} "
                f"of the limit; {s3.unshaped_mbit:.0f} Mbit/s unshaped); a HEAD took "
                f"{s3.request_ms:.0f} ms ({s3.unshaped_request_ms:.0f} ms unshaped)"
            )
            plan = make_plan(args, shards, urls, s3.measured_mbit)
            doc["plan"] = {
                "batch_compute_s": plan.batch_compute_s,
                "shuffle_buffer": plan.shuffle_buffer,
                "capacities": plan.capacities,
                "dataset_tar_bytes": shards.tar_bytes,
                "samples": shards.samples,
            }
            runs, skipped = run_all(args, plan, s3.endpoint_url, work)
    medians = {cfg: median_epochs(rs, args.epochs) for cfg, rs in runs.items()}
    medians = {cfg: rows for cfg, rows in medians.items() if rows}
    log(
        f"\nmedian of {args.repeats} run(s) per configuration; 'waited' = time blocked on the "
        f"next batch / loop time;\n'x data' = fetched / the dataset "
        f"({common.human(shards.tar_bytes)} of tar)"
    )
    log(table(medians, shards.tar_bytes))
    summary, lines = ratios(medians)
    log("")
    for line in lines:
        log(line)
    for cfg, why in skipped.items():
        log(f"skipped {cfg.name}: {why}")
    failed = any(r.error for rs in runs.values() for r in rs)
    common.note_source_change(doc)
    doc["configurations"] = [
        {
            "scenario": cfg.scenario,
            "lookahead": cfg.lookahead,
            "policy": cfg.policy,
            "skipped": skipped.get(cfg, ""),
            "runs": [r.record() for r in runs.get(cfg, [])],
            "median": medians.get(cfg, []),
        }
        for cfg in matrix(args)
    ]
    doc["ratios"] = summary
    common.finish_run("epochs", doc, started, args.out)
    return 1 if failed else 0


def make_plan(
    args: argparse.Namespace, shards: common.ShardSet, urls: list[str], link_mbit: float
) -> Plan:
    """Hot tier sizes and the per-batch compute time.

    Compute is sized against the *measured* link rate, so "as fast as the link" holds
    whichever shaping method ran and however close it came to its limit."""
    largest = max(p.stat().st_size for p in shards.paths)
    capacities = {
        # Room for every shard plus downloads in flight ([prefetch] concurrency is 4).
        "fits": shards.tar_bytes + 4 * largest,
        "2x": shards.tar_bytes // 2,
    }
    batch_bytes = shards.tar_bytes / shards.samples * args.batch_size
    batch_compute_s = batch_bytes * 8 / (link_mbit * 1e6) * args.compute_ratio
    # The buffer fills completely before it yields anything: sized to a shard, a reader
    # starts handing out samples after its first shard, as a streaming pipeline would.
    shuffle_buffer = args.shuffle_buffer or max(1, shards.samples // len(shards.paths))
    common.log(
        f"loop: batches of {args.batch_size} ({common.human(batch_bytes)}), "
        f"{batch_compute_s * 1000:.0f} ms compute each, {args.workers} DataLoader worker(s), "
        f"shuffle buffer {shuffle_buffer} samples; hot tier "
        f"{common.human(capacities['fits'])} (fits) / {common.human(capacities['2x'])} (2x); "
        f"lookahead on = {args.lookahead_share:.0%} of it"
    )
    return Plan(urls, shards, batch_compute_s, capacities, shuffle_buffer)


def run_all(
    args: argparse.Namespace, plan: Plan, endpoint: str, work: Path
) -> tuple[dict[Config, list[Run]], dict[Config, str]]:
    """Every configuration ``args.repeats`` times, round-robin (neighbours' load on a shared
    machine spreads over all configurations instead of skewing one)."""
    runs: dict[Config, list[Run]] = {}
    skipped: dict[Config, str] = {}
    for rep in range(args.repeats):
        common.log(f"\n-- pass {rep + 1} of {args.repeats}")
        for i, cfg in enumerate(matrix(args)):
            if cfg in skipped:
                continue
            got = run_config(cfg, plan, endpoint, work / f"r{rep}-c{i}", args)
            if isinstance(got, str):
                skipped[cfg] = got
                common.log(
                    f"  skipping {cfg.name}: the daemon rejects policy {cfg.policy!r}: {got}"
                )
                continue
            runs.setdefault(cfg, []).append(got)
            # The hot tier's copy is no longer needed; keep /tmp small.
            shutil.rmtree(work / f"r{rep}-c{i}" / "hot", ignore_errors=True)
    return runs, skipped


if __name__ == "__main__":
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    sys.exit(main())
