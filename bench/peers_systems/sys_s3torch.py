"""s3torchconnector (Amazon's, on the CRT's mountpoint-s3-client): its documented use with
WebDataset shards, ``S3IterableDataset`` yielding one reader per tar object (split over the
DataLoader workers by ``enable_sharding``) fed to webdataset's tar expander and key grouper.
It has no cache: every epoch reads every shard from the store. For the same loop as the
others, the shard order is shuffled per epoch (seed + epoch) and the samples go through
webdataset's shuffle buffer (1000, yielding after 100)."""

from __future__ import annotations

import ctypes
import importlib
import multiprocessing
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import IterableDataset

from bench.peers_systems import base


def shard_to_dict(reader: Any) -> dict[str, Any]:
    """An S3 reader as webdataset's tar expander takes it."""
    return {"url": reader.key, "stream": reader}


class S3TarSamples(IterableDataset[dict[str, Any]]):
    """The samples of tar shards read by s3torchconnector, in a shuffled shard order."""

    def __init__(self, urls: list[str], endpoint: str, seed: int) -> None:
        super().__init__()
        self.urls, self.endpoint, self.seed = urls, endpoint, seed
        # Shared with persistent DataLoader workers (forked), as CachedDataset does.
        self.epoch = multiprocessing.RawValue(ctypes.c_int64, 0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch.value = epoch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        s3tc: Any = importlib.import_module("s3torchconnector")
        from webdataset import filters, tariterators

        order = list(self.urls)
        random.Random(self.seed * 1_000_003 + int(self.epoch.value)).shuffle(order)
        objects = s3tc.S3IterableDataset.from_objects(
            order,
            region=base.REGION,
            endpoint=self.endpoint,
            transform=shard_to_dict,
            s3client_config=s3tc.S3ClientConfig(force_path_style=True),
            enable_sharding=True,
        )
        samples = tariterators.group_by_keys(tariterators.tar_file_expander(iter(objects)))
        yield from filters._shuffle(samples, 1000, 100)


@dataclass
class S3TorchPeer(base.Peer):
    loader: Any = None
    ds: S3TarSamples | None = None

    def open(self) -> None:

        importlib.import_module("s3torchconnector")  # fails here, not in a worker
        self.ds = S3TarSamples(self.spec.tar_urls, self.spec.endpoint, self.spec.seed)
        self.loader = base.data_loader(self.ds, self.spec)

    def batches(self, epoch: int) -> Iterable[Any]:
        assert self.ds is not None
        self.ds.set_epoch(epoch)
        return self.loader  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.loader is not None:
            base.shutdown_workers(self.loader)
