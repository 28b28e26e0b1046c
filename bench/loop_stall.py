"""How long the daemon's event loop stalls while it takes in very long plans.

A plan may name up to a million shard URLs (a reader's epoch and the next one over a large
dataset). Checking, indexing, replacing and expiring it are O(URLs); done on the event loop,
every other client waits meanwhile. This runs ``cached serve`` as a real subprocess and,
while one client announces a plan of ``--urls`` URLs, replaces it and lets it lapse, a
second client sends a ``hello`` every 10 ms and records the worst round trip (the stall as
a client sees it, measured from outside). The daemon's own ``/status`` "loop" figures (how
late its periodic wake-up came; absent from daemons that predate it) are shown beside.

    python bench/loop_stall.py                   # 1,000,000 URLs (about a minute)
    python bench/loop_stall.py --small           # 100,000 URLs, a smoke run
    python bench/loop_stall.py --daemon-path DIR # the daemon of another checkout (before/after)
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cached_client.transport import Connection

from bench.common import finish_run, log, start_run, workdir
from cached.demo.stack import DaemonProcess, write_config

PROBE_EVERY_S = 0.01


class Prober:
    """A client that says hello every 10 ms and keeps the worst round trip per phase."""

    def __init__(self, socket: str) -> None:
        self.conn = Connection(socket)
        self.worst = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Prober:
        self.conn.open()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.conn.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            self.conn.request({"op": "hello", "v": 1})
            self.worst = max(self.worst, time.perf_counter() - start)
            time.sleep(PROBE_EVERY_S)

    def take(self) -> float:
        """The worst round trip since the last take."""
        worst, self.worst = self.worst, 0.0
        return worst


def loop_figures(conn: Connection) -> dict[str, Any]:
    status: dict[str, Any] = conn.request({"op": "status"})[0]["status"]
    loop: dict[str, Any] = status.get("loop", {})
    return loop


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--urls", type=int, default=1_000_000, help="URLs in the plan")
    parser.add_argument("--small", action="store_true", help="100,000 URLs: a smoke run")
    parser.add_argument(
        "--daemon-path", help="run the daemon from this checkout (its cached/ and client/)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the working directory")
    args = parser.parse_args()
    urls_n = 100_000 if args.small else args.urls
    doc, started = start_run("loop_stall", f"event loop stalls under plans of {urls_n:,} URLs")
    env = {}
    if args.daemon_path:
        root = Path(args.daemon_path).resolve()
        env["PYTHONPATH"] = f"{root}{os.pathsep}{root / 'client'}"
    timeout_s = 8.0
    rows: list[tuple[str, float, Any]] = []
    with workdir("loop-stall-", args.keep) as tmp:
        socket = f"ipc://{tmp}/cached.sock"
        config = write_config(
            tmp / "config.toml",
            {
                "server": {"socket": socket, "http": "127.0.0.1:0"},
                "cache": {"dir": str(tmp / "hot"), "capacity": "1GiB", "min_free": "0"},
                # Nothing is fetched: the plan names objects of a store nobody runs.
                "s3": {"endpoint_url": "http://127.0.0.1:9"},
                "prefetch": {"lookahead": "0", "plan_timeout_s": timeout_s},
            },
        )
        urls = [f"s3://bench/train/shard-{i:07d}.tar" for i in range(urls_n)]
        with DaemonProcess(config, socket, env=env), Prober(socket) as probe:
            planner = Connection(socket, request_timeout_s=300)
            time.sleep(0.5)
            rows.append(("idle", probe.take(), loop_figures(planner)))
            for phase, plan in (("announce", urls), ("replace", urls[::-1])):
                t = time.perf_counter()
                planner.request({"op": "plan", "plan": "big", "urls": plan, "job": "bench"})
                log(f"{phase}: answered in {time.perf_counter() - t:.2f} s")
                time.sleep(0.5)
                rows.append((phase, probe.take(), loop_figures(planner)))
            # Let the plan lapse (the reader went quiet): the daemon drops and unindexes it.
            time.sleep(timeout_s + 3)
            rows.append(("expire", probe.take(), loop_figures(planner)))
            planner.close()
    print(f"\n{'phase':<10} {'worst hello RTT':>16} {'loop lag, last min':>19}")
    for phase, rtt, loop in rows:
        lag = loop.get("worst_lag_last_minute_s")
        shown = f"{lag * 1000:.0f} ms" if lag is not None else "n/a"
        print(f"{phase:<10} {rtt * 1000:>13.0f} ms {shown:>19}")
    doc["urls"] = urls_n
    doc["daemon_path"] = args.daemon_path
    doc["phases"] = [{"phase": p, "worst_rtt_s": r, "loop": lp} for p, r, lp in rows]
    finish_run("loop_stall", doc, started, Path(__file__).resolve().parent / "out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
