"""The S3 store a benchmark reads from: Ceph's RADOS Gateway (a real engine) or moto.

moto is an emulator in Python: it closes each connection after its answer, computes
nothing as a store does and takes a core of its own at about 1 GB/s, so a figure of the
fill rate or of the fetch path's CPU taken against it measures moto as much as the daemon.
Those benchmarks take ``--store`` (``auto``: RGW where it can start here, else moto, saying
why in one line) and print which store answered.

    rgw    a single-node Ceph cluster (tests/rgw.py: one monitor, a MemStore OSD, radosgw
           on 127.0.0.1), its own processes; requests counted from radosgw's ops log
    moto   moto's server as its own process (bench/shaping.py); requests counted from
           its request log

Both count the GETs and HEADs of a bucket's objects as the store answered them, so a
benchmark can report requests without trusting the daemon's own bookkeeping.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from bench import common, shaping

STORES = ("auto", "rgw", "moto")


@dataclass
class Store:
    """A running S3 endpoint: which engine, where, and its count of requests."""

    kind: str
    endpoint_url: str
    #: The requests the store answered for ``bucket``'s objects so far, by method.
    requests: Callable[[str], Counter[str]]
    #: Why ``auto`` fell back to moto ("" when it did not).
    fallback: str = ""
    #: The store's processes, whose CPU a benchmark may read (none for moto here).
    pids: tuple[int, ...] = ()

    def describe(self) -> str:
        """One line for a benchmark's output: the engine and, for moto, the caveat."""
        if self.kind == "rgw":
            return f"store: Ceph RGW at {self.endpoint_url} (a real engine, its own processes)"
        why = f" ({self.fallback})" if self.fallback else ""
        return (
            f"store: moto at {self.endpoint_url}{why}; an emulator that takes a core of its "
            "own: fill rates and CPU figures against it are not the daemon's alone"
        )


def add_argument(p: argparse.ArgumentParser) -> None:
    """``--store auto|rgw|moto``."""
    p.add_argument(
        "--store",
        choices=STORES,
        default="auto",
        help="the S3 store: Ceph RGW, moto, or RGW where it can start here (auto)",
    )


@contextlib.contextmanager
def s3_store(kind: str, work: Path, log: Callable[[str], None] = common.log) -> Iterator[Store]:
    """Start the store ``kind`` asks for (files under ``work``), set the S3 credentials in
    this process's environment (children inherit them), and stop it on exit.

    ``rgw`` raises ``SystemExit`` saying why where the cluster cannot start; ``auto`` then
    falls back to moto and says so."""
    if kind not in STORES:
        raise ValueError(f"--store must be one of {', '.join(STORES)}, not {kind!r}")
    from tests.rgw import unavailable

    why = unavailable() if kind != "moto" else "asked for moto"
    if kind == "rgw" and why:
        raise SystemExit(f"--store rgw: {why}")
    if not why:
        with _rgw() as store:
            yield store
        return
    if kind == "auto":
        log(f"store: moto, since RGW cannot start here: {why}")
    with _moto(work, why if kind == "auto" else "") as store:
        yield store


@contextlib.contextmanager
def _rgw() -> Iterator[Store]:
    from tests.s3server import S3Server

    with S3Server.start_rgw() as server:
        _credentials("testing", "testing")  # tests/rgw.py's S3 user

        def requests(bucket: str) -> Counter[str]:
            return Counter(
                {m: server.count(m, f"^/{re.escape(bucket)}/.") for m in ("GET", "HEAD")}
            )

        yield Store("rgw", server.endpoint_url, requests, pids=tuple(server.pids))


@contextlib.contextmanager
def _moto(work: Path, fallback: str) -> Iterator[Store]:
    log_path = work / "moto.log"
    with shaping.moto_server(log_path) as endpoint:
        _credentials("bench", "bench")  # moto takes any key

        def requests(bucket: str) -> Counter[str]:
            time.sleep(0.3)  # moto writes its last lines after the answers
            line = re.compile(rf'"(GET|HEAD) /{re.escape(bucket)}/[^ ?]+')
            return Counter(m.group(1) for m in line.finditer(log_path.read_text(errors="replace")))

        yield Store("moto", endpoint, requests, fallback)


def _credentials(key: str, secret: str) -> None:
    os.environ["AWS_ACCESS_KEY_ID"] = key
    os.environ["AWS_SECRET_ACCESS_KEY"] = secret
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
