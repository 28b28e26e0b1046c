"""Mosaic Streaming (mosaicml-streaming): the shards converted once to MDS with its
``MDSWriter`` (written to the store, shards of about the WebDataset shards' size), then
``StreamingDataset(remote=s3://..., local=<cache dir>, cache_limit=<the cache limit>,
shuffle=True, shuffle_block_size=<a quarter of the cache limit's samples>)`` in the same
DataLoader loop. It reads S3 with boto3; the endpoint comes from
``S3_ENDPOINT_URL``.

Two rows: ``Mosaic Streaming`` passes the cache limit (the hot tier's size) as
``cache_limit``; ``Mosaic Streaming (default cache)`` (``spec.cache_limit`` False) passes
none, Mosaic's default (None: it keeps every shard it downloads), as its users run it. Both
keep ``shuffle_block_size`` computed from the cache limit (:func:`shuffle_block_size`), so
the two rows differ in the cache limit alone; Mosaic's default block (the whole dataset
here) would change the shuffle as well. ``local`` is the run's directory in both rows, so
its disk use is measured and the next run starts empty. Both rows read the same conversion.

torchvision: ``import streaming`` imports ``streaming.vision``, which needs two torchvision
names at import (``datasets.VisionDataset``, ``transforms.functional.to_tensor``). The only
torchvision wheel for torch 2.13.0 on the package registry is a CUDA build whose extension
fails to load on the CPU torch (``RuntimeError: operator torchvision::nms does not
exist``), so ``.venv-peers`` has none: when ``import torchvision`` fails, this module puts a
stand-in for those two names into ``sys.modules`` before importing ``streaming``. Only
Mosaic's vision datasets (CIFAR-10, ADE20K, ...) would use them; ``StreamingDataset``, MDS
and the download path do not.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import time
import types
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from bench.peers_systems import base

PREFIX = "mds"


def import_streaming() -> Any:
    """``import streaming``, with the torchvision stand-in when there is no working one."""
    try:
        importlib.import_module("torchvision")
    except Exception:  # ImportError, or the CUDA build's RuntimeError on CPU torch
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        # transformers (which streaming imports) notes at import whether torchvision is
        # there: let it see that it is not, before the stand-in exists.
        importlib.import_module("transformers.feature_extraction_utils")
        importlib.import_module("transformers.tokenization_utils_base")
        _torchvision_stand_in()
    return importlib.import_module("streaming")


def _module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return module


def _torchvision_stand_in() -> None:
    def unavailable(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("torchvision is not installed here (a stand-in for Mosaic's import)")

    class VisionDataset:
        def __init__(self, *_args: Any, **_kwargs: Any) -> None:
            unavailable()

    modules = {
        name: _module(name)
        for name in (
            "torchvision",
            "torchvision.datasets",
            "torchvision.transforms",
            "torchvision.transforms.functional",
        )
    }
    modules["torchvision.datasets"].VisionDataset = VisionDataset  # type: ignore[attr-defined]
    modules["torchvision.transforms.functional"].to_tensor = unavailable  # type: ignore[attr-defined]
    modules["torchvision"].__version__ = "0.0+stand-in"  # type: ignore[attr-defined]
    sys.modules.update(modules)


def local_samples(spec: base.Spec) -> Iterable[dict[str, Any]]:
    """The dataset's samples from the local copies of the shards, in order."""
    import webdataset as wds

    paths = [f"{spec.tar_dir}/{key.rsplit('/', 1)[-1]}" for key in spec.tar_keys]
    return wds.WebDataset(paths, shardshuffle=False, empty_check=False)  # type: ignore[no-any-return]


def shuffle_block_size(spec: base.Spec) -> int:
    """The samples in a quarter of the cache limit. Mosaic shuffles samples within blocks of
    this many; its default (262,144 samples: this whole dataset in one block) draws every
    sample from anywhere in the dataset, which a cache smaller than the dataset cannot
    follow: in the 2x scenario at 40 MB/s it kept the link full for the 10 minutes of a run
    without finishing 3 epochs. A quarter of the cache lets a block's shards stay while the
    two workers read them."""
    sample_bytes = max(1, spec.payload_bytes // max(1, spec.samples))
    return max(spec.batch_size, spec.capacity // 4 // sample_bytes)


@dataclass
class MosaicPeer(base.Peer):
    loader: Any = None

    @property
    def remote(self) -> str:
        return f"s3://{self.spec.bucket}/{PREFIX}"

    def prepare(self) -> float:
        streaming = import_streaming()
        started = time.perf_counter()
        columns = {"key": "str", "bin": "bytes", "cls": "bytes"}
        with streaming.MDSWriter(
            out=self.remote, columns=columns, size_limit=self.spec.shard_bytes
        ) as out:
            for sample in local_samples(self.spec):
                out.write({"key": sample["__key__"], "bin": sample["bin"], "cls": sample["cls"]})
        return time.perf_counter() - started

    def open(self) -> None:
        streaming = import_streaming()
        # No cache_limit at all in the default-cache row: Mosaic's default (None).
        limit = {"cache_limit": self.spec.capacity} if self.spec.cache_limit else {}
        ds = streaming.StreamingDataset(
            remote=self.remote,
            local=str(self.workdir / "mosaic-cache"),
            shuffle=True,
            shuffle_seed=self.spec.seed,
            # From the cache limit in both rows: they differ in the limit alone (above).
            shuffle_block_size=shuffle_block_size(self.spec),
            batch_size=self.spec.batch_size,
            **limit,
        )
        self.loader = base.data_loader(ds, self.spec)

    def batches(self, epoch: int) -> Iterable[Any]:
        return self.loader  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.loader is not None:
            base.shutdown_workers(self.loader)
