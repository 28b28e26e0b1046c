"""A rate-shaped S3 endpoint for benchmarks: moto's S3 server behind a slow link.

Two ways to make the link slow, tried in this order:

  netns   moto runs inside its own network namespace, reached over a veth pair with
          addresses in a private /30; a ``tc tbf`` qdisc on each end of the pair limits
          both directions (the namespace's end carries the GET bodies to the daemon). This
          is the kernel's own shaping: the daemon's HTTP client sees a real slow TCP path.
          Needs root, ``ip`` and ``tc`` (``netem`` is not required, only ``tbf``).
  proxy   moto on 127.0.0.1 behind a TCP proxy in a thread of this process, which relays
          bytes through one token bucket per direction (all connections share the link,
          as they would share a real one). Used when the namespace cannot be made.

Either way the store is filled *before* shaping starts (``populate`` gets an unshaped
endpoint), so writing the dataset is fast, and the achieved rate is measured by
downloading a probe object once shaping is on.

    with shaped_s3(64, populate=upload) as s3:
        print(s3.method, s3.endpoint_url, s3.measured_mbit)

``python bench/shaping.py --rate 64`` checks the shaping on this machine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Short names: Linux interface names are at most 15 characters ("cbh" + a pid fits).
_NS_PREFIX = "cbench-"
_HOST_IF = "cbh"
_NS_IF = "cbn"
_SUBNET = "10.213"  # 10.213.X.0/30: host end .1, namespace end .2
_BURST = "32kbit"  # small, so the link cannot deliver a shard-sized burst at memory speed
_LATENCY = "400ms"  # how long a packet may queue in tbf before it is dropped
PROBE_BUCKET = "cached-shaping-probe"
PROBE_KEY = "probe.bin"

Populate = Callable[[str], None]  # called with an unshaped endpoint URL to fill the store
Log = Callable[[str], None]


@dataclass
class ShapedS3:
    """A running rate-shaped S3 endpoint."""

    endpoint_url: str  # what the daemon talks to: shaped
    method: str  # "netns" (tc tbf on a veth pair) or "proxy" (token-bucket TCP proxy)
    rate_mbit: float  # the configured limit per direction, 10^6 bits/s
    measured_mbit: float = 0.0  # the rate a probe download achieved through the shaping
    unshaped_mbit: float = 0.0  # the same download before shaping: the store's own speed
    detail: str = ""  # how it was set up, for the record

    def record(self) -> dict[str, Any]:
        """A JSON-able description."""
        return {
            "method": self.method,
            "endpoint_url": self.endpoint_url,
            "rate_mbit": self.rate_mbit,
            "measured_mbit": round(self.measured_mbit, 2),
            "unshaped_mbit": round(self.unshaped_mbit, 2),
            "detail": self.detail,
        }


@contextlib.contextmanager
def shaped_s3(
    rate_mbit: float,
    *,
    populate: Populate | None = None,
    method: str = "auto",
    probe_bytes: int = 4_000_000,
    server_log: Path | None = None,
    log: Log = print,
) -> Iterator[ShapedS3]:
    """moto's S3 server behind a link limited to ``rate_mbit`` in each direction.

    ``populate(url)`` runs first, against the same store without shaping (upload the
    dataset there). ``method`` is ``"auto"`` (netns, else proxy), ``"netns"`` or
    ``"proxy"``. Everything (server, namespace, veth pair, proxy) is removed on exit,
    also after an error or a SIGTERM turned into ``SystemExit``.
    """
    if method not in ("auto", "netns", "proxy"):
        raise ValueError(f"method must be auto, netns or proxy, not {method!r}")
    if rate_mbit <= 0:
        raise ValueError(f"rate_mbit must be positive, not {rate_mbit}")
    if method in ("auto", "netns"):
        why = netns_unavailable()
        if why is None:
            try:
                with _netns_s3(rate_mbit, populate, probe_bytes, server_log, log) as s3:
                    yield s3
                return
            except _SetupError as exc:
                if method == "netns":
                    raise RuntimeError(f"netns shaping failed: {exc}") from exc
                why = str(exc)
        elif method == "netns":
            raise RuntimeError(f"netns shaping unavailable: {why}")
        log(f"shaping: netns unavailable ({why}); using the rate-limiting TCP proxy")
    with _proxy_s3(rate_mbit, populate, probe_bytes, server_log) as s3:
        yield s3


class _SetupError(Exception):
    """The namespace could not be set up (falls back to the proxy under ``auto``)."""


def netns_unavailable() -> str | None:
    """Why netns + tc shaping cannot work here, or None if it may."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no {tool!r} command"
    return None


# -- the store ----------------------------------------------------------------------------------


def _start_moto(prefix: Sequence[str], host: str, port: int, log_path: Path | None) -> Any:
    """``python -m moto.server`` as a subprocess (its own process: its request handling
    must not compete with the benchmark's loop for this process's GIL)."""
    out: Any = subprocess.DEVNULL if log_path is None else open(log_path, "ab")  # noqa: SIM115
    try:
        return subprocess.Popen(
            [*prefix, sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            # Its own process group, so a terminal's Ctrl-C reaches us first and we stop it;
            # and it dies with us even if we are SIGKILLed (no orphaned server).
            start_new_session=True,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 (no threads yet that could deadlock)
        )
    finally:
        if out is not subprocess.DEVNULL:
            out.close()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux prctl; kept across the
    exec of ``ip netns exec`` and of python, neither being setuid)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_listening(proc: subprocess.Popen[bytes], host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise _SetupError(f"moto server exited {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        if time.monotonic() > deadline:
            raise _SetupError(f"moto server not listening on {host}:{port} after {timeout_s}s")
        time.sleep(0.1)


def s3_client(endpoint_url: str) -> Any:
    """A boto3 S3 client for a moto endpoint (any credentials do; no retries hide stalls)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name="us-east-1",
        aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID", "bench"),
        aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY", "bench"),
        config=Config(s3={"addressing_style": "path"}, read_timeout=120),
    )


def _put_probe(endpoint_url: str, nbytes: int) -> None:
    client = s3_client(endpoint_url)
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=PROBE_BUCKET)
    client.put_object(Bucket=PROBE_BUCKET, Key=PROBE_KEY, Body=os.urandom(nbytes))


def measure_mbit(endpoint_url: str, nbytes: int) -> float:
    """Download the probe object through ``endpoint_url``; returns the achieved 10^6 bit/s."""
    client = s3_client(endpoint_url)
    client.head_object(Bucket=PROBE_BUCKET, Key=PROBE_KEY)  # connection set up, not timed
    started = time.perf_counter()
    body = client.get_object(Bucket=PROBE_BUCKET, Key=PROBE_KEY)["Body"].read()
    secs = time.perf_counter() - started
    if len(body) != nbytes:
        raise RuntimeError(f"probe download returned {len(body)} bytes, expected {nbytes}")
    return nbytes * 8 / secs / 1e6


# -- netns + tc tbf ---------------------------------------------------------------------------


def _run(*cmd: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise _SetupError(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _remove_stale_namespaces() -> None:
    """Namespaces of earlier runs that were SIGKILLed (their pid is gone): delete them, or
    their /30s and interface names would pile up."""
    with contextlib.suppress(_SetupError):
        for line in _run("ip", "netns", "list").splitlines():
            match = re.match(rf"{_NS_PREFIX}(\d+)\b", line)
            if match and not Path(f"/proc/{match.group(1)}").exists():
                ns = match.group(0)
                with contextlib.suppress(_SetupError):  # its moto server, if still running
                    for pid in _run("ip", "netns", "pids", ns).split():
                        with contextlib.suppress(OSError):
                            os.kill(int(pid), signal.SIGKILL)
                subprocess.run(["ip", "netns", "del", ns], check=False)
                subprocess.run(
                    ["ip", "link", "del", f"{_HOST_IF}{match.group(1)}"],
                    capture_output=True,
                    check=False,
                )


def _free_subnet() -> int:
    """An X for 10.213.X.0/30 that no interface here uses."""
    used = _run("ip", "-o", "-4", "addr", "show")
    start = os.getpid() % 256
    for i in range(256):
        x = (start + i) % 256
        if f" {_SUBNET}.{x}." not in used:
            return x
    raise _SetupError(f"no free {_SUBNET}.X.0/30")


def _tbf(rate_mbit: float, dev: str, netns: str | None = None) -> None:
    prefix = ("ip", "netns", "exec", netns) if netns else ()
    _run(
        *prefix,
        *("tc", "qdisc", "replace", "dev", dev, "root", "tbf"),
        *("rate", f"{rate_mbit:g}mbit", "burst", _BURST, "latency", _LATENCY),
    )


@contextlib.contextmanager
def _netns_s3(
    rate_mbit: float,
    populate: Populate | None,
    probe_bytes: int,
    server_log: Path | None,
    log: Log,
) -> Iterator[ShapedS3]:
    _remove_stale_namespaces()
    pid = os.getpid()
    ns, host_if, ns_if = f"{_NS_PREFIX}{pid}", f"{_HOST_IF}{pid}", f"{_NS_IF}{pid}"
    proc: subprocess.Popen[bytes] | None = None
    created = False
    try:
        x = _free_subnet()
        host_ip, ns_ip, port = f"{_SUBNET}.{x}.1", f"{_SUBNET}.{x}.2", 9000
        _run("ip", "netns", "add", ns)
        created = True
        _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _run("ip", "link", "set", ns_if, "netns", ns)
        _run("ip", "addr", "add", f"{host_ip}/30", "dev", host_if)
        _run("ip", "link", "set", host_if, "up")
        _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ns_ip}/30", "dev", ns_if)
        _run("ip", "netns", "exec", ns, "ip", "link", "set", ns_if, "up")
        _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        proc = _start_moto(("ip", "netns", "exec", ns), ns_ip, port, server_log)
        _wait_listening(proc, ns_ip, port, 30.0)
        url = f"http://{ns_ip}:{port}"
        # Fill the store while the link is still unshaped.
        _put_probe(url, probe_bytes)
        if populate is not None:
            populate(url)
        unshaped = measure_mbit(url, probe_bytes)
        # Both directions: the namespace's end sends the GET bodies (what the daemon
        # waits for); the host's end carries requests and would carry uploads.
        _tbf(rate_mbit, ns_if, ns)
        _tbf(rate_mbit, host_if)
        s3 = ShapedS3(
            url,
            "netns",
            rate_mbit,
            detail=(
                f"moto in netns {ns} at {ns_ip}:{port}, veth {host_if}<->{ns_if}, "
                f"tc tbf rate {rate_mbit:g}mbit burst {_BURST} latency {_LATENCY} on both ends"
            ),
        )
        s3.unshaped_mbit = unshaped
        s3.measured_mbit = measure_mbit(url, probe_bytes)
        yield s3
    finally:
        if proc is not None:
            _stop(proc)
        if created:
            # Deleting the namespace deletes its end of the pair, which deletes both ends.
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
            subprocess.run(["ip", "link", "del", host_if], capture_output=True, check=False)


# -- the proxy fallback ---------------------------------------------------------------------


class TokenBucket:
    """Bytes per second with a small burst; ``take(n)`` sleeps until ``n`` bytes may pass.

    One bucket per direction is shared by every connection, as a link is."""

    def __init__(self, rate_bytes_s: float, burst_bytes: int) -> None:
        self.rate = rate_bytes_s
        self.burst = float(burst_bytes)
        self._tokens = float(burst_bytes)
        self._stamp = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        """Wait until ``n`` bytes fit (``n`` may exceed the burst: the debt is slept off)."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


class RateLimitedProxy:
    """A TCP proxy on 127.0.0.1 relaying to ``target`` through a token bucket per direction.

    Threads, not asyncio: two pump threads per connection keep it simple, and the pumps
    spend their time in ``recv`` and ``sleep``, both of which release the GIL."""

    CHUNK = 16 * 1024  # relay granularity: small against the burst, so the rate is smooth

    def __init__(self, target: tuple[str, int], rate_bytes_s: float, burst_bytes: int) -> None:
        self.target = target
        self.up = TokenBucket(rate_bytes_s, burst_bytes)  # client -> server
        self.down = TokenBucket(rate_bytes_s, burst_bytes)  # server -> client (GET bodies)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port: int = self._listener.getsockname()[1]
        self._stopping = threading.Event()
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="shaping-proxy", daemon=True)

    def start(self) -> RateLimitedProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting and close every relayed connection."""
        self._stopping.set()
        self._thread.join(5)
        self._listener.close()
        with self._lock:
            socks, self._socks = list(self._socks), set()
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            client.settimeout(None)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._socks.update((client, server))
            for src, dst, bucket in ((client, server, self.up), (server, client, self.down)):
                threading.Thread(
                    target=self._pump, args=(src, dst, bucket), name="shaping-pump", daemon=True
                ).start()

    def _pump(self, src: socket.socket, dst: socket.socket, bucket: TokenBucket) -> None:
        try:
            while data := src.recv(self.CHUNK):
                bucket.take(len(data))
                dst.sendall(data)
            # Half-close: HTTP keep-alive and early-closing clients both behave.
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
        except OSError:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()
        finally:
            with self._lock:
                if src.fileno() == -1:
                    self._socks.discard(src)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def _proxy_s3(
    rate_mbit: float,
    populate: Populate | None,
    probe_bytes: int,
    server_log: Path | None,
) -> Iterator[ShapedS3]:
    port = _free_port()
    proc = _start_moto((), "127.0.0.1", port, server_log)
    proxy: RateLimitedProxy | None = None
    try:
        _wait_listening(proc, "127.0.0.1", port, 30.0)
        direct = f"http://127.0.0.1:{port}"
        _put_probe(direct, probe_bytes)
        if populate is not None:
            populate(direct)  # straight to moto: uploads skip the proxy
        unshaped = measure_mbit(direct, probe_bytes)
        rate = rate_mbit * 1e6 / 8
        proxy = RateLimitedProxy(("127.0.0.1", port), rate, burst_bytes=32 * 1024).start()
        url = f"http://127.0.0.1:{proxy.port}"
        s3 = ShapedS3(
            url,
            "proxy",
            rate_mbit,
            detail=(
                f"moto at {direct} behind a token-bucket TCP proxy at {url} "
                f"({rate_mbit:g} Mbit/s per direction, 32 KiB burst)"
            ),
        )
        s3.unshaped_mbit = unshaped
        s3.measured_mbit = measure_mbit(url, probe_bytes)
        yield s3
    finally:
        if proxy is not None:
            proxy.stop()
        _stop(proc)


# -- a self-check -------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Set up a shaped endpoint, measure a download through it, tear it down."""
    p = argparse.ArgumentParser(description="Check rate shaping of an S3 endpoint here.")
    p.add_argument("--rate", type=float, default=64.0, help="Mbit/s per direction (default 64)")
    p.add_argument("--method", choices=("auto", "netns", "proxy"), default="auto")
    p.add_argument("--probe", type=int, default=8_000_000, help="probe object bytes")
    p.add_argument("--hold", type=float, default=0.0, help="seconds to keep it up afterwards")
    args = p.parse_args(argv)

    def on_term(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    with shaped_s3(args.rate, method=args.method, probe_bytes=args.probe) as s3:
        print(f"{s3.method}: {s3.detail}")
        print(
            f"probe download of {args.probe / 1e6:.1f} MB: {s3.measured_mbit:.1f} Mbit/s "
            f"({s3.measured_mbit / args.rate:.0%} of the {args.rate:g} Mbit/s limit); "
            f"unshaped {s3.unshaped_mbit:.0f} Mbit/s"
        )
        time.sleep(args.hold)
    return 0


if __name__ == "__main__":
    sys.exit(main())
