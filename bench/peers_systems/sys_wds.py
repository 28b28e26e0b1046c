"""webdataset reading the shards from S3 the way its documentation says: a ``pipe:`` URL
whose command writes the shard to stdout, here curl on a presigned URL (no AWS CLI needed,
and curl is what most images have). Without a cache every epoch reads every shard from the
store again; the second row gives WebDataset its own file cache (``cache_dir``, LRU-trimmed
to ``cache_size`` = the cache limit; webdataset trims at most every 30 s)."""

from __future__ import annotations

import os
import shlex
import shutil
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from bench.peers_systems import base

PRESIGN_S = 6 * 3600


def shard_name(spec: str) -> str:
    """The cache file name of a ``pipe:curl ... '<presigned URL>'`` spec: the shard's name
    (the default would quote the whole command line)."""
    for word in shlex.split(spec.removeprefix("pipe:")):
        if word.startswith(("http://", "https://")):
            return os.path.basename(urllib.parse.urlsplit(word).path)
    return spec.replace("/", "_")[-128:]


@dataclass
class WdsCurlPeer(base.Peer):
    loader: Any = None
    cache: bool = False

    def open(self) -> None:
        import webdataset as wds

        if shutil.which("curl") is None:
            raise RuntimeError("no curl command on this machine")
        client = base.s3_client(self.spec.endpoint)
        urls = [
            "pipe:curl -s -f -L "
            + shlex.quote(
                client.generate_presigned_url(
                    "get_object",
                    Params={"Bucket": self.spec.bucket, "Key": key},
                    ExpiresIn=PRESIGN_S,
                )
            )
            for key in self.spec.tar_keys
        ]
        kwargs: dict[str, Any] = {}
        if self.cache:
            cache_dir = self.workdir / "wds-cache"
            cache_dir.mkdir(parents=True, exist_ok=True)
            kwargs = {
                "cache_dir": str(cache_dir),
                "cache_size": self.spec.capacity,
                "url_to_name": shard_name,
            }
        ds = wds.WebDataset(
            urls,
            shardshuffle=len(urls),  # a full shuffle of the shard order ...
            detshuffle=True,  # ... different in every epoch, the same for the same seed
            seed=self.spec.seed,
            empty_check=False,
            **kwargs,
        ).shuffle(1000)  # webdataset's sample buffer: 1000, yielding after 100 (its default)
        self.loader = base.data_loader(ds, self.spec)

    def batches(self, epoch: int) -> Iterable[Any]:
        return self.loader  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.loader is not None:
            base.shutdown_workers(self.loader)


@dataclass
class WdsCachePeer(WdsCurlPeer):
    cache: bool = True
