"""A local stack on one machine, for ``cached demo``, the tests and the benchmarks: an
S3-compatible endpoint on loopback, TOML configs, and ``cached serve`` as a real subprocess
(or a daemon in a thread of this process). The WebDataset tars to put in it:
:func:`cached.demo.tars.make_tar`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from cached_client.errors import DaemonUnavailable
from cached_client.transport import Connection
from cached_wire.protocol import Op

if TYPE_CHECKING:
    from cached.config import Config
    from cached.daemon import Daemon


@contextlib.contextmanager
def daemon_in_thread(
    cfg: Config, *, start_timeout_s: float = 30.0
) -> Iterator[tuple[Daemon, asyncio.AbstractEventLoop]]:
    """A daemon on its own event loop in a background thread of this process (so that a
    test or a benchmark can look into it), and that loop; stopped (drained, closed) at
    the end. An error while it starts is raised here."""
    from cached.daemon import Daemon

    started = threading.Event()
    holder: dict[str, Any] = {}

    async def main() -> None:
        stop = asyncio.Event()
        holder["stop"], holder["loop"] = stop, asyncio.get_running_loop()
        try:
            async with Daemon(cfg) as daemon:
                holder["daemon"] = daemon
                started.set()
                await daemon.serve_until(stop)
        except BaseException as exc:
            holder["error"] = exc
            started.set()
            raise

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    if not started.wait(start_timeout_s):
        raise RuntimeError(f"the daemon did not start within {start_timeout_s:.0f}s")
    if "error" in holder:
        raise holder["error"]
    try:
        yield holder["daemon"], holder["loop"]
    finally:
        holder["loop"].call_soon_threadsafe(holder["stop"].set)
        thread.join(start_timeout_s)


@contextlib.contextmanager
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1, a free port (needs the ``demo`` extra)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def write_config(path: Path, cfg: Mapping[str, Mapping[str, Any]]) -> Path:
    """Write a TOML config from nested mappings of strings, numbers, booleans and lists of
    strings."""
    lines = []
    for section, values in cfg.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if isinstance(value, bool):
                lines.append(f"{key} = {'true' if value else 'false'}")
            elif isinstance(value, int | float):
                lines.append(f"{key} = {value}")
            elif isinstance(value, list | tuple):
                lines.append(f"{key} = {json.dumps([str(v) for v in value])}")  # a TOML array
            else:
                lines.append(f"{key} = {json.dumps(str(value))}")  # a TOML basic string
    path.write_text("\n".join(lines) + "\n")
    return path


class DaemonProcess:
    """``cached serve --config PATH`` as a subprocess. ``with`` starts and always stops it."""

    def __init__(
        self,
        config: Path,
        socket: str,
        env: Mapping[str, str] | None = None,
        log: Path | None = None,
        flags: Sequence[str] = (),
    ) -> None:
        self.config = config
        self.flags = list(flags)  # before `serve`: e.g. -v
        self.socket = socket
        self.log = log or config.with_suffix(".log")
        # A caller's CACHED_* variables would override the config under test.
        base = {k: v for k, v in os.environ.items() if not k.startswith("CACHED_")}
        self.env = {**base, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def command(self) -> list[str]:
        """The daemon's command line (a benchmark may run a variant of the daemon)."""
        return [sys.executable, "-m", "cached", *self.flags, "serve", "--config", str(self.config)]

    def start(self, timeout_s: float = 60.0) -> Self:
        """Start it and wait until it answers a handshake."""
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"cached serve exited {self.proc.returncode}:\n{self.log_tail()}"
                )
            conn = Connection(self.socket, connect_timeout_s=0.5)
            try:
                conn.open()
                return self
            except DaemonUnavailable:
                if time.monotonic() > deadline:
                    self.stop()
                    raise
            finally:
                conn.close()

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        """Send ``sig`` (SIGTERM drains), SIGKILL after 20 s; returns the exit code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(sig)
        try:
            return proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def status(self) -> dict[str, Any]:
        """The daemon's status reply."""
        conn = Connection(self.socket, connect_timeout_s=5.0)
        try:
            header, _ = conn.request({"op": Op.STATUS})
        finally:
            conn.close()
        status: dict[str, Any] = header["status"]
        return status

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the daemon's log."""
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-chars:]
        return ""
