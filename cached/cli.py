"""Command line: ``cached serve | status | prefetch | diagnose | demo``. The only place that
exits."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from cached_client.errors import CachedClientError
from cached_wire.protocol import SOCKET_ENV, Op

from . import __version__, logs
from .config import Config, format_size, load
from .errors import CachedError
from .logs import LIBS_ENV

log = logging.getLogger("cached")


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", help="TOML config (default: $CACHED_CONFIG, /etc/cached/config.toml)"
    )
    p.add_argument("--socket", help="ZeroMQ endpoint, ipc://PATH or tcp://HOST:PORT")
    p.add_argument("--http", help="admin HTTP address HOST:PORT")
    p.add_argument("--cache-dir", help="hot tier directory")
    p.add_argument("--capacity", help="hot tier capacity, e.g. 500GiB")
    p.add_argument("--endpoint-url", help="S3 endpoint URL (MinIO)")


def _config(args: argparse.Namespace) -> Config:
    return load(
        args.config,
        overrides={
            "server.socket": args.socket,
            "server.http": args.http,
            "cache.dir": args.cache_dir,
            "cache.capacity": args.capacity,
            "s3.endpoint_url": args.endpoint_url,
        },
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cached", description="A tiered caching daemon that keeps GPUs fed."
    )
    parser.add_argument("--version", action="version", version=f"cached {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--debug-libs",
        action="store_true",
        default=None,
        help=f"log the libraries' lines too (botocore, aiohttp...; also ${LIBS_ENV}=1); "
        "credentials are redacted",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon")
    _add_config_flags(serve)

    status = sub.add_parser("status", help="show the running daemon's state")
    _add_config_flags(status)
    status.add_argument("--json", action="store_true", help="machine-readable output")

    prefetch = sub.add_parser("prefetch", help="fetch shards into the hot tier now")
    _add_config_flags(prefetch)
    prefetch.add_argument("urls", nargs="+", help="shard URLs or brace patterns")

    diagnose = sub.add_parser(
        "diagnose", help="is training input-bound on these shards, and what should change"
    )
    _add_config_flags(diagnose)
    diagnose.add_argument("urls", nargs="+", help="shard URLs or brace patterns")
    diagnose.add_argument(
        "--step-ms", type=float, default=100.0, help="training step time in ms (default 100)"
    )
    diagnose.add_argument("--workers", type=int, default=4, help="DataLoader workers (default 4)")
    diagnose.add_argument(
        "--batch-size", type=int, default=64, help="samples per batch (default 64)"
    )
    diagnose.add_argument("--decode", metavar="MODULE:FUNC", help="the workers' decode function")
    diagnose.add_argument(
        "--budget", type=float, default=40.0, help="seconds to spend measuring (default 40)"
    )
    diagnose.add_argument("--json", action="store_true", help="one JSON object on stdout")

    demo = sub.add_parser("demo", help="the whole stack on this machine, embedded defaults")
    demo.add_argument("--epochs", type=int, default=3)
    demo.add_argument("--shards", type=int, default=16)
    demo.add_argument("--samples-per-shard", type=int, default=256)
    demo.add_argument("--workers", type=int, default=2)
    demo.add_argument("--dir", help="working directory (default: a temporary one)")
    demo.add_argument(
        "--keep",
        action="store_true",
        help="after the epochs, leave the S3 server and the daemon running and print the "
        "environment to use them with, until Ctrl-C (--epochs 0: start them only)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``cached`` command."""
    args = _parser().parse_args(argv)
    # Third-party loggers stay at WARNING unless asked for: botocore's debug lines carry
    # request headers, session tokens included (cached/logs.py).
    logs.setup(verbose=args.verbose, libs=args.debug_libs)
    try:
        code = _run(args)
        sys.stdout.flush()  # here, where a closed pipe is handled, not at exit
    except (CachedError, CachedClientError, ValueError) as exc:
        print(f"cached: error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:
        # The reader went away (`cached status | head`): nothing more to say, and the
        # interpreter's final flush must not complain either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141  # as a shell reports a command ended by SIGPIPE
    except OSError as exc:
        # What the daemon did not foresee (a config file it may not read, a full disk at
        # start): still one line, as the ones above, not a traceback. --verbose shows it.
        log.debug("details", exc_info=True)
        print(f"cached: error: {exc}", file=sys.stderr)
        code = 1
    sys.exit(code)


def _run(args: argparse.Namespace) -> int:
    if args.command == "serve":
        from .daemon import run

        cfg = _config(args)
        try:
            import uvloop

            uvloop.run(run(cfg))
        except ImportError:
            asyncio.run(run(cfg))
        return 0
    if args.command == "status":
        return _status(_client_socket(args), args.json)
    if args.command == "prefetch":
        return _prefetch(_client_socket(args), args.urls)
    if args.command == "diagnose":
        from cached_client.diagnose.run import run as diagnose_main

        return diagnose_main(
            _client_socket(args),
            args.urls,
            step_ms=args.step_ms,
            workers=args.workers,
            batch_size=args.batch_size,
            decode_spec=args.decode,
            as_json=args.json,
            budget_s=args.budget,
        )
    if args.command == "demo":
        from cached_demo import main as demo_main

        return demo_main(
            epochs=args.epochs,
            shards=args.shards,
            samples_per_shard=args.samples_per_shard,
            workers=args.workers,
            workdir=args.dir,
            keep=args.keep,
        )
    raise AssertionError(args.command)


def _client_socket(args: argparse.Namespace) -> str:
    """Where ``status`` and ``prefetch`` find the daemon: ``--socket``, else
    ``$CACHED_SOCKET`` (as the client library finds it), else the config's socket."""
    return args.socket or os.environ.get(SOCKET_ENV) or _config(args).server.socket


def _status(socket: str, as_json: bool) -> int:
    from cached_client.transport import Connection

    conn = Connection(socket, connect_timeout_s=3.0)
    header, _ = conn.request({"op": Op.STATUS})
    status: dict[str, Any] = header["status"]
    if as_json:
        print(json.dumps(status, indent=2, sort_keys=True))
        return 0
    hot, c = status["hot"], status["counters"]
    opens = c["hits"] + c["misses"]
    print(f"cached {status['version']}  up {status['uptime_s']:.0f}s  socket {status['socket']}")
    # The bound kept now: less than the capacity where the disk has less room.
    effective = hot.get("capacity_effective_bytes", hot["capacity_bytes"])
    disk = f", the disk has room for {format_size(effective)}"
    print(
        f"hot tier  {hot['dir']}: {hot['shards']} shards, {format_size(hot['used_bytes'])} of "
        f"{format_size(hot['capacity_bytes'])} ({hot['policy']}"
        f"{disk if effective < hot['capacity_bytes'] else ''}), {hot['pinned_shards']} pinned, "
        f"{hot['fetching_shards']} fetching"
    )
    print(
        f"opens     {opens:.0f}: {c['hits']:.0f} hits, {c['misses']:.0f} misses"
        + (f" ({c['hits'] / opens:.0%} hit rate)" if opens else "")
        + f", {c['demand_misses']:.0f} of them a reader waited for"
    )
    print(
        f"fetched   {format_size(c['fetched_bytes'])}, {c['retries']:.0f} retries, "
        f"{c['evictions']:.0f} evictions"
    )
    # What local readers read from the files: the local replies they could use.
    local_bytes = c.get("local_read_bytes", 0.0) - c.get("local_fallback_bytes", 0.0)
    print(
        f"served    {c['served_samples']:.0f} samples, {format_size(c['served_bytes'])} "
        f"({format_size(local_bytes)} read from the files by local readers), "
        f"{status['streams']} streams"
    )
    fds = status.get("descriptors")
    if fds:
        print(
            f"fds       {fds['open']} open, limit {fds['soft_limit']} (hard "
            f"{fds['hard_limit']}), {fds['reserve']} in reserve; {fds['connections']} "
            f"connections (at most {fds['max_connections']}, {fds['max_connections_per_user']} "
            f"a user), {fds['connections_refused']} shut; {fds['shard_files_open']} shard "
            f"files open (at most {fds['max_open_files']})"
        )
    tiers, pre = status["tiers"], status["prefetch"]
    print(
        "tiers     "
        + ", ".join(
            f"{t} {tiers[t]['fetches']:.0f} fetches ({format_size(tiers[t]['fetched_bytes'])})"
            for t in ("warm", "cold")
        )
        + f", {tiers['promotions']:.0f} promoted"
    )
    if not pre["lookahead_bytes"]:
        lead = "off (lookahead 0: on demand only)"
    elif pre["lead_s"] is None:
        lead = f"lookahead {format_size(pre['lookahead_bytes'])}, nothing planned is missing"
    else:
        lead = f"lookahead {format_size(pre['lookahead_bytes'])}, lead {pre['lead_s']:.1f}s"
    print(f"prefetch  {lead}, {pre['prefetches']:.0f} prefetches, {len(status['plans'])} plans")
    me = f"uid {os.getuid()}"
    for plan in status["plans"]:
        rate = plan["rate_shards_per_s"]
        print(
            f"  plan {plan['stream']}"
            # Root and the daemon's user see every user's plans, each with its user.
            + (f" of {plan['user']}" if plan.get("user") not in (None, me) else "")
            + (f" (job {plan['job']})" if plan.get("job") else "")
            + f": shard {plan['cursor']} of {plan['shards']}"
            + (f", {rate:.2f} shards/s" if rate else "")
        )
    jobs = status.get("jobs", [])
    print(f"jobs      {len(jobs)} reporting" + ("" if jobs else " (see docs/observability.md)"))
    for job in jobs:
        print(f"  job {job['job']}: {_job_line(job)}")
    return 0


def _job_line(job: dict[str, Any]) -> str:
    """E.g. "waiting 12.3% of 100 s of loop, 5000 batches, 3 ready, 2 processes, 4 plans"."""
    share, loop_s = job["wait_fraction"], job["loop_s"]
    # The daemon keeps loop_s to the ms: below that a share says nothing yet.
    parts = [
        "no loop time yet"
        if share is None or loop_s < 0.001
        else f"waiting {share:.1%} of {_duration(loop_s)} of loop",
        f"{job['batches']} batches",
    ]
    if job["ready"] is not None:
        parts.append(f"{job['ready']} ready")
    parts += [f"{job['reporters']} processes", f"{job['plans']} plans"]
    return ", ".join(parts)


def _duration(seconds: float) -> str:
    """``0.25 -> "250 ms"``, ``4.2 -> "4.2 s"``, ``100.4 -> "100 s"``."""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"


def _prefetch(socket: str, patterns: list[str]) -> int:
    from cached_client.transport import Connection
    from cached_wire.urls import expand_all
    from tqdm import tqdm

    urls = expand_all(patterns)
    conn = Connection(socket, connect_timeout_s=3.0)
    stream = "prefetch"
    failed = 0
    # A few opens in flight: the daemon downloads them in parallel within its own limits.
    window = 8
    with tqdm(total=len(urls), unit="shard", desc="prefetch") as bar:
        pending: list[tuple[str, int]] = []
        todo = list(urls)
        while todo or pending:
            while todo and len(pending) < window:
                url = todo.pop(0)
                # A prefetch open yields download slots to the trainers' demand misses.
                request = {
                    "op": Op.OPEN,
                    "url": url,
                    "stream": stream,
                    "pin": False,
                    "prefetch": True,
                }
                pending.append((url, conn.send(request)))
            url, rid = pending.pop(0)
            try:
                conn.wait(rid)
                bar.update(1)
            except CachedClientError as exc:
                failed += 1
                # The daemon's messages name the URL already.
                tqdm.write(str(exc) if url in str(exc) else f"{url}: {exc}", file=sys.stderr)
                bar.update(1)
                # Drawn now, not at the bar's next refresh: a failure is seen as it happens.
                bar.set_postfix_str(f"{failed} failed", refresh=True)
    if failed:
        print(f"cached: {failed} of {len(urls)} shards failed", file=sys.stderr)
        return 1
    return 0
