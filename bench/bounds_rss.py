"""The daemon's resident memory idle and under each hostile client of issue 20: a client
that never reads its replies, oversized request frames, and many connections of one user
announcing plans. ``python -m bench.bounds_rss`` prints one line per case (no S3 needed:
the requests are ``status``, ``plan`` and raw frames)."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq
from cached_wire.protocol import PROTOCOL_VERSION, decode, encode

from cached import weights
from cached_demo.stack import DaemonProcess, write_config


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def dealer(ctx: zmq.Context[Any], socket: str, **options: int) -> Any:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(socket)
    return sock


def storeless_daemon(
    directory: Path, server: dict[str, Any] | None = None, **prefetch: Any
) -> tuple[Path, str]:
    """The config and socket of a ``cached serve`` in ``directory`` with a store it never
    contacts (no lookahead: the prefetcher fetches nothing), for measuring the daemon
    itself; ``server`` and ``prefetch`` add ``[server]`` and ``[prefetch]`` keys."""
    socket = f"ipc://{directory}/cached.sock"
    config = write_config(
        directory / "config.toml",
        {
            "server": {"socket": socket, "http": "127.0.0.1:0", **(server or {})},
            "cache": {"dir": str(directory / "hot"), "capacity": "1GiB", "min_free": "0"},
            "s3": {"endpoint_url": "http://127.0.0.1:9"},
            "prefetch": {"lookahead": "0", **prefetch},
        },
    )
    return config, socket


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--connections", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        # Plans of closed connections go at once: their memory is measured after.
        config, socket = storeless_daemon(directory, plan_grace_s=0)
        ctx: zmq.Context[Any] = zmq.Context()
        with DaemonProcess(config, socket) as daemon:
            assert daemon.proc is not None
            pid = daemon.proc.pid
            time.sleep(2)
            print(f"idle: {rss_mib(pid):.0f} MiB")

            # A client that never reads: 20,000 status requests (~3 KB replies).
            deaf = dealer(ctx, socket, RCVHWM=1, SNDHWM=100_000)
            for i in range(20_000):
                deaf.send(encode({"op": "status", "id": i}))
            time.sleep(5)
            print(f"never-reading client, 20,000 requests sent: {rss_mib(pid):.0f} MiB")
            deaf.close(0)
            time.sleep(2)
            print(f"  after it closed: {rss_mib(pid):.0f} MiB")

            # Oversized frames: 4 connections, one 256 MiB frame each.
            big = b"x" * (256 << 20)
            peak = 0.0
            for _ in range(4):
                sock = dealer(ctx, socket)
                sock.send(big, copy=False)
                for _ in range(10):
                    time.sleep(0.1)
                    peak = max(peak, rss_mib(pid))
                sock.close(0)
            del big
            print(f"4 frames of 256 MiB: peak {peak:.0f} MiB, then {rss_mib(pid):.0f} MiB")

            # One user, many connections, each announcing plans until refused.
            urls = [f"s3://bucket/dataset/train/shard-{i:07d}.tar" for i in range(100_000)]
            accepted = refused = 0
            socks = []
            for c in range(args.connections):
                sock = dealer(ctx, socket)
                socks.append(sock)
                for p in range(2):
                    header = {"op": "plan", "id": p, "plan": f"c{c}-p{p}", "urls": urls}
                    sock.send(encode(header))
                    reply = sock.recv_multipart()[0]
                    ok = b'"ok":true' in reply or b'"ok": true' in reply
                    accepted, refused = accepted + ok, refused + (not ok)
                if refused >= 4:
                    break
            time.sleep(1)
            print(
                f"one user, {len(socks)} connections: {accepted} plans of 100,000 URLs "
                f"accepted, {refused} refused: {rss_mib(pid):.0f} MiB"
            )
            for sock in socks:
                sock.close(0)
            time.sleep(3)
            print(f"  after they closed: {rss_mib(pid):.0f} MiB")
            hello = dealer(ctx, socket)
            hello.send(encode({"op": "status", "id": 1, "v": PROTOCOL_VERSION}))
            assert hello.poll(5000), "the daemon does not answer"
            plans = decode(hello.recv_multipart()[0])["status"]["plans"]
            print(f"  plans left: {len(plans)} (the allocator keeps the freed memory)")
            hello.close(0)
        ctx.term()
        long_urls(Path(tmp) / "long")


def long_urls(directory: Path) -> None:
    """Issue 35's long URLs: plans of URLs of 1,000 characters until one user's bytes
    (``max_plan_bytes_per_user``, set to 256 MiB here) refuse them, what each planned URL
    adds to the RSS against its weight (cached/weights.py), and plans of one 4 MiB URL."""
    directory.mkdir()
    cap = 256 << 20
    config, socket = storeless_daemon(directory, {"max_plan_bytes_per_user": cap}, plan_grace_s=600)
    ctx: zmq.Context[Any] = zmq.Context()
    with DaemonProcess(config, socket) as daemon:
        assert daemon.proc is not None
        pid = daemon.proc.pid
        sock = dealer(ctx, socket)

        def plan(key: str, urls: list[str]) -> bool:
            sock.send(encode({"op": "plan", "id": 1, "plan": key, "urls": urls}))
            assert sock.poll(60_000), "the daemon does not answer"
            return bool(decode(sock.recv_multipart()[0])["ok"])

        time.sleep(1)
        before = rss_mib(pid)
        taken = 0
        for p in range(100):
            urls = [f"s3://bucket/{p:03d}-{i:08d}".ljust(1000, "k") for i in range(20_000)]
            if not plan(f"p{p}", urls):
                break
            taken += len(urls)
        time.sleep(2)
        grown = (rss_mib(pid) - before) * (1 << 20)
        weight = weights.plan_bytes(1, sys.getsizeof(urls[0]))
        print(
            f"plans of URLs of 1,000 characters under max_plan_bytes_per_user = 256 MiB: "
            f"{taken:,} URLs taken, RSS {before:.0f} -> {rss_mib(pid):.0f} MiB, "
            f"{grown / taken:.0f} B a URL (weight {weight} B)"
        )
        huge = ["s3://bucket/" + "k" * (4 << 20)]
        refused = sum(not plan(f"huge{i}", huge) for i in range(24))
        time.sleep(1)
        print(f"24 plans of one 4 MiB URL: {refused} refused, RSS {rss_mib(pid):.0f} MiB")
        sock.close(0)
    ctx.term()


if __name__ == "__main__":
    main()
