"""Real daemons for tests: in-process (own thread and event loop) or ``cached serve`` as a
subprocess. Both listen on real ZeroMQ sockets in a temporary directory."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cached.config import Config, load
from cached.daemon import Daemon
from cached_demo.stack import DaemonProcess, daemon_in_thread, write_config
from cached_demo.tars import make_tar


def isolate_env(mp: pytest.MonkeyPatch) -> None:
    """Drop the caller's ``AWS_*`` and ``CACHED_*`` variables; use test credentials only."""
    for name in list(os.environ):
        if name.startswith(("AWS_", "CACHED_")):
            mp.delenv(name)
    mp.setenv("AWS_ACCESS_KEY_ID", "testing")
    mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
    mp.setenv("AWS_CONFIG_FILE", "/dev/null")
    mp.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")


def daemon_config(tmp: Path, endpoint_url: str | None, **values: Any) -> Config:
    """A config for a test daemon in ``tmp``: ipc socket, free HTTP port, small retries."""
    overrides: dict[str, Any] = {
        "server.socket": f"ipc://{tmp}/cached.sock",
        "server.http": "127.0.0.1:0",
        "cache.dir": str(tmp / "hot"),
        "cache.capacity": "1GiB",
        "cache.min_free": "0",
        "s3.endpoint_url": endpoint_url,
        "s3.retry_base_delay_s": 0.01,
        "s3.retry_max_delay_s": 0.05,
        "s3.retry_attempts": 3,
    }
    overrides.update(values)
    return load(None, env={}, overrides=overrides)


@dataclass
class ThreadDaemon:
    """A daemon running in a background thread of this process."""

    daemon: Daemon
    loop: asyncio.AbstractEventLoop
    socket: str

    def call(self, fn: Any) -> Any:
        """Run ``fn()`` on the daemon's loop and return its result (for inspection)."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def served(self) -> tuple[float, float]:
        """(payload bytes served, those of them read by local readers from the files: the
        local replies, less those a reader could not use and asked again for)."""
        m = self.daemon.metrics

        def get() -> tuple[float, float]:
            local = m.local_read_bytes._value.get() - m.local_fallback_bytes._value.get()
            return m.served_bytes._value.get(), local

        return self.call(get)

    def leases_left(self, settle_s: float = 5.0) -> int:
        """The leases (pins) still held once a reader that just finished has had
        ``settle_s`` for its last releases to arrive: a reader sends ``close`` without
        waiting for the answer, so the daemon may see it after the reader's last batch."""
        deadline = time.monotonic() + settle_s
        while True:
            held: int = self.call(lambda: len(self.daemon.server.leases._held))
            if held == 0 or time.monotonic() > deadline:
                return held
            time.sleep(0.01)


@contextmanager
def thread_daemon(cfg: Config) -> Iterator[ThreadDaemon]:
    """Start a daemon on its own loop in a thread; stop it (drain + close) afterwards."""
    with daemon_in_thread(cfg) as (daemon, loop):
        yield ThreadDaemon(daemon, loop, daemon.server.bound_endpoint)


def serve_config(
    directory: Path,
    endpoint_url: str,
    *,
    sections: dict[str, dict[str, Any]] | None = None,
    **s3: Any,
) -> tuple[Path, str]:
    """A ``cached serve`` config in ``directory``: its own ipc socket and hot tier, a free
    HTTP port, small retry delays, and ``s3``'s other ``[s3]`` settings; ``sections`` adds
    keys to any section. Returns the config's path and the socket."""
    socket = f"ipc://{directory}/cached.sock"
    cfg: dict[str, dict[str, Any]] = {
        "server": {"socket": socket, "http": "127.0.0.1:0"},
        "cache": {"dir": str(directory / "hot"), "capacity": "1GiB", "min_free": "0"},
        "s3": {
            "endpoint_url": endpoint_url,
            "retry_attempts": 3,
            "retry_base_delay_s": 0.01,
            "retry_max_delay_s": 0.05,
            **s3,
        },
    }
    for section, values in (sections or {}).items():
        cfg[section] = {**cfg.get(section, {}), **values}
    return write_config(directory / "config.toml", cfg), socket


# The tests' name for ``cached serve`` as a subprocess.
ProcessDaemon = DaemonProcess

__all__ = [
    "ProcessDaemon",
    "daemon_config",
    "dataset_shards",
    "make_tar",
    "serve_config",
    "thread_daemon",
    "write_config",
]


def dataset_shards(
    n_shards: int, per_shard: list[int] | int, payload: int = 100, prefix: str = "s"
) -> list[bytes]:
    """Shards of samples ``{prefix}{shard}-{i}`` with a ``bin`` member of deterministic
    bytes and a ``cls`` member; ``per_shard`` may differ per shard (uneven shards)."""
    counts = per_shard if isinstance(per_shard, list) else [per_shard] * n_shards
    shards = []
    for s, n in enumerate(counts):
        samples = []
        for i in range(n):
            key = f"{prefix}{s:04d}-{i:05d}"
            body = (key.encode() * (payload // len(key) + 1))[:payload]
            samples.append((key, {"bin": body, "cls": str(i % 10).encode()}))
        shards.append(make_tar(samples))
    return shards


def held_files(hot_dir: Path) -> list[str]:
    """The hot-tier files this process has open (a deleted one ends in " (deleted)")."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor)
        if target.startswith(f"{hot_dir}/"):
            out.append(target)
    return out
