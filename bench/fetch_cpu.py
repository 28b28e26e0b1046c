"""CPU per MB fetched: what the daemon's fetch path costs, by how the object is checked.

The daemon's S3 source (``cached.sources.s3.S3Source``: aiobotocore, a HEAD then a GET,
the body streamed to a sink) fetches the same objects from the S3 store (``--store``: Ceph
RGW where it can start here, else moto; bench/stores.py), which runs in processes of its
own so that its CPU is not counted. The objects differ only in the full-object checksum
they were uploaded with:

  crc32, crc32c, crc64nvme   checked against the store's checksum as the bytes stream in
  none                       no store checksum: the MD5 of the (plain) ETag is checked
  verify off                 ``[s3] verify_checksum = false``: the size alone

Ceph RGW 16.2 keeps no upload checksum (docs/operations.md, "Ceph's RADOS Gateway"): on
it the three CRC variants are the MD5 path again, so only ``none`` and ``verify off`` run.

For each, the user+system CPU seconds of this process (the event loop and the hashing
threads) per MB delivered, and the MB/s, medians of ``--repeats`` rounds taken in turn
(A B C A B C). The sink discards the bytes: what is measured is the fetch, not the disk.

    python bench/fetch_cpu.py            # 24 objects of 8 MiB per variant, 5 rounds
    python bench/fetch_cpu.py --store moto   # the CRC variants, on moto
    python bench/fetch_cpu.py --small    # a smoke run for CI
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common, stores
from cached.config import load
from cached.sources.s3 import S3Source

BUCKET = "bench-fetch-cpu"
VARIANTS = ("crc32", "crc32c", "crc64nvme", "none", "verify off")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--objects", type=int, default=24, help="objects per variant")
    p.add_argument("--size-mib", type=int, default=8, help="size of each object")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--small", action="store_true", help="a smoke run: 2 objects of 1 MiB, once")
    stores.add_argument(p)
    args = p.parse_args(argv)
    if args.small:
        args.objects, args.size_mib, args.repeats = 2, 1, 1
    return args


def upload(endpoint: str, variants: Sequence[str], args: argparse.Namespace) -> None:
    import boto3
    from botocore.config import Config

    plain = boto3.client(
        "s3",
        endpoint_url=endpoint,
        config=Config(request_checksum_calculation="when_required"),
    )
    checked = boto3.client("s3", endpoint_url=endpoint)
    plain.create_bucket(Bucket=BUCKET)
    body = os.urandom(args.size_mib << 20)
    for variant in variants:
        for i in range(args.objects):
            key = f"{variant.replace(' ', '-')}/{i:04d}.tar"
            if variant in ("none", "verify off"):
                plain.put_object(Bucket=BUCKET, Key=key, Body=body)
            else:
                checked.put_object(
                    Bucket=BUCKET, Key=key, Body=body, ChecksumAlgorithm=variant.upper()
                )


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def fetch_all(endpoint: str, variant: str, args: argparse.Namespace) -> tuple[float, float]:
    """(CPU ms per MB, MB/s) of fetching the variant's objects one after another."""
    cfg = load(
        None,
        env={},
        overrides={"s3.endpoint_url": endpoint, "s3.verify_checksum": variant != "verify off"},
    )
    prefix = variant.replace(" ", "-")
    async with S3Source(cfg.s3) as src:

        async def sink(_run: Sequence[bytes]) -> None:
            return None

        # One object first: connections and botocore's lazy setup are not the fetch path.
        await src.fetch(await src.head(f"s3://{BUCKET}/{prefix}/0000.tar"), sink)
        cpu0, wall0 = cpu_s(), time.perf_counter()
        for i in range(args.objects):
            info = await src.head(f"s3://{BUCKET}/{prefix}/{i:04d}.tar")
            await src.fetch(info, sink)
        cpu, wall = cpu_s() - cpu0, time.perf_counter() - wall0
    mb = args.objects * (args.size_mib << 20) / 1e6
    return 1000 * cpu / mb, mb / wall


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    doc: dict[str, Any] = {"machine": common.machine(), "args": vars(args)}
    common.log("cached fetch CPU: CPU per MB of the daemon's S3 source, by checksum")
    common.log(common.machine_line(doc["machine"]))
    with (
        common.workdir("cached-bench-fetch-cpu-") as work,
        stores.s3_store(args.store, work) as store,
    ):
        common.log(store.describe())
        doc["store"] = store.kind
        endpoint = store.endpoint_url
        # RGW drops upload checksums: its CRC variants would be the MD5 path again.
        variants = VARIANTS if store.kind == "moto" else ("none", "verify off")
        upload(endpoint, variants, args)
        runs: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
        for _ in range(args.repeats):
            for variant in variants:  # in turn, so that load drifts hit each alike
                runs[variant].append(asyncio.run(fetch_all(endpoint, variant, args)))
    base = statistics.median(ms for ms, _ in runs["none"])
    lines = [f"{'checked by':<12} {'CPU ms/MB':>10} {'MB/s':>8} {'CPU vs MD5':>11}"]
    for variant, got in runs.items():
        ms = statistics.median(m for m, _ in got)
        rate = statistics.median(r for _, r in got)
        lines.append(f"{variant:<12} {ms:>10.2f} {rate:>8.0f} {ms / base:>10.2f}x")
    common.log(
        f"\n{args.objects} objects of {args.size_mib} MiB per variant from {store.kind}, "
        f"medians of {args.repeats}; load {common.loadavg()}\n" + "\n".join(lines)
    )
    doc["runs"] = runs
    common.write_json("fetch-cpu", doc)
    return 0


if __name__ == "__main__":
    common.exit_on_sigterm()
    sys.exit(main())
