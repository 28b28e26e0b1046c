"""The example dataset of docker-compose.yml: creates the bucket and writes WebDataset tar
shards of small synthetic images into it, then exits.

Runs in the daemon's image (cached:0.1.0), which has everything it needs: botocore (a
dependency of aiobotocore), numpy, and ``cached_demo.make_shard``. It speaks the plain S3
API, so it works against any S3-compatible server, not MinIO alone.

Idempotent: the shards are deterministic (fixed seeds) and a shard that is already there
with the expected size is left alone, so a re-run (``docker compose up`` again) writes
nothing. The settings come from the environment (see docker-compose.yml):
  AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY   the S3 endpoint
  DATASET_BUCKET, DATASET_PREFIX                               where the shards go
  DATASET_SHARDS, DATASET_SAMPLES_PER_SHARD                    how many
Each sample is ``<key>.npy`` (a uint8 3x32x32 image, numpy's format) and ``<key>.cls``
(its label, 0-9, as text).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import botocore.session
from botocore.config import Config
from botocore.exceptions import ClientError

# The demo's synthetic images: a fixed pattern per class plus noise (learnable, deterministic).
from cached_demo import make_shard


def s3_client(endpoint: str) -> Any:
    # Path-style addressing: what MinIO (and most S3-compatible servers) want.
    return botocore.session.get_session().create_client(
        "s3",
        endpoint_url=endpoint,
        region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 10}),
    )


def main() -> int:
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    bucket = os.environ.get("DATASET_BUCKET", "train")
    prefix = os.environ.get("DATASET_PREFIX", "example/")
    shards = int(os.environ.get("DATASET_SHARDS", "8"))
    per_shard = int(os.environ.get("DATASET_SAMPLES_PER_SHARD", "64"))
    s3 = s3_client(endpoint)

    try:
        s3.head_bucket(Bucket=bucket)
        print(f"make-dataset: bucket {bucket} exists at {endpoint}")
    except ClientError as exc:
        if exc.response["Error"]["Code"] not in ("404", "NoSuchBucket", "NotFound"):
            raise
        s3.create_bucket(Bucket=bucket)
        print(f"make-dataset: created bucket {bucket} at {endpoint}")

    start = time.monotonic()
    written = kept = total = 0
    for i in range(shards):
        key = f"{prefix}shard-{i:06d}.tar"
        body = make_shard(i, per_shard)
        total += len(body)
        try:
            head = s3.head_object(Bucket=bucket, Key=key)
            if head["ContentLength"] == len(body):
                kept += 1
                continue
        except ClientError as exc:
            if exc.response["Error"]["Code"] not in ("404", "NoSuchKey", "NotFound"):
                raise
        s3.put_object(Bucket=bucket, Key=key, Body=body)
        written += 1

    last = f"{shards - 1:06d}"
    print(
        f"make-dataset: s3://{bucket}/{prefix}shard-{{000000..{last}}}.tar: {shards} shards x "
        f"{per_shard} samples ({shards * per_shard} samples, {total / 2**20:.1f} MiB); "
        f"{written} written, {kept} already there; {time.monotonic() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
