"""Fill rate: how fast each S3 client puts a set of objects on local disk, and its CPU per MB.

The daemon's job is to have the next shards in the hot tier before the trainer asks, so
what bounds a node whose data does not fit is how fast, and at what CPU, the daemon can
move bytes from the store to its disk. Side by side, in one run, alternated round by
round, each over the same objects of the same store (``--store``: Ceph RGW where it can
start here, else moto; bench/stores.py):

  cached            a real ``cached serve`` with an empty hot tier, asked to prefetch every
                    object (``open`` with ``prefetch``, twice ``--concurrency`` queued, as
                    ``cached prefetch`` does; its ``[prefetch] concurrency`` one more than
                    ``--concurrency``, since one slot is kept for demand misses: so its
                    GETs in flight are as many as each bare client's); what it does for a
                    cold shard: GET, checksum, tar index, the file published atomically
  cached-native     the same daemon with ``[s3] native_fetch = true``: one GET, awscrt's,
                    its headers describing the object and its body written straight into
                    the hot tier's file, and one native pass
                    over the file indexes and checksums it (D42)
  awscrt            awscrt's ``S3Client`` (the AWS Common Runtime, native threads), each
                    object straight to a file (``recv_filepath``)
  awscrt-indexed    the same, and each file, once in, indexed and checksummed by the
                    daemon's own native pass (``index_file``) in a worker thread: the
                    least work the daemon's fill does, with none of its own overhead
  boto3             ``download_file`` (s3transfer's threads), as most scripts fetch a file
  obstore           obstore's ``get_async`` (Rust, object_store), the body written to a
                    file; litdata's client
  s3torchconnector  its ``S3Client.get_object`` (mountpoint-s3-client, CRT), read and
                    written to a file

Each client but the daemon runs in a subprocess of its own (the peers from
``.venv-peers``, where they are installed; a client that cannot be imported is skipped
with one line), which times only its fetches and reports its own user and system CPU for
them (``getrusage``: every thread of the process). The daemon's CPU is read from
``/proc/<pid>/stat`` around the prefetch. Fill rate: bytes on disk / wall time, first
request to last file closed. Each round removes the previous round's files just before
its interval and writes out what is dirty (``make_room``: on a VM that hands free pages
back to its host, the time since they were freed decides what writing into the page cache
costs). Kernel time is the same work for every client (socket reads, page cache); user
time is each client's own.

    python bench/fetch.py                       # 1, 4, 16, 64 MB objects, 1 and 8 at once
    python bench/fetch.py --sizes 16 --concurrency 4 --repeats 5
    python bench/fetch.py --small               # a smoke run for CI
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common, shaping, stores

ROOT = Path(__file__).resolve().parent.parent
BUCKET = "bench-fetch"
WARM = "warm.tar"
DAEMONS = ("cached", "cached-native")
CLIENTS = (*DAEMONS, "awscrt", "awscrt-indexed", "boto3", "obstore", "s3torchconnector")
# The peers' packages live in .venv-peers (make venv-peers); awscrt and boto3 come with
# the daemon's own environment.
PEERS = {"obstore": "obstore", "s3torchconnector": "s3torchconnector"}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64], help="object sizes, MB")
    p.add_argument("--total-mb", type=int, default=256, help="MB of objects per size")
    p.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 8], help="objects fetched at once"
    )
    p.add_argument("--clients", nargs="+", choices=CLIENTS, default=list(CLIENTS))
    p.add_argument("--repeats", type=int, default=3, help="rounds, clients in turn each")
    p.add_argument("--small", action="store_true", help="a smoke run: 1 and 4 MB, 8 MB each")
    p.add_argument(
        "--daemon-cpus",
        type=int,
        help="pin the daemons' threads to this many CPUs (the first ones), to see how the "
        "fill scales with cores",
    )
    p.add_argument(
        "--rate",
        type=float,
        help="MB/s: the store's responses limited to this on loopback (tc htb by its port; "
        "bench/shaping.py), so that the link, not this machine's cores, bounds the fill",
    )
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="the daemons with [s3] verify_checksum = false: on a store without CRCs (RGW "
        "16.2) no MD5 of the bytes, as the bare clients (which verify nothing)",
    )
    p.add_argument(
        "--checksum",
        choices=("CRC32", "CRC32C", "CRC64NVME"),
        help="upload the objects with this full-object checksum, and run the daemons with "
        "[s3] checksum_head = true, so that they check it (in C) instead of an MD5: the cost "
        "of verification on a store that keeps checksums (S3, moto; RGW 16.2 keeps none)",
    )
    p.add_argument("--out", type=Path, default=common.OUT_DIR, help="where the JSON goes")
    stores.add_argument(p)
    # Internal: one client's fetches, in a subprocess of its own.
    p.add_argument("--worker", choices=CLIENTS[len(DAEMONS) :], help=argparse.SUPPRESS)
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--dest", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--stale", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--keys", nargs="*", default=[], help=argparse.SUPPRESS)
    p.add_argument("--store-pids", type=int, nargs="*", default=[], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.small:
        args.sizes, args.total_mb, args.concurrency, args.repeats = [1, 4], 8, [4], 1
    if any(n < 1 for n in (*args.sizes, *args.concurrency, args.total_mb, args.repeats)):
        p.error("sizes, --total-mb, --concurrency and --repeats must be positive")
    return args


# -- the workers: one client each, in a process of its own ------------------------------------


def make_room(stale: Path | None) -> None:
    """Remove the previous round's files (``stale``) now, just before this round's
    interval, and write out what is dirty.

    The page cache this round fills then takes the pages those files just gave up. On a
    VM that reports free pages to its host (virtio-balloon's free page reporting, as
    here), a page free for more than about half a second has gone back to the host, and
    writing into it again costs 5-10x the system time (0.2 ms/MB into pages just freed,
    1-2 ms/MB after a 3 s pause, measured with plain ``pwrite``). Removed at each round's
    start, the files left the daemon, which starts up for a second or two after that,
    writing into returned pages in most rounds, and the bare clients in few."""
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)
    os.sync()  # no earlier round's writeback inside this one's interval


def cpu_times() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def run_worker(args: argparse.Namespace) -> int:
    """Fetch ``args.keys`` into ``args.dest`` with ``args.worker``, ``args.concurrency[0]``
    at once; print one JSON line: wall, user and system seconds of the fetches alone."""
    make: dict[str, Callable[[str, Path], Fetch]] = {
        "awscrt": _awscrt,
        "awscrt-indexed": functools.partial(_awscrt, indexed=True),
        "boto3": _boto3,
        "obstore": _obstore,
    }
    fetch = make.get(args.worker, _s3torchconnector)(args.endpoint, args.dest)
    fetch([WARM], 1)  # set up and warmed (connections, credentials), untimed
    make_room(args.stale)
    store0 = common.processes_cpu(args.store_pids)
    user0, sys0 = cpu_times()
    wall0 = time.perf_counter()
    fetch(args.keys, args.concurrency[0])
    wall = time.perf_counter() - wall0
    user, system = cpu_times()
    got = {"wall_s": wall, "user_s": user - user0, "sys_s": system - sys0}
    if args.store_pids:  # the store's CPU in the same interval (RGW's processes)
        got["store_s"] = common.processes_cpu(args.store_pids) - store0
    print(json.dumps(got))
    return 0


Fetch = Callable[[list[str], int], None]  # (keys, how many at once): each key to a file


def _host(endpoint: str) -> str:
    return endpoint.removeprefix("http://").removeprefix("https://").rstrip("/")


def _awscrt(endpoint: str, dest: Path, indexed: bool = False) -> Fetch:
    """awscrt's S3 client, each object straight to its file; ``indexed``: each file then
    indexed and checksummed as the daemon's native path does, in a worker thread while
    the next GETs run (the floor of the daemon's own work per shard)."""
    from awscrt.auth import AwsCredentialsProvider
    from awscrt.http import HttpHeaders, HttpRequest
    from awscrt.io import ClientBootstrap, DefaultHostResolver, EventLoopGroup
    from awscrt.s3 import S3Client, S3RequestTlsMode, S3RequestType

    elg = EventLoopGroup()
    bootstrap = ClientBootstrap(elg, DefaultHostResolver(elg))
    creds = AwsCredentialsProvider.new_static(
        os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]
    )
    # No TLS on loopback: the scheme is http, and the port comes with the Host header.
    client = S3Client(
        bootstrap=bootstrap,
        region="us-east-1",
        credential_provider=creds,
        tls_mode=S3RequestTlsMode.DISABLED,
        part_size=8 << 20,
    )

    if indexed:  # bare awscrt imports and starts nothing more
        from cached.hot.scan import index_file

        # The daemon indexes in asyncio's default executor: as many threads (min(32,
        # cpus + 4)).
        pool = concurrent.futures.ThreadPoolExecutor()

    def go(keys: list[str], conc: int) -> None:
        todo = list(keys)
        running: list[tuple[Any, Path]] = []
        scans: list[concurrent.futures.Future[Any]] = []
        while todo or running:
            while todo and len(running) < conc:
                key = todo.pop(0)
                headers = HttpHeaders([("Host", _host(endpoint))])
                request = HttpRequest("GET", f"/{BUCKET}/{key}", headers)
                path = dest / key.replace("/", "_")
                running.append(
                    (
                        client.make_request(
                            type=S3RequestType.GET_OBJECT,
                            request=request,
                            recv_filepath=str(path),
                        ),
                        path,
                    )
                )
            request, path = running.pop(0)
            request.finished_future.result(300)
            if indexed:
                scans.append(pool.submit(index_file, path, str(path)))
        for scan in scans:
            scan.result()  # raises if a file is not a whole tar

    return go


def _boto3(endpoint: str, dest: Path) -> Fetch:
    from concurrent.futures import ThreadPoolExecutor

    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)

    def go(keys: list[str], conc: int) -> None:
        with ThreadPoolExecutor(conc) as pool:
            done = pool.map(
                lambda k: client.download_file(BUCKET, k, str(dest / k.replace("/", "_"))), keys
            )
            list(done)

    return go


def _obstore(endpoint: str, dest: Path) -> Fetch:
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        BUCKET,
        endpoint=endpoint,
        access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        region="us-east-1",
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
    )

    async def one(key: str, gate: asyncio.Semaphore) -> None:
        async with gate:
            got = await obstore.get_async(store, key)
            fd = os.open(dest / key.replace("/", "_"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                async for chunk in got.stream():
                    os.write(fd, chunk)  # a page-cache write, as litdata's
            finally:
                os.close(fd)

    async def all_of(keys: list[str], conc: int) -> None:
        gate = asyncio.Semaphore(conc)
        await asyncio.gather(*(one(k, gate) for k in keys))

    return lambda keys, conc: asyncio.run(all_of(keys, conc))


def _s3torchconnector(endpoint: str, dest: Path) -> Fetch:
    from concurrent.futures import ThreadPoolExecutor

    from s3torchconnector._s3client import S3Client, S3ClientConfig

    client = S3Client(
        "us-east-1", endpoint=endpoint, s3client_config=S3ClientConfig(force_path_style=True)
    )

    def one(key: str) -> None:
        reader = client.get_object(BUCKET, key)
        with open(dest / key.replace("/", "_"), "wb") as f:
            while chunk := reader.read(8 << 20):
                f.write(chunk)

    def go(keys: list[str], conc: int) -> None:
        with ThreadPoolExecutor(conc) as pool:
            list(pool.map(one, keys))

    return go


# -- the driver -------------------------------------------------------------------------------


def interpreter(client: str) -> str | None:
    """The Python that has ``client``'s package: this one, or .venv-peers'; None if none."""
    module = PEERS.get(client)
    if module is None:
        return sys.executable
    for python in (sys.executable, str(ROOT / ".venv-peers" / "bin" / "python")):
        if not Path(python).exists():
            continue
        probe = subprocess.run([python, "-c", f"import {module}"], capture_output=True, check=False)
        if probe.returncode == 0:
            return python
    return None


def upload(
    endpoint: str, sizes: Sequence[int], total_mb: int, checksum: str | None = None
) -> tuple[dict[int, list[str]], dict[int, int]]:
    """``total_mb`` of WebDataset shards per size (at least one; 100 KB samples of random
    bytes), keys ``<size>mb/<n>.tar``, with the full-object ``checksum`` (None: none); and
    each size's exact object size in bytes."""
    import boto3

    from cached_demo.tars import make_tar

    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket=BUCKET)
    # Fetched first by every client, untimed: connections, credentials, lazy set-up.
    client.put_object(Bucket=BUCKET, Key=WARM, Body=make_tar([("w", {"bin": b"w" * 1000})]))
    keys: dict[int, list[str]] = {}
    nbytes: dict[int, int] = {}
    for size in sizes:
        samples = max(1, size * 10 - 1)  # 100 KB each, with headers just under the size
        body = make_tar([(f"s{i:05d}", {"bin": os.urandom(100_000)}) for i in range(samples)])
        nbytes[size] = len(body)
        keys[size] = [f"{size}mb/{i:04d}.tar" for i in range(max(1, total_mb // size))]
        extra = {"ChecksumAlgorithm": checksum} if checksum else {}
        for key in keys[size]:
            client.put_object(Bucket=BUCKET, Key=key, Body=body, **extra)
    return keys, nbytes


def pin_threads(pid: int, cpus: int) -> None:
    """Every thread of process ``pid`` (those it starts later inherit it) on the first
    ``cpus`` CPUs."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), set(range(cpus)))


def run_daemon(
    endpoint: str,
    keys: list[str],
    conc: int,
    run: Path,
    *,
    stale: Path | None,
    native: bool,
    verify: bool,
    cpus: int | None = None,
    checksum_head: bool = False,
    store_pids: Sequence[int] = (),
) -> dict[str, float]:
    """A fresh daemon in ``run``, an empty hot tier: every key prefetched, ``conc`` GETs
    at once, after the previous round's files (``stale``) are removed;
    ``native``: with ``[s3] native_fetch``; ``verify``: ``[s3] verify_checksum``;
    ``cpus``: its threads pinned to that many CPUs; ``checksum_head``: ``[s3]
    checksum_head``; ``store_pids``: the store's processes, whose CPU is read alike."""
    from cached_client.transport import Connection
    from cached_wire.protocol import Op

    s3 = {"native_fetch": native, "verify_checksum": verify, "checksum_head": checksum_head}
    # One download slot is kept for demand misses (D15): ``conc`` prefetches at once, as
    # many GETs as each bare client has in flight, take ``conc + 1`` slots.
    fresh = common.s3_daemon(
        run,
        endpoint,
        "8GiB",
        s3=s3,
        prefetch={"concurrency": conc + 1},
        env={"PYTHONSAFEPATH": "1"},
    )
    socket = fresh.socket
    with fresh as daemon:
        assert daemon.proc is not None
        conn = Connection(socket)
        try:
            urls = [f"s3://{BUCKET}/{k}" for k in keys]
            pid = daemon.proc.pid

            # Warmed first (connections, credentials), untimed, as every client is.
            conn.request(
                {"op": Op.OPEN, "url": f"s3://{BUCKET}/{WARM}", "stream": "fill", "pin": False}
            )
            if cpus is not None:  # after the warm-up: the S3 clients' threads exist now
                pin_threads(pid, cpus)
            make_room(stale)
            store0 = common.processes_cpu(store_pids)
            user0, sys0 = common.process_cpu(pid)
            wall0 = time.perf_counter()
            pending: list[int] = []
            todo = list(urls)
            # Opens queued ahead, as `cached prefetch` keeps them: the daemon's download
            # slots, not this loop, hold its GETs to ``conc``.
            while todo or pending:
                while todo and len(pending) < 2 * conc:
                    request = {"op": Op.OPEN, "url": todo.pop(0), "stream": "fill", "pin": False}
                    pending.append(conn.send({**request, "prefetch": True}))
                conn.wait(pending.pop(0))
            wall = time.perf_counter() - wall0
            user, system = common.process_cpu(pid)
            got = {"wall_s": wall, "user_s": user - user0, "sys_s": system - sys0}
            if store_pids:
                got["store_s"] = common.processes_cpu(store_pids) - store0
        finally:
            conn.close()
    return got


class PeerFailed(RuntimeError):
    """A peer client's process failed (a non-zero status, or a signal)."""


def run_client(
    client: str,
    python: str,
    endpoint: str,
    keys: list[str],
    *,
    conc: int,
    dest: Path,
    stale: Path | None,
    store_pids: Sequence[int] = (),
) -> dict[str, float]:
    """``client``'s fetch of ``keys`` into ``dest`` in a process of its own, after the
    previous round's files (``stale``) are removed."""
    dest.mkdir()
    stale_args = [] if stale is None else ["--stale", str(stale)]
    done = subprocess.run(
        [python, str(Path(__file__).resolve()), "--worker", client, "--endpoint", endpoint,
         "--dest", str(dest), "--concurrency", str(conc), "--keys", *keys,
         "--store-pids", *map(str, store_pids), *stale_args],
        capture_output=True, text=True, check=False, env={**os.environ, "PYTHONSAFEPATH": "1"},
    )  # fmt: skip
    if done.returncode != 0:
        raise PeerFailed(f"{client} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def check_files(dest: Path, keys: list[str], nbytes: int) -> None:
    """Every object on disk, whole (a client that says done must have written it all)."""
    for key in keys:
        got = (dest / key.replace("/", "_")).stat().st_size
        if got != nbytes:
            raise RuntimeError(f"{key}: {got} bytes on disk, not {nbytes}")


def table(results: dict[tuple[int, int, str], list[dict[str, float]]], mb: dict[int, float]) -> str:
    lines = [
        f"{'size':>5} {'at once':>7} {'client':<17} {'MB/s':>7} {'user ms/MB':>11} "
        f"{'sys ms/MB':>10} {'store ms/MB':>12} {'all ms/MB':>10} {'rate vs cached':>15} "
        f"{'user vs cached':>15}"
    ]
    for (size, conc, client), runs in results.items():
        rate = statistics.median(mb[size] / r["wall_s"] for r in runs)
        user = statistics.median(1000 * r["user_s"] / mb[size] for r in runs)
        system = statistics.median(1000 * r["sys_s"] / mb[size] for r in runs)
        if all("store_s" in r for r in runs):
            # The store's CPU in the same interval, and the sum: on loopback, TCP's work on
            # the received bytes runs in whichever end's thread gets to it first.
            store = statistics.median(1000 * r["store_s"] / mb[size] for r in runs)
            both = statistics.median(
                1000 * (r["user_s"] + r["sys_s"] + r["store_s"]) / mb[size] for r in runs
            )
            machine = f"{store:>12.2f} {both:>10.2f}"
        else:
            machine = f"{'-':>12} {'-':>10}"
        base = results.get((size, conc, "cached"))
        if base:
            base_rate = statistics.median(mb[size] / r["wall_s"] for r in base)
            base_user = statistics.median(1000 * r["user_s"] / mb[size] for r in base)
            ratios = f"{rate / base_rate:>14.2f}x {user / base_user:>14.2f}x"
        else:
            ratios = f"{'-':>15} {'-':>15}"
        lines.append(
            f"{size:>3}MB {conc:>7} {client:<17} {rate:>7.0f} {user:>11.2f} {system:>10.2f} "
            f"{machine} " + ratios
        )
    return "\n".join(lines)


def paired(results: dict[tuple[int, int, str], list[dict[str, float]]]) -> str:
    """The native daemon against bare awscrt, and against awscrt with the index pass
    (``awscrt-indexed``), round by round (the rounds alternate, so a pair ran under the
    same load): the median of the rate ratios and of the system-time ratios, the rounds it
    was ahead, and those at 0.95x or more (issue 23's bar). Single rounds span 2x on a
    shared machine; the pairs say more than the medians of each column."""
    lines = []
    for (size, conc, client), runs in results.items():
        if client != "cached-native":
            continue
        for reference in ("awscrt", "awscrt-indexed"):
            bare = results.get((size, conc, reference))
            if not bare:
                continue
            pairs = list(zip(runs, bare, strict=False))
            ratios = [b["wall_s"] / d["wall_s"] for d, b in pairs]
            kernel = [d["sys_s"] / b["sys_s"] for d, b in pairs if b["sys_s"] > 0]
            lines.append(
                f"{size:>3}MB {conc:>7} cached-native / {reference}, round by round: median "
                f"{statistics.median(ratios):.2f}x, ahead in {sum(r >= 1 for r in ratios)} and "
                f"at 0.95x or more in {sum(r >= 0.95 for r in ratios)} of {len(ratios)}; "
                f"system time {statistics.median(kernel) if kernel else float('nan'):.2f}x, "
                f"at most its in {sum(k <= 1 for k in kernel)}"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    head, started = common.start_run("fetch", "cached fetch: fill rate and CPU per MB, by client")
    doc: dict[str, Any] = {**head, "args": {k: str(v) for k, v in vars(args).items()}}
    pythons: dict[str, str] = {}
    for client in args.clients:
        if client in DAEMONS:
            continue
        python = interpreter(client)
        if python is None:
            common.log(f"{client}: skipped (not importable here or in .venv-peers)")
        else:
            pythons[client] = python
    clients = [c for c in args.clients if c in DAEMONS or c in pythons]
    results: dict[tuple[int, int, str], list[dict[str, float]]] = {}
    with (
        common.workdir("cached-bench-fetch-") as work,
        stores.s3_store(args.store, work) as store,
        contextlib.ExitStack() as stack,
    ):
        common.log(store.describe())
        doc["store"] = store.kind
        keys, nbytes = upload(store.endpoint_url, args.sizes, args.total_mb, args.checksum)
        mb = {size: nbytes[size] * len(keys[size]) / 1e6 for size in args.sizes}
        doc["link"] = "loopback, unlimited"
        if args.rate:  # shaped once the objects are in
            port = urllib.parse.urlsplit(store.endpoint_url).port
            assert port is not None
            doc["link"] = stack.enter_context(shaping.loopback_port_shaped(port, args.rate * 8))
        common.log(f"link: {doc['link']}")
        rounds = itertools.count()
        stale: Path | None = None  # the last round's files
        for size in args.sizes:
            for conc in args.concurrency:
                for repeat in range(args.repeats):
                    # In turn, and every other round in reverse: load drifts hit each alike,
                    # and no client always runs right after the same one.
                    for client in clients if repeat % 2 == 0 else clients[::-1]:
                        out = work / f"round-{next(rounds)}"
                        previous, stale = stale, out  # removed by this round, this by the next
                        if client in DAEMONS:
                            native = client == "cached-native"
                            got = run_daemon(
                                store.endpoint_url,
                                keys[size],
                                conc,
                                out,
                                stale=previous,
                                native=native,
                                verify=not args.no_verify,
                                cpus=args.daemon_cpus,
                                checksum_head=args.checksum is not None,
                                store_pids=store.pids,
                            )
                        else:
                            try:
                                got = run_client(
                                    client,
                                    pythons[client],
                                    store.endpoint_url,
                                    keys[size],
                                    conc=conc,
                                    dest=out,
                                    stale=previous,
                                    store_pids=store.pids,
                                )
                            except PeerFailed as exc:
                                # A peer's crash is a figure of that peer (obstore has
                                # aborted here), not a failure of the benchmark: its
                                # round is left out of its medians, and said.
                                doc.setdefault("peer_failures", []).append(str(exc))
                                common.log(f"  {size} MB, {conc} at once, {exc}")
                                continue
                            check_files(out, keys[size], nbytes[size])
                        results.setdefault((size, conc, client), []).append(got)
                        common.log(  # progress: one line a run
                            f"  {size} MB, {conc} at once, {client}: "
                            f"{mb[size] / got['wall_s']:.0f} MB/s"
                        )
    common.log(
        f"\n{args.total_mb} MB of objects per size from {store.kind}, medians of "
        f"{args.repeats} round(s); CPU per MB: the client's own process (user, sys), the "
        "store's processes in the same interval (store; RGW only) and all three together\n"
        + table(results, mb)
    )
    if pairs := paired(results):
        common.log(pairs)
    doc["results"] = [
        {"size_mb": s, "concurrency": c, "client": n, "runs": r} for (s, c, n), r in results.items()
    ]
    common.finish_run("fetch", doc, started, args.out)
    return 0


if __name__ == "__main__":
    common.exit_on_sigterm()
    sys.exit(main())
