"""Requests per cold epoch by method, and the daemon's CPU per MB fetched.

A real ``cached serve`` reads ``--shards`` WebDataset shards from the S3 store (``--store``:
Ceph RGW where it can start here, else moto; bench/stores.py) through ``CachedDataset`` in
a DataLoader with ``--workers`` workers: a cold epoch (empty hot tier) and a warm one, a
fresh daemon each round. What is counted is what the store answered (radosgw's ops log,
or moto's request log): every GET and HEAD of the bucket's objects.
The daemon's user+system CPU (``/proc/<pid>/stat``) over the cold epoch is divided by
the bytes it fetched. ``--latency-ms`` puts a delaying proxy between the daemon and the
store (``bench/shaping.py``'s ``DelayingProxy``): every request then costs a round trip of
twice that before its first byte, as a distant store charges.

``--baseline DIR`` runs the daemon of another checkout too (``git worktree add --detach
/tmp/base main``), in turn with this one's, so that before and after come from one run
on one machine: the daemon is started with ``PYTHONPATH=DIR:DIR/client``.

    python bench/cold_requests.py                        # 32 shards of 4 MiB, 3 rounds
    python bench/cold_requests.py --baseline /tmp/base   # and another checkout's daemon
    python bench/cold_requests.py --latency-ms 25        # a store 50 ms away
    python bench/cold_requests.py --store moto           # against moto
    python bench/cold_requests.py --small                # a smoke run for CI
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common, shaping, stores
from cached.demo.stack import DaemonProcess, write_config

BUCKET = "bench-cold-requests"
THIS = "this checkout"
COLUMNS = (
    f"{'daemon':<20} {'GET':>5} {'HEAD':>5} {'total':>6} {'warm req':>9} {'CPU ms/MB':>10} "
    f"{'cold s':>7}"
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shards", type=int, default=32)
    p.add_argument("--shard-mib", type=float, default=4.0, help="size of each shard")
    p.add_argument("--sample-kb", type=int, default=100, help="size of each sample")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--latency-ms", type=float, default=0.0, help="one way, daemon to store")
    p.add_argument("--baseline", type=Path, help="another checkout whose daemon to run too")
    p.add_argument("--small", action="store_true", help="a smoke run: 4 small shards, once")
    stores.add_argument(p)
    p.add_argument("--out", type=Path, default=common.OUT_DIR, help="where the JSON goes")
    args = p.parse_args(argv)
    if args.small:
        args.shards, args.shard_mib, args.sample_kb, args.repeats = 4, 0.25, 8, 1
    return args


def upload(endpoint: str, shards: common.ShardSet) -> list[str]:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket=BUCKET)
    for path in shards.paths:
        client.put_object(Bucket=BUCKET, Key=path.name, Body=path.read_bytes())
    return [f"s3://{BUCKET}/{p.name}" for p in shards.paths]


@contextlib.contextmanager
def delayed(endpoint: str, latency_s: float) -> Iterator[str]:
    """``endpoint`` behind a proxy that delays each byte by ``latency_s`` (0: no proxy)."""
    if not latency_s:
        yield endpoint
        return
    host, port = endpoint.removeprefix("http://").split(":")
    with shaping.DelayingProxy((host, int(port)), latency_s) as proxy:
        yield f"http://127.0.0.1:{proxy.port}"


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    return sum(common.process_cpu(pid))


def read_epoch(socket: str, urls: list[str], workers: int, seed: int) -> int:
    from cached_client import CachedDataset
    from torch.utils.data import DataLoader

    ds = CachedDataset(urls, socket=socket, shuffle=True, seed=seed)
    return sum(1 for _ in DataLoader(ds, batch_size=None, num_workers=workers))


def one_round(
    name: str,
    source: Path | None,
    *,
    urls: list[str],
    endpoint: str,
    store: stores.Store,
    work: Path,
    args: argparse.Namespace,
    seed: int,
) -> dict[str, Any]:
    """A fresh daemon (``source``'s, or this checkout's), a cold epoch and a warm one."""
    run = work / f"{name.replace(' ', '-')}-{seed}"
    run.mkdir()
    socket = f"ipc://{run}/cached.sock"
    config = write_config(
        run / "config.toml",
        {
            "server": {"socket": socket, "http": "127.0.0.1:0"},
            "cache": {"dir": str(run / "hot"), "capacity": "4GiB", "min_free": "0"},
            "s3": {"endpoint_url": endpoint},
        },
    )
    # Safe path: `python -m cached` must not import this working directory's package.
    env = {"PYTHONSAFEPATH": "1"}
    if source is not None:
        env["PYTHONPATH"] = f"{source}:{source / 'client'}"
    out: dict[str, Any] = {}
    with DaemonProcess(config, socket, env=env) as daemon:
        assert daemon.proc is not None
        for epoch in ("cold", "warm"):
            asked = store.requests(BUCKET)
            cpu, wall = cpu_s(daemon.proc.pid), time.perf_counter()
            fetched = daemon.status()["counters"]["fetched_bytes"]
            samples = read_epoch(socket, urls, args.workers, seed)
            wall = time.perf_counter() - wall
            fetched = daemon.status()["counters"]["fetched_bytes"] - fetched
            cpu = cpu_s(daemon.proc.pid) - cpu
            now = store.requests(BUCKET)
            out[epoch] = {
                "samples": samples,
                "wall_s": wall,
                "fetched_bytes": fetched,
                "daemon_cpu_s": cpu,
                "requests": {m: now[m] - asked[m] for m in ("GET", "HEAD")},
            }
    return out


def summary(name: str, rounds: list[dict[str, Any]]) -> str:
    cold = [r["cold"] for r in rounds]
    gets = statistics.median(c["requests"]["GET"] for c in cold)
    heads = statistics.median(c["requests"]["HEAD"] for c in cold)
    warm = statistics.median(sum(r["warm"]["requests"].values()) for r in rounds)
    ms_per_mb = statistics.median(
        1000 * c["daemon_cpu_s"] / (c["fetched_bytes"] / 1e6) for c in cold if c["fetched_bytes"]
    )
    wall = statistics.median(c["wall_s"] for c in cold)
    return (
        f"{name:<20} {gets:>5.0f} {heads:>5.0f} {gets + heads:>6.0f} {warm:>9.0f} "
        f"{ms_per_mb:>10.2f} {wall:>7.2f}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    head, started = common.start_run(
        "cold-requests", "cached cold requests: requests per cold epoch by method, CPU per MB"
    )
    doc: dict[str, Any] = {**head, "args": {k: str(v) for k, v in vars(args).items()}}
    daemons: dict[str, Path | None] = {THIS: None}
    if args.baseline is not None:
        daemons[f"baseline {args.baseline.name}"] = args.baseline.resolve()
    with common.workdir("cached-bench-cold-requests-") as work:
        samples = max(1, int(args.shard_mib * 1024 / args.sample_kb)) * args.shards
        shards = common.write_shards(work / "shards", args.shards, samples, args.sample_kb * 1000)
        with (
            stores.s3_store(args.store, work) as store,
            delayed(store.endpoint_url, args.latency_ms / 1000) as endpoint,
        ):
            common.log(store.describe())
            doc["store"] = store.kind
            urls = upload(store.endpoint_url, shards)
            rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in daemons}
            for seed in range(args.repeats):
                for name, source in daemons.items():  # in turn: load drifts hit each alike
                    got = one_round(
                        name,
                        source,
                        urls=urls,
                        endpoint=endpoint,
                        store=store,
                        work=work,
                        args=args,
                        seed=seed,
                    )
                    rounds[name].append(got)
    lines = [COLUMNS] + [summary(name, got) for name, got in rounds.items()]
    common.log(
        f"\n{args.shards} shards of {common.human(shards.tar_bytes / args.shards)}, "
        f"{args.workers} DataLoader workers, {args.latency_ms:g} ms one way to the store, "
        f"medians of {args.repeats} round(s); "
        f"requests per cold epoch as {store.kind} answered them; CPU: the daemon's, per MB "
        f"fetched in the cold epoch\n" + "\n".join(lines)
    )
    doc["rounds"] = rounds
    common.finish_run("cold-requests", doc, started, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
