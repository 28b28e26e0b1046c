"""A shaped S3 endpoint for benchmarks: moto's S3 server behind a slow, distant link.

The link has a rate (bytes per second, shared by all connections) and optionally a
latency (a one-way delay on every byte, so each request/response round trip costs twice
it, as a store in another region does). Two ways to limit the rate, tried in this order:

  netns   moto runs inside its own network namespace, reached over a veth pair with
          addresses in a private /30; a ``tc tbf`` qdisc on each end of the pair limits
          both directions (the namespace's end carries the GET bodies to the daemon). This
          is the kernel's own shaping: the daemon's HTTP client sees a real slow TCP path.
          Needs root, ``ip`` and ``tc`` (``netem`` is not required, only ``tbf``).
  proxy   moto on 127.0.0.1 behind a TCP proxy in a thread of this process, which relays
          bytes through one token bucket per direction (all connections share the link,
          as they would share a real one). Used when the namespace cannot be made.

The latency (``latency_ms`` > 0) comes from a second proxy, ``DelayingProxy``, on the host
in front of either: netem-like, it forwards every chunk ``latency_ms`` after it arrived,
in order, per direction. (This kernel has no ``netem``; ``tbf`` keeps the rate.)

Either way the store is filled *before* shaping starts (``populate`` gets an unshaped
endpoint), so writing the dataset is fast, and once shaping is on, the achieved rate is
measured by downloading a probe object and the round trip by timing small requests.

    with shaped_s3(64, latency_ms=100, populate=upload) as s3:
        print(s3.method, s3.endpoint_url, s3.measured_mbit, s3.request_ms)

``python bench/shaping.py --rate 64 --latency-ms 100`` checks the shaping on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import importlib
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: python bench/shaping.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common

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
    """A running shaped S3 endpoint."""

    endpoint_url: str  # what the daemon talks to: shaped
    method: str  # "netns" (tc tbf on a veth pair) or "proxy" (token-bucket TCP proxy)
    rate_mbit: float  # the configured limit per direction, 10^6 bits/s
    latency_ms: float = 0.0  # the configured one-way delay (the delaying proxy), ms
    measured_mbit: float = 0.0  # a probe download's body rate through the shaping
    unshaped_mbit: float = 0.0  # the same download before shaping: the store's own speed
    request_ms: float = 0.0  # a small request (HEAD) through it, median
    unshaped_request_ms: float = 0.0  # the same before shaping: the store's own time
    detail: str = ""  # how it was set up, for the record
    # Bytes the store has sent across the rate-limited link so far (responses: bodies and
    # headers), read at the shaping layer: netns, the host end's veth receive counter (TCP/IP
    # headers included); proxy, the download token bucket's count. None where unknown.
    link_bytes: Callable[[], int] | None = field(default=None, repr=False)

    def record(self) -> dict[str, Any]:
        """A JSON-able description."""
        return {
            "method": self.method,
            "endpoint_url": self.endpoint_url,
            "rate_mbit": self.rate_mbit,
            "latency_ms": self.latency_ms,
            "measured_mbit": round(self.measured_mbit, 2),
            "unshaped_mbit": round(self.unshaped_mbit, 2),
            "request_ms": round(self.request_ms, 2),
            "unshaped_request_ms": round(self.unshaped_request_ms, 2),
            "detail": self.detail,
        }


@contextlib.contextmanager
def shaped_s3(
    rate_mbit: float,
    *,
    latency_ms: float = 0.0,
    populate: Populate | None = None,
    method: str = "auto",
    probe_bytes: int = 4_000_000,
    server_log: Path | None = None,
    log: Log = print,
) -> Iterator[ShapedS3]:
    """moto's S3 server behind a link limited to ``rate_mbit`` in each direction, and
    ``latency_ms`` away one way (0: no delay).

    ``populate(url)`` runs first, against the same store without shaping (upload the
    dataset there). ``method`` is ``"auto"`` (netns, else proxy), ``"netns"`` or
    ``"proxy"``; the latency is a ``DelayingProxy`` in front of either. Everything
    (server, namespace, veth pair, proxies) is removed on exit, also after an error or a
    SIGTERM turned into ``SystemExit``.
    """
    if method not in ("auto", "netns", "proxy"):
        raise ValueError(f"method must be auto, netns or proxy, not {method!r}")
    if rate_mbit <= 0:
        raise ValueError(f"rate_mbit must be positive, not {rate_mbit}")
    if latency_ms < 0:
        raise ValueError(f"latency_ms must not be negative, not {latency_ms}")
    with _rate_shaped(
        rate_mbit,
        populate,
        method=method,
        probe_bytes=probe_bytes,
        server_log=server_log,
        log=log,
    ) as s3:
        if latency_ms == 0:
            s3.request_ms = measure_request_ms(s3.endpoint_url)
            yield s3
            return
        host, port = _host_port(s3.endpoint_url)
        with DelayingProxy((host, port), latency_ms / 1000) as delay:
            s3.endpoint_url = f"http://127.0.0.1:{delay.port}"
            s3.latency_ms = latency_ms
            s3.detail += (
                f"; in front, a delaying TCP proxy at {s3.endpoint_url} "
                f"({latency_ms:g} ms one way, each direction)"
            )
            s3.measured_mbit = measure_mbit(s3.endpoint_url, probe_bytes)
            s3.request_ms = measure_request_ms(s3.endpoint_url)
            yield s3


def _host_port(url: str) -> tuple[str, int]:
    parsed = urllib.parse.urlsplit(url)
    if parsed.hostname is None or parsed.port is None:
        raise ValueError(f"no host:port in {url!r}")
    return parsed.hostname, parsed.port


@contextlib.contextmanager
def _rate_shaped(
    rate_mbit: float,
    populate: Populate | None,
    *,
    method: str,
    probe_bytes: int,
    server_log: Path | None,
    log: Log,
) -> Iterator[ShapedS3]:
    """The rate limit alone: netns + tc tbf, else the token-bucket proxy."""
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
    from botocore.config import Config

    boto3: Any = importlib.import_module("boto3")  # untyped
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
    """Download the probe object through ``endpoint_url``; returns the achieved 10^6 bit/s
    of its body, timed from the response's headers to its last byte (a rate: the round
    trip before the first byte is ``measure_request_ms``'s)."""
    client = s3_client(endpoint_url)
    client.head_object(Bucket=PROBE_BUCKET, Key=PROBE_KEY)  # connection set up, not timed
    response = client.get_object(Bucket=PROBE_BUCKET, Key=PROBE_KEY)
    started = time.perf_counter()
    body = response["Body"].read()
    secs = time.perf_counter() - started
    if len(body) != nbytes:
        raise RuntimeError(f"probe download returned {len(body)} bytes, expected {nbytes}")
    return nbytes * 8 / secs / 1e6


def measure_request_ms(endpoint_url: str, times: int = 5) -> float:
    """The median time of a HEAD of the probe object, in ms: a round trip of the link plus
    the store's own time (moto closes every connection after its response, so this
    includes connecting: nothing over a loopback or veth link, nothing through the
    delaying proxy without ``handshake``)."""
    client = s3_client(endpoint_url)
    client.head_object(Bucket=PROBE_BUCKET, Key=PROBE_KEY)  # connection set up, not timed
    secs = []
    for _ in range(times):
        started = time.perf_counter()
        client.head_object(Bucket=PROBE_BUCKET, Key=PROBE_KEY)
        secs.append(time.perf_counter() - started)
    return statistics.median(secs) * 1000


# -- one port on loopback (htb) ----------------------------------------------------------------


@contextlib.contextmanager
def loopback_port_shaped(port: int, rate_mbit: float) -> Iterator[str]:
    """What a server on 127.0.0.1:``port`` sends, limited to ``rate_mbit`` (10^6 bits/s,
    all its connections together), for a store that cannot move into a namespace: Ceph
    RGW, whose cluster talks over loopback too (its traffic to the OSD stays unlimited).

    An ``htb`` root on ``lo``: the default class is unlimited, the second holds the
    packets from ``port`` (``u32`` on the source port) at the rate. Yields a description;
    ``lo`` goes back to no qdisc on exit. Needs root and ``tc``; one such run at a time
    (a second replaces the first's root)."""
    if why := netns_unavailable():
        raise RuntimeError(f"cannot shape loopback: {why}")
    burst = "256kb"  # above loopback's 64 KiB packets, or htb holds them back
    try:
        _run("tc", "qdisc", "replace", "dev", "lo", "root", "handle", "1:", "htb", "default", "10")
        _run("tc", "class", "add", "dev", "lo", "parent", "1:", "classid", "1:10", "htb",
             "rate", "100gbit")  # fmt: skip
        _run("tc", "class", "add", "dev", "lo", "parent", "1:", "classid", "1:20", "htb",
             "rate", f"{rate_mbit:g}mbit", "ceil", f"{rate_mbit:g}mbit",
             "burst", burst, "cburst", burst)  # fmt: skip
        _run("tc", "filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "u32",
             "match", "ip", "sport", str(port), "0xffff", "flowid", "1:20")  # fmt: skip
    except _SetupError as exc:
        _unshape_loopback()
        raise RuntimeError(f"cannot shape loopback: {exc}") from exc
    try:
        yield f"tc htb on lo: from port {port} at {rate_mbit:g} mbit/s, burst {burst}"
    finally:
        _unshape_loopback()


def _unshape_loopback() -> None:
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True, check=False)


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


def _counter(path: Path) -> Callable[[], int]:
    """A reader of a byte counter file (``/sys/class/net/IF/statistics/rx_bytes``)."""
    return lambda: int(path.read_text())


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
        unshaped_request_ms = measure_request_ms(url)
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
        s3.unshaped_request_ms = unshaped_request_ms
        s3.link_bytes = _counter(Path(f"/sys/class/net/{host_if}/statistics/rx_bytes"))
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
        self.total = 0  # bytes that passed (or are passing) so far

    def take(self, n: int) -> None:
        """Wait until ``n`` bytes fit (``n`` may exceed the burst: the debt is slept off)."""
        with self._lock:
            self.total += n
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


# -- latency: a delaying TCP proxy ----------------------------------------------------------


class DelayingProxy:
    """A TCP proxy on 127.0.0.1 that delays every byte by ``latency_s``, one way.

    Like ``netem delay``: each chunk read from either side is written to the other side
    ``latency_s`` after it arrived, in order, per direction, so a request and its response
    cost a round trip of ``2 * latency_s`` while a stream keeps its throughput (a delay,
    not a rate: the bytes of a long response flow back to back, ``latency_s`` late).

    ``handshake=True`` also charges a new connection the TCP handshake's round trip (the
    client's first bytes leave ``2 * latency_s`` after it connected; the proxy accepts at
    once, so the client cannot wait for it). Off by default: moto's server (werkzeug's)
    closes the connection after every response, so each request would pay a second round
    trip that S3, which keeps connections alive for the client's pool, does not charge.
    Without it a request costs one round trip however the server treats connections.

    At most ``window_bytes`` per direction and connection wait in the delay line, like a
    TCP window; the default is far above what the benchmark's links carry in one delay,
    so it never limits them.

    One asyncio loop in one background thread relays every connection (the daemon opens up
    to 64): per connection and direction, a task reads and a task writes what is due."""

    CHUNK = 64 * 1024

    def __init__(
        self,
        target: tuple[str, int],
        latency_s: float,
        *,
        handshake: bool = False,
        window_bytes: int = 8 << 20,
    ) -> None:
        if latency_s < 0:
            raise ValueError(f"latency must not be negative, not {latency_s}")
        self.target = target
        self.latency_s = latency_s
        self.handshake = handshake
        self.window_bytes = window_bytes
        self.port = 0
        self.connections = 0  # accepted so far
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._stopping: asyncio.Event | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._run, name="delaying-proxy", daemon=True)

    def start(self) -> DelayingProxy:
        """Listen (on a free port, ``self.port``) and relay in the background."""
        self._thread.start()
        self._ready.wait(10)
        if self._failed is not None:
            raise RuntimeError(f"delaying proxy failed to start: {self._failed}")
        if not self.port:
            raise RuntimeError("delaying proxy did not start within 10 s")
        return self

    def stop(self) -> None:
        """Stop accepting, close every relayed connection, end the thread."""
        if self._thread.is_alive() and self._stopping is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(10)

    def __enter__(self) -> DelayingProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported by start(), or lost at exit
            self._failed = exc
        finally:
            self._ready.set()
            self._loop.close()

    async def _serve(self) -> None:
        self._stopping = asyncio.Event()
        server = await asyncio.start_server(self._accepted, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            await self._stopping.wait()
        finally:
            server.close()
            for task in list(self._handlers):
                task.cancel()
            if self._handlers:
                await asyncio.wait(list(self._handlers), timeout=5)

    async def _accepted(
        self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self.connections += 1
        opens_at = self._loop.time() + (2 * self.latency_s if self.handshake else 0.0)
        try:
            await self._relay(c_reader, c_writer, opens_at)
        except asyncio.CancelledError:
            pass  # stop(): end quietly (a cancelled callback task is logged as an error)
        finally:
            self._handlers.discard(task)

    async def _relay(
        self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter, opens_at: float
    ) -> None:
        s_writer: asyncio.StreamWriter | None = None
        try:
            s_reader, s_writer = await asyncio.open_connection(*self.target)
            for writer in (c_writer, s_writer):
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._direction(c_reader, s_writer, opens_at))
                tg.create_task(self._direction(s_reader, c_writer, 0.0))
        except* (OSError, asyncio.IncompleteReadError):
            pass  # either side reset or refused: drop the connection, as a link would
        finally:
            for w in (c_writer, s_writer):
                if w is not None:
                    w.close()

    async def _direction(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, opens_at: float
    ) -> None:
        """Relay one direction through the delay line; EOF travels (delayed) as well."""
        line: collections.deque[tuple[float, bytes]] = collections.deque()
        arrived, drained = asyncio.Event(), asyncio.Event()
        queued = 0

        async def receive() -> None:
            nonlocal queued
            while True:
                while queued >= self.window_bytes:
                    drained.clear()
                    await drained.wait()
                data = await reader.read(self.CHUNK)
                due = max(self._loop.time(), opens_at) + self.latency_s
                line.append((due, data))
                queued += len(data)
                arrived.set()
                if not data:
                    return

        async def send() -> None:
            nonlocal queued
            while True:
                while not line:
                    arrived.clear()
                    await arrived.wait()
                wait = line[0][0] - self._loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                # Everything due by now goes in one write.
                now, out, eof = self._loop.time(), [], False
                while line and line[0][0] <= now and not eof:
                    _, data = line.popleft()
                    out.append(data)
                    eof = not data
                nbytes = sum(map(len, out))
                queued -= nbytes
                drained.set()
                if nbytes:
                    writer.write(b"".join(out))
                    await writer.drain()
                if eof:
                    if writer.can_write_eof():
                        writer.write_eof()  # half-close, as the sender did
                    return

        async with asyncio.TaskGroup() as tg:
            tg.create_task(receive())
            tg.create_task(send())


@contextlib.contextmanager
def _proxy_s3(
    rate_mbit: float,
    populate: Populate | None,
    probe_bytes: int,
    server_log: Path | None,
) -> Iterator[ShapedS3]:
    port = common.free_tcp_port()
    proc = _start_moto((), "127.0.0.1", port, server_log)
    proxy: RateLimitedProxy | None = None
    try:
        _wait_listening(proc, "127.0.0.1", port, 30.0)
        direct = f"http://127.0.0.1:{port}"
        _put_probe(direct, probe_bytes)
        if populate is not None:
            populate(direct)  # straight to moto: uploads skip the proxy
        unshaped = measure_mbit(direct, probe_bytes)
        unshaped_request_ms = measure_request_ms(direct)
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
        s3.unshaped_request_ms = unshaped_request_ms
        down = proxy.down
        s3.link_bytes = lambda: down.total
        s3.measured_mbit = measure_mbit(url, probe_bytes)
        yield s3
    finally:
        if proxy is not None:
            proxy.stop()
        _stop(proc)


# -- a self-check -------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Set up a shaped endpoint, measure a download and requests through it, tear it down."""
    p = argparse.ArgumentParser(description="Check the shaping of an S3 endpoint here.")
    p.add_argument("--rate", type=float, default=64.0, help="Mbit/s per direction (default 64)")
    p.add_argument(
        "--latency-ms", type=float, default=0.0, help="one-way delay, ms (default 0: none)"
    )
    p.add_argument("--method", choices=("auto", "netns", "proxy"), default="auto")
    p.add_argument("--probe", type=int, default=8_000_000, help="probe object bytes")
    p.add_argument("--hold", type=float, default=0.0, help="seconds to keep it up afterwards")
    args = p.parse_args(argv)

    def on_term(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    with shaped_s3(
        args.rate, latency_ms=args.latency_ms, method=args.method, probe_bytes=args.probe
    ) as s3:
        print(f"{s3.method}: {s3.detail}")
        print(
            f"probe download of {args.probe / 1e6:.1f} MB: {s3.measured_mbit:.1f} Mbit/s "
            f"({s3.measured_mbit / args.rate:.0%} of the {args.rate:g} Mbit/s limit); "
            f"unshaped {s3.unshaped_mbit:.0f} Mbit/s"
        )
        print(
            f"a HEAD request: {s3.request_ms:.1f} ms "
            f"(2 x {args.latency_ms:g} ms delay configured); unshaped "
            f"{s3.unshaped_request_ms:.1f} ms"
        )
        time.sleep(args.hold)
    return 0


@contextlib.contextmanager
def moto_server(log_path: Path) -> Iterator[str]:
    """moto's S3 server as its own process on 127.0.0.1 (its request handling must not
    compete with the training loop for this process's GIL); stopped on exit, also after an
    error. Yields its endpoint URL."""
    port = common.free_tcp_port()
    proc = _start_moto((), "127.0.0.1", port, log_path)
    try:
        _wait_listening(proc, "127.0.0.1", port, 60.0)
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc)


if __name__ == "__main__":
    sys.exit(main())
