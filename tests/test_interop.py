"""Interop: shards written by webdataset's TarWriter and uploaded with the minio client
yield exactly the samples (keys and bytes) that webdataset.WebDataset reads from them."""

from __future__ import annotations

import gc
import warnings
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import webdataset as wds
from cached_client import CachedDataset
from minio import Minio

from tests.daemon import daemon_config, thread_daemon
from tests.s3server import S3Server


def write_shards(directory: Path, n_shards: int) -> list[Path]:
    rng = np.random.default_rng(7)
    paths = []
    for s in range(n_shards):
        path = directory / f"wds-{s:03d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for i in range(int(rng.integers(3, 30))):
                sample = {
                    "__key__": f"dir{s}/sample.{i:04d}"[:-5] + f"{i:04d}",
                    "jpg": rng.bytes(int(rng.integers(0, 5000))),
                    "cls": str(i % 7).encode(),
                    "seg.png": rng.bytes(100),
                    "JSON": b'{"a": 1}',
                }
                if i % 3 == 0:
                    sample["extra.txt"] = b"only sometimes"
                sink.write(sample)
        paths.append(path)
    return paths


def test_webdataset_shards_uploaded_with_minio_read_identically(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    paths = write_shards(tmp_path, 4)
    endpoint = urlsplit(s3_server.endpoint_url)
    mc = Minio(
        endpoint.netloc,
        access_key="testing",
        secret_key="testing",
        secure=False,
        region="us-east-1",
    )
    for path in paths:
        mc.fput_object(bucket, path.name, str(path))

    def as_tuples(samples: object) -> list[tuple[str, dict[str, bytes]]]:
        return [
            (s["__key__"], {k: bytes(v) for k, v in s.items() if not k.startswith("__")})
            for s in samples  # type: ignore[attr-defined]
        ]

    with warnings.catch_warnings():
        # webdataset leaves its shard files for the garbage collector to close.
        warnings.simplefilter("ignore", ResourceWarning)
        reference = as_tuples(wds.WebDataset([str(p) for p in paths], shardshuffle=False))
        gc.collect()
    assert len(reference) > 20
    with thread_daemon(daemon_config(tmp_path / "d", s3_server.endpoint_url)) as d:
        ours = CachedDataset([f"s3://{bucket}/{p.name}" for p in paths], socket=d.socket)
        got = list(ours)
    assert as_tuples(got) == reference
    assert {s["__url__"] for s in got} == {f"s3://{bucket}/{p.name}" for p in paths}
