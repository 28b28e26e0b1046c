"""The example training job of docker-compose.yml: reads the example dataset through the
cached daemon with ``cached_client.CachedDataset`` and a torch DataLoader with worker
processes, trains a small linear classifier on CPU, and prints one line per epoch.

It reaches the daemon over the ipc socket in the volume that both containers mount at
/run/cached ($CACHED_SOCKET, default ipc:///run/cached/cached.sock). Settings (see
docker-compose.yml): DATASET_BUCKET, DATASET_PREFIX, DATASET_SHARDS (as
deploy/compose/make-dataset.py wrote them), TRAIN_EPOCHS, TRAIN_WORKERS, TRAIN_BATCH.
"""

from __future__ import annotations

import io
import os
import sys
import time
from typing import Any

import numpy as np
import torch
from cached_client import CachedDataset
from cached_client.transport import Connection, resolve_endpoint
from cached_wire.protocol import Op
from torch import nn
from torch.utils.data import DataLoader


def decode(sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """In the DataLoader worker: ``.npy`` bytes -> float image, ``.cls`` -> label."""
    image = np.load(io.BytesIO(sample["npy"]))
    return torch.from_numpy(image).float().div_(255.0), int(sample["cls"])


def counters(socket: str) -> dict[str, float]:
    """The daemon's counters (hot-tier hits, shards fetched from S3, ...)."""
    conn = Connection(socket)
    try:
        header, _ = conn.request({"op": Op.STATUS})
    finally:
        conn.close()
    result: dict[str, float] = header["status"]["counters"]
    return result


def main() -> int:
    bucket = os.environ.get("DATASET_BUCKET", "train")
    prefix = os.environ.get("DATASET_PREFIX", "example/")
    shards = int(os.environ.get("DATASET_SHARDS", "8"))
    epochs = int(os.environ.get("TRAIN_EPOCHS", "3"))
    workers = int(os.environ.get("TRAIN_WORKERS", "2"))
    batch = int(os.environ.get("TRAIN_BATCH", "32"))
    urls = f"s3://{bucket}/{prefix}shard-{{000000..{shards - 1:06d}}}.tar"
    socket = resolve_endpoint(None)

    torch.manual_seed(0)
    dataset = CachedDataset(urls, shuffle=True, seed=0, decode=decode, connect_timeout_s=30.0)
    loader = DataLoader(dataset, batch_size=batch, num_workers=workers, persistent_workers=True)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    print(
        f"trainer: torch {torch.__version__}, {urls} via {socket}, "
        f"{workers} DataLoader workers, batch {batch}"
    )
    for epoch in range(epochs):
        dataset.set_epoch(epoch)
        before = counters(socket)
        start = time.monotonic()
        seen = correct = 0
        for images, labels in loader:
            logits = model(images)
            loss = nn.functional.cross_entropy(logits, labels)
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            seen += len(labels)
            correct += int((logits.argmax(1) == labels).sum())
        seconds = time.monotonic() - start
        after = counters(socket)
        hits = after.get("hits", 0) - before.get("hits", 0)
        fetched = after.get("fetched_bytes", 0) - before.get("fetched_bytes", 0)
        print(
            f"trainer: epoch {epoch}: {seen} samples in {seconds:.2f} s "
            f"({seen / seconds:.0f} samples/s), accuracy {correct / max(seen, 1):.1%}; "
            f"daemon: {hits:.0f} hot-tier hits, "
            f"{fetched / 2**20:.1f} MiB fetched from S3"
        )
    print("trainer: done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
