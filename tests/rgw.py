"""A real S3 engine for tests and benchmarks: a single-node Ceph cluster with its RADOS
Gateway, started in a temporary folder and stopped again.

One monitor, one OSD on MemStore (objects live in the OSD's memory; nothing touches a
disk but the monitor's small store) and ``radosgw`` on 127.0.0.1, a free port, with
authentication off inside the cluster (``auth none``) and an S3 user whose keys are the
tests' (``testing``/``testing``). From an empty folder to the first PUT takes 2-3 s;
it holds about 110 MiB resident at idle.

    with RGW.start() as rgw:
        print(rgw.endpoint_url, rgw.access_key, rgw.secret_key)

``python -m tests.rgw`` runs one until Ctrl-C and prints how to reach it.

Needs Debian's ``ceph-mon ceph-osd radosgw ceph-common`` (Ceph 16.2 on bookworm) and,
for the daemons' limits and folders, root. :func:`unavailable` says in one line why a
cluster cannot start here, or returns None. Each of Ceph's pitfalls met on the way is
commented where it is handled (search for "Pitfall").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("ceph-mon", "ceph-osd", "radosgw", "ceph-common")
# The binaries each package brings, as checked by unavailable().
_BINARIES = {
    "ceph-mon": "ceph-mon",
    "monmaptool": "ceph-common",
    "ceph": "ceph-common",
    "ceph-osd": "ceph-osd",
    "radosgw": "radosgw",
    "radosgw-admin": "radosgw",
}
ACCESS_KEY = "testing"
SECRET_KEY = "testing"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


class RGWUnavailable(RuntimeError):
    """A cluster cannot start here; the message says why in one line."""


def unavailable() -> str | None:
    """Why a cluster cannot start on this machine (one line), or None if it can."""
    missing = sorted({pkg for exe, pkg in _BINARIES.items() if shutil.which(exe) is None})
    if missing:
        return (
            f"Ceph RGW not installed (apt-get install --no-install-recommends "
            f"{' '.join(missing)}; `make system-deps` does it as root)"
        )
    if os.geteuid() != 0:
        return "Ceph RGW needs root here (the Ceph daemons set limits and use /var/run/ceph)"
    return None


def _with_parent(args: list[str]) -> list[str]:
    # A test run killed from outside (pytest-timeout's os._exit, CI's kill) runs no
    # teardown; without this the cluster would live on, holding its memory. setpriv
    # (util-linux) sets the parent-death signal and execs, so the PID stays the daemon's.
    # SIGKILL, not SIGTERM: all three stopping at once would hang radosgw.
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *args] if setpriv else args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _config(root: Path, fsid: str, mon_port: int, rgw: str, frontend: str) -> str:
    """ceph.conf; ``rgw``: radosgw's ``host:port``."""
    return f"""\
[global]
fsid = {fsid}
mon host = [v2:127.0.0.1:{mon_port}]
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind ipv6 = false
auth cluster required = none
auth service required = none
auth client required = none
# Pitfall: with auth none, radosgw's monitor client still asks for a secure msgr2
# session that the monitor does not offer, and hangs for 300 s before giving up. The
# plain crc mode is what auth none can do.
ms mon client mode = crc
ms client mode = crc
ms cluster mode = crc
ms service mode = crc
run dir = {root}/run
admin socket = {root}/run/$name.asok
pid file = {root}/run/$name.pid
log file = {root}/log/$name.log
log to stderr = false
err to stderr = false
mon cluster log file = {root}/log/cluster.log
# Nothing but this folder: no /etc/ceph keyring to search for.
keyring = {root}/keyring
# One OSD: pools of one replica, placed on that OSD itself, no health warning for it.
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false
mon allow pool delete = true
# Pitfall: on a nearly full disk the monitor warns (and at 5 % refuses to run); its own
# store here is a few MB, so do not let the host's free space decide.
mon data avail warn = 1
mon data avail crit = 0
# Pitfall: the monitor batches map changes every second by default; radosgw's first
# start creates half a dozen pools one after the other, 8 s instead of 1 s.
paxos propose interval = 0.1
mon osd down out interval = 0
# No mgr in this cluster: no warning about it either.
mon warn on no mgr = false
osd objectstore = memstore
memstore device bytes = 4294967296
osd data = {root}/$name
mon data = {root}/$name
# Pitfall: at stop the OSD waits for the monitor to acknowledge that it is going down,
# 5 s of nothing when the monitor follows it.
osd fast shutdown notify mon = false
osd max object size = 4294967296

[client.rgw]
rgw frontends = beast endpoint={rgw} {frontend}
rgw thread pool size = 64
# Pitfall: deleted and overwritten objects wait for garbage collection 2 h by default;
# on MemStore their bytes stay in RAM all that time. Collect after seconds.
rgw gc obj min wait = 5
rgw gc processor period = 10
rgw gc processor max time = 10
# The ops log (every request as JSON on a Unix socket) is how RGWServer counts requests
# at the server, as tests/s3server.py does inside moto.
rgw enable ops log = true
rgw ops log socket path = {root}/run/ops.sock
rgw ops log data backlog = 67108864
rgw enable usage log = false
# SSE-KMS with a fixed test key (the "testing" backend, no KMS server), over plain HTTP,
# so that encrypted objects can be written as on S3: ServerSideEncryption="aws:kms",
# SSEKMSKeyId="testkey-1".
rgw crypt s3 kms backend = testing
rgw crypt s3 kms encryption keys = testkey-1=AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=
rgw crypt require ssl = false
"""


@dataclass
class RGW:
    """A running single-node cluster: its S3 endpoint, credentials and processes."""

    root: Path
    endpoint_url: str
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    pids: dict[str, int] = field(default_factory=dict)
    #: The name of a daemon of the cluster that has exited, or None while all run.
    exited: Callable[[], str | None] = lambda: None

    @classmethod
    @contextmanager
    def start(
        cls,
        root: Path | None = None,
        *,
        port: int = 0,
        frontend: str = "",
        host: str = "127.0.0.1",
        access_key: str = ACCESS_KEY,
        secret_key: str = SECRET_KEY,
    ) -> Iterator[RGW]:
        """Start mon, OSD and radosgw in ``root`` (a new temporary folder if None) on
        ``host:port`` (a free port if 0), create the S3 user with the keys given, wait
        until it serves, and stop everything afterwards, radosgw first. ``frontend``: more
        options of the beast frontend (``request_timeout_ms=200``: idle connections closed
        after 0.2 s). Raises :class:`RGWUnavailable` (one line) if it cannot start here, or
        ``RuntimeError`` with the tail of the failing daemon's log."""
        why = unavailable()
        if why:
            raise RGWUnavailable(why)
        with ExitStack() as stack:
            if root is None:
                root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rgw-")))
            rgw_port = port or free_port()
            keys = (access_key, secret_key)
            cluster = _Cluster(root, free_port(), rgw_port, frontend, host, keys)
            stack.callback(cluster.stop)
            cluster.start()
            yield cls(
                root,
                f"http://127.0.0.1:{rgw_port}",
                access_key,
                secret_key,
                pids=cluster.pids,
                exited=cluster.exited,
            )

    def log(self, name: str = "client.rgw", lines: int = 20) -> str:
        """The last ``lines`` of a daemon's log (``mon.a``, ``osd.0``, ``client.rgw``)."""
        path = self.root / "log" / f"{name}.log"
        with suppress(OSError):
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        return ""


class _Cluster:
    """The processes, started and stopped in order."""

    def __init__(  # noqa: PLR0917
        self,
        root: Path,
        mon_port: int,
        rgw_port: int,
        frontend: str,
        host: str,
        keys: tuple[str, str],
    ) -> None:
        self.root = root
        self.frontend = frontend
        self.host = host
        self.keys = keys
        self.conf = root / "ceph.conf"
        self.mon_port = mon_port
        self.rgw_port = rgw_port
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.pids: dict[str, int] = {}

    def _run(self, *args: str, timeout: float = 30.0) -> str:
        cmd = [*args, "-c", str(self.conf)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(args[:3])} failed ({done.returncode}): "
                f"{(done.stderr or done.stdout).strip()[-500:]}"
            )
        return done.stdout

    def _spawn(self, name: str, *args: str) -> None:
        # -f: in the foreground, so the PID is ours to signal and to wait for.
        with open(self.root / "log" / f"{name}.stderr", "wb") as stderr:
            proc = subprocess.Popen(
                _with_parent([*args, "-f", "-c", str(self.conf)]),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,  # a Ctrl-C at the terminal is ours to pass on, in order
            )
        self.procs[name] = proc
        self.pids[name] = proc.pid

    def start(self) -> None:
        root = self.root
        for sub in ("run", "log", "mon.a", "osd.0"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        fsid = str(uuid.uuid4())
        rgw = f"{self.host}:{self.rgw_port}"
        self.conf.write_text(_config(root, fsid, self.mon_port, rgw, self.frontend))
        monmap = str(root / "monmap")
        self._run(
            "monmaptool", "--create", "--fsid", fsid, "--addv", "a",
            f"[v2:127.0.0.1:{self.mon_port}]", monmap,
        )  # fmt: skip
        self._run("ceph-mon", "--mkfs", "-i", "a", "--monmap", monmap)
        self._spawn("mon.a", "ceph-mon", "-i", "a")
        osd_uuid = str(uuid.uuid4())
        # The first command also waits for the monitor to form its quorum of one.
        osd_id = self._run("ceph", "--connect-timeout", "20", "osd", "create", osd_uuid).strip()
        if osd_id != "0":
            raise RuntimeError(f"expected OSD id 0, the monitor gave {osd_id!r}")
        self._run("ceph-osd", "-i", "0", "--mkfs", "--osd-uuid", osd_uuid)
        self._spawn("osd.0", "ceph-osd", "-i", "0")
        self._spawn("client.rgw", "radosgw", "-n", "client.rgw")
        self._wait_http()
        # The S3 user; radosgw-admin talks to RADOS directly, radosgw sees the user at
        # its next request. Its keys are the tests' AWS_ACCESS_KEY_ID/SECRET.
        self._run(
            "radosgw-admin", "-n", "client.rgw", "user", "create", "--uid", "testing",
            "--display-name", "cached tests", "--access-key", self.keys[0],
            "--secret", self.keys[1],
        )  # fmt: skip

    def _wait_http(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        url = f"http://127.0.0.1:{self.rgw_port}/"
        while True:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}): {self._tail(name)}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:  # anonymous ListBuckets
                    r.read()
                return
            except urllib.error.HTTPError:
                return  # any S3 answer means it serves
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"radosgw not serving after {START_TIMEOUT_S:.0f} s: "
                                   f"{self._tail('client.rgw')}")  # fmt: skip
            time.sleep(0.05)

    def exited(self) -> str | None:
        """The name of a daemon that has exited, or None."""
        return next((n for n, p in self.procs.items() if p.poll() is not None), None)

    def _tail(self, name: str) -> str:
        text = ""
        for suffix in (".stderr", ".log"):
            with suppress(OSError):
                text += (self.root / "log" / f"{name}{suffix}").read_text(errors="replace")
        return " | ".join(text.strip().splitlines()[-5:])

    def stop(self) -> None:
        # Pitfall: radosgw stopped after the OSD or the monitor hangs in its shutdown,
        # waiting on RADOS operations that never complete. So the reverse of the start
        # order, each by its own PID (never by name: other clusters may run here).
        for name in ("client.rgw", "osd.0", "mon.a"):
            proc = self.procs.pop(name, None)
            if proc is None:
                continue
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.pids.clear()


@dataclass
class OpsLog:
    """The requests radosgw served, each passed to ``record(method, path)``, from its ops
    log socket (requests naming a bucket that exists; a missing bucket is not logged).

    Entries arrive asynchronously. A caller that must see every request answered so far
    makes a marker request (a path with ``/__sync__/<marker>``) and calls
    :meth:`wait_for` with it: radosgw logs a request before it completes its response,
    and the socket keeps the order, so every earlier request has been recorded by then."""

    path: Path
    record: Callable[[str, str], None]
    _seen_markers: set[str] = field(default_factory=set)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _sock: socket.socket | None = None
    _thread: threading.Thread | None = None

    def start(self) -> None:
        deadline = time.monotonic() + 10
        while True:
            sock = socket.socket(socket.AF_UNIX)
            try:
                sock.connect(str(self.path))
                break
            except OSError:
                sock.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self._sock = sock
        self._thread = threading.Thread(target=self._read, daemon=True, name="rgw-ops-log")
        self._thread.start()

    def close(self) -> None:
        if self._sock is not None:
            with suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        if self._thread is not None:
            self._thread.join(5)

    def _read(self) -> None:
        assert self._sock is not None
        decoder = json.JSONDecoder()
        buf = ""
        while True:
            try:
                data = self._sock.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            buf += data.decode(errors="replace")
            # A stream of JSON objects, separated by "[" at the start and ","s.
            while True:
                buf = buf.lstrip("[, \n\r\t")
                if not buf:
                    break
                try:
                    entry, end = decoder.raw_decode(buf)
                except ValueError:
                    break
                buf = buf[end:]
                self._add(entry)

    def _add(self, entry: dict[str, object]) -> None:
        uri = str(entry.get("uri", ""))
        method, _, rest = uri.partition(" ")
        path = rest.rsplit(" ", 1)[0].split("?", 1)[0]
        with self._cond:
            if "/__sync__/" in path:
                self._seen_markers.add(path.rsplit("/", 1)[-1])
                self._cond.notify_all()
                return
        self.record(method, path)

    def wait_for(self, marker: str, timeout_s: float = 10.0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: marker in self._seen_markers, timeout_s):
                raise TimeoutError(f"radosgw's ops log did not show request {marker}")
            self._seen_markers.discard(marker)


def main(argv: list[str] | None = None) -> None:
    """Run a cluster until Ctrl-C (or SIGTERM), printing its endpoint and credentials."""
    ap = argparse.ArgumentParser(prog="python -m tests.rgw", description=main.__doc__)
    ap.add_argument("--port", type=int, default=7480, help="radosgw's port (0: any free)")
    ap.add_argument("--dir", type=Path, help="keep the cluster's files here (default: temp)")
    ap.add_argument("--host", default="127.0.0.1", help="radosgw's address (0.0.0.0: all)")
    ap.add_argument(
        "--access-key",
        default=os.environ.get("RGW_ACCESS_KEY", ACCESS_KEY),
        help="the S3 user's access key ($RGW_ACCESS_KEY, else testing)",
    )
    ap.add_argument(
        "--secret-key",
        default=os.environ.get("RGW_SECRET_KEY", SECRET_KEY),
        help="the S3 user's secret key ($RGW_SECRET_KEY, else testing)",
    )
    ap.add_argument("--ready-file", type=Path, help="created once it serves (a healthcheck)")
    args = ap.parse_args(argv)
    why = unavailable()
    if why:
        raise SystemExit(f"rgw: {why}")
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    t0 = time.monotonic()
    keys = {"access_key": args.access_key, "secret_key": args.secret_key}
    with RGW.start(args.dir, port=args.port, host=args.host, **keys) as rgw:
        print(
            f"RGW ready in {time.monotonic() - t0:.1f} s (Ctrl-C stops it)\n"
            f"  endpoint    {rgw.endpoint_url}   (path-style addressing)\n"
            f"  credentials AWS_ACCESS_KEY_ID={rgw.access_key} "
            f"AWS_SECRET_ACCESS_KEY={rgw.secret_key}\n"
            f"  daemon      CACHED_S3_ENDPOINT_URL={rgw.endpoint_url}\n"
            f"  files       {rgw.root}",
            flush=True,
        )
        if args.ready_file:
            args.ready_file.parent.mkdir(parents=True, exist_ok=True)
            args.ready_file.touch()
        # Until a signal, or until a daemon exits: then the others are stopped and the
        # exit status is 1 (a container's restart policy, `docker compose ps`, see it).
        while not stopping.wait(0.5):
            if (gone := rgw.exited()) is not None:
                print(f"{gone} exited: {rgw.log(gone, 5)}", flush=True)
                raise SystemExit(1)
        print("stopping (radosgw, then the OSD, then the monitor)", flush=True)


if __name__ == "__main__":
    main()
