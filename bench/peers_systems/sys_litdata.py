"""litdata (Lightning): the shards converted once with ``litdata.optimize`` (chunks of
about the WebDataset shards' size, written to the store), then ``StreamingDataset(s3://...,
cache_dir=<cache dir>, max_cache_size=<the cache limit>, shuffle=True)`` in its
``StreamingDataLoader`` with the same loop. The endpoint and credentials go in
``storage_options`` (boto3).

Two rows: ``litdata`` passes the cache limit (the hot tier's size) as ``max_cache_size``;
``litdata (default cache)`` (``spec.cache_limit`` False) passes none, as litdata's users
run it. Its default (0.2.76) is 75% of the cache directory's free disk, leaving 50 GB free
where the disk has more than that: far more than this dataset unless the disk has barely
over 50 GB free. (``MAX_CACHE_SIZE`` in the environment would win over both; the driver
removes it.) The cache directory is the run's in both rows, so its disk use is measured and
the next run starts empty. Both rows read the same conversion.

obstore: litdata moves chunks with obstore where it is installed (downloads in the workers,
and the conversion's uploads), and obstore refuses an ``http://`` endpoint ("HTTP error:
builder error") unless told ``allow_http``. litdata has no option for it, and the
environment's ``AWS_ALLOW_HTTP=true`` does not reach it either: litdata builds its
``S3Store`` with client options of its own (timeouts, a connection pool), which replace the
client options obstore read from the environment. So this module adds ``allow_http`` to
litdata's client options (``litdata.streaming.downloader._OBSTORE_CLIENT_OPTIONS``) when it
is imported: in the runner, and in the processes litdata's conversion spawns, which import
this module for ``shard_samples``. (A real S3 endpoint is https and needs none of this.)
litdata's own warning that a ``max_cache_size`` under 25 GB may thrash is expected here (in
the limited row).
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from bench.peers_systems import base

PREFIX = "litdata"

os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")  # no look-up of newer versions


def allow_http() -> None:
    """Let litdata's obstore client talk to an ``http://`` endpoint (see above)."""
    try:
        downloader: Any = importlib.import_module("litdata.streaming.downloader")
    except ImportError:
        return
    options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
    if isinstance(options, dict):
        options["allow_http"] = "true"


allow_http()


def storage_options(endpoint: str) -> dict[str, Any]:
    return {
        "endpoint_url": endpoint,
        "aws_access_key_id": "bench",
        "aws_secret_access_key": "bench",
        "region_name": base.REGION,
    }


def shard_samples(path: str) -> Iterator[dict[str, Any]]:
    """litdata's ``fn``: the samples of one local shard (a generator: many per input)."""
    import webdataset as wds

    for sample in wds.WebDataset(path, shardshuffle=False, empty_check=False):
        yield {"key": sample["__key__"], "bin": sample["bin"], "cls": sample["cls"]}


def check_uploaded(spec: base.Spec, remote: str) -> None:
    """Every chunk the index names is in the store (litdata logs a failed upload and goes on,
    leaving an index that names missing chunks)."""
    import json

    client = base.s3_client(spec.endpoint)
    prefix = remote.removeprefix(f"s3://{spec.bucket}/") + "/"
    index = json.loads(
        client.get_object(Bucket=spec.bucket, Key=prefix + "index.json")["Body"].read()
    )
    listed = client.list_objects_v2(Bucket=spec.bucket, Prefix=prefix).get("Contents", [])
    stored = {o["Key"].removeprefix(prefix) for o in listed}
    missing = [c["filename"] for c in index["chunks"] if c["filename"] not in stored]
    if missing or not index["chunks"]:
        raise RuntimeError(
            f"litdata.optimize left {len(missing)} of {len(index['chunks'])} chunks out of "
            f"the store: {', '.join(missing[:4])}"
        )


def to_bytes(sample: dict[str, Any]) -> dict[str, Any]:
    """litdata hands out ``bytes`` members as memoryviews of its chunk files, which cannot
    cross from a DataLoader worker (pickle refuses them, and the worker's queue drops the
    batch without an error: an epoch of 0 samples); a copy to ``bytes``, as every other
    system delivers them."""
    return {k: bytes(v) if isinstance(v, memoryview) else v for k, v in sample.items()}


@dataclass
class LitdataPeer(base.Peer):
    loader: Any = None

    @property
    def remote(self) -> str:
        return f"s3://{self.spec.bucket}/{PREFIX}"

    def prepare(self) -> float:
        litdata: Any = importlib.import_module("litdata")
        paths = [f"{self.spec.tar_dir}/{key.rsplit('/', 1)[-1]}" for key in self.spec.tar_keys]
        # litdata's scratch directories (default /tmp/chunks and /tmp/data, shared).
        os.environ["DATA_OPTIMIZER_CACHE_FOLDER"] = str(self.workdir / "optimize-chunks")
        os.environ["DATA_OPTIMIZER_DATA_CACHE_FOLDER"] = str(self.workdir / "optimize-data")
        started = time.perf_counter()
        litdata.optimize(
            fn=shard_samples,
            inputs=paths,
            output_dir=self.remote,
            chunk_bytes=self.spec.shard_bytes,
            num_workers=self.spec.workers,
            storage_options=storage_options(self.spec.endpoint),
            keep_data_ordered=True,
            # Forked, the workers and uploaders inherit allow_http (spawned ones would not).
            start_method="fork",
            verbose=False,
        )
        secs = time.perf_counter() - started
        check_uploaded(self.spec, self.remote)
        return secs

    def open(self) -> None:
        litdata: Any = importlib.import_module("litdata")
        # No max_cache_size at all in the default-cache row: litdata's default, not a guess.
        limit = {"max_cache_size": self.spec.capacity} if self.spec.cache_limit else {}
        ds = litdata.StreamingDataset(
            self.remote,
            cache_dir=str(self.workdir / "litdata-cache"),
            shuffle=True,
            seed=self.spec.seed,
            storage_options=storage_options(self.spec.endpoint),
            transform=to_bytes,
            **limit,
        )
        self.loader = litdata.StreamingDataLoader(
            ds,
            batch_size=self.spec.batch_size,
            num_workers=self.spec.workers,
            persistent_workers=self.spec.workers > 0,
            collate_fn=list,
        )

    def batches(self, epoch: int) -> Iterable[Any]:
        return self.loader  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.loader is not None:
            base.shutdown_workers(self.loader)
