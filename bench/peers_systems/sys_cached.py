"""cached: a real ``cached serve`` (a fresh hot tier of the cache limit's capacity, the
daemon's defaults otherwise) reading the WebDataset shards from the shaped store, and the
two clients: ``CachedDataset`` in the DataLoader, ``FastLoader`` in the training process."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from bench.peers_systems import base
from cached_demo.stack import DaemonProcess, write_config


@dataclass
class _DaemonPeer(base.Peer):
    daemon: DaemonProcess | None = None

    def start_daemon(self) -> DaemonProcess:
        work = self.workdir
        socket = f"ipc://{work}/cached.sock"
        config = write_config(
            work / "daemon.toml",
            {
                "server": {"socket": socket, "http": "127.0.0.1:0"},
                "cache": {
                    "dir": str(work / "hot"),
                    "capacity": self.spec.capacity,
                    "min_free": 0,
                },
                "s3": {"endpoint_url": self.spec.endpoint, "addressing_style": "path"},
            },
        )
        # PYTHONSAFEPATH: the daemon imports `cached` as installed (or from PYTHONPATH),
        # not from the working directory (the repository root, where the runner starts):
        # so an A/B of two checkouts through PYTHONPATH reaches it, as in bench/fetch.py.
        env = {**base.aws_env(self.spec.endpoint), "PYTHONSAFEPATH": "1"}
        daemon = DaemonProcess(config, socket, env=env, log=work / "daemon.log")
        daemon.start()
        assert daemon.proc is not None
        self.daemon, self.daemon_pid = daemon, daemon.proc.pid
        return daemon

    def close(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()

    def failure_detail(self) -> str:
        return "" if self.daemon is None else self.daemon.log_tail(2000)


@dataclass
class CachedDatasetPeer(_DaemonPeer):
    loader: Any = None
    ds: Any = None

    def open(self) -> None:
        from cached_client import CachedDataset

        daemon = self.start_daemon()
        self.ds = CachedDataset(
            self.spec.tar_urls, socket=daemon.socket, shuffle=True, seed=self.spec.seed
        )
        self.loader = base.data_loader(self.ds, self.spec)

    def batches(self, epoch: int) -> Iterable[Any]:
        self.ds.set_epoch(epoch)
        return self.loader  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.loader is not None:
            base.shutdown_workers(self.loader)
        super().close()


@dataclass
class FastLoaderPeer(_DaemonPeer):
    loader: Any = None

    def open(self) -> None:
        from cached_client import FastLoader

        daemon = self.start_daemon()
        self.loader = FastLoader(
            self.spec.tar_urls,
            batch_size=self.spec.batch_size,
            socket=daemon.socket,
            shuffle=True,
            seed=self.spec.seed,
        )

    def batches(self, epoch: int) -> Iterable[Any]:
        self.loader.set_epoch(epoch)
        return self.loader  # type: ignore[no-any-return]

    def items(self, batch: Any) -> Iterator[base.Item]:
        offsets: dict[str, list[int]] = batch.offsets
        for i, key in enumerate(batch.keys):
            yield key, sum(offs[i + 1] - offs[i] for offs in offsets.values())
