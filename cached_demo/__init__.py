"""``cached demo``: the whole stack on one machine with embedded defaults.

Starts an S3-compatible endpoint on loopback (moto's server), writes a synthetic image
dataset into it as WebDataset tar shards, starts ``cached serve`` as a real subprocess,
and trains a small CNN for a few epochs through ``CachedDataset`` and a multi-worker
DataLoader, printing per epoch: time, samples/s, hot-tier hits, the misses a reader
waited for, bytes fetched from S3, and the share of time the loop waited for data.

With ``$CACHED_DEMO_SCREENSHOT`` set to a path (or ``screenshot=``), a headless Chromium
saves a PNG of the daemon's dashboard there while the last epoch trains
(docs/dashboard.png is one).

The package's other rooms serve the tests and the benchmarks as well: :mod:`.stack` (the
local stack: moto's S3 server, TOML configs, ``cached serve`` as a subprocess or a daemon in
a thread) and :mod:`.tars` (WebDataset tars written in memory).
"""

from __future__ import annotations

import asyncio
import importlib
import io
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from cached.errors import CachedError

from .tars import make_tar

IMAGE_SHAPE = (3, 32, 32)
CLASSES = 10


def make_shard(index: int, samples: int, seed: int = 0) -> bytes:
    """A WebDataset tar of synthetic images: ``<key>.npy`` (uint8 CHW) and ``<key>.cls``.

    Each class has its own mean pattern plus noise, so a small model can learn it."""
    rng = np.random.default_rng(seed * 100_003 + index)
    patterns = np.random.default_rng(seed).integers(0, 256, (CLASSES, *IMAGE_SHAPE))

    def samples_of_shard() -> Iterator[tuple[str, dict[str, bytes]]]:
        for i in range(samples):
            label = int(rng.integers(CLASSES))
            noise = rng.normal(0, 40, IMAGE_SHAPE)
            image = np.clip(patterns[label] + noise, 0, 255).astype(np.uint8)
            npy = io.BytesIO()
            np.save(npy, image)
            yield f"s{index:06d}-{i:06d}", {"npy": npy.getvalue(), "cls": str(label).encode()}

    return make_tar(samples_of_shard())


def decode_sample(sample: dict[str, Any]) -> tuple[Any, int]:
    """CPU decoding in the DataLoader worker: ``.npy`` bytes -> float tensor, label."""
    import torch

    image = np.load(io.BytesIO(sample["npy"]))
    return torch.from_numpy(image).float().div_(255.0), int(sample["cls"])


def _counters(socket: str) -> dict[str, float]:
    from cached_client.transport import Connection

    header, _ = Connection(socket).request({"op": "status"})
    counters: dict[str, float] = header["status"]["counters"]
    return counters


def _http_url(socket: str) -> str:
    from cached_client.transport import Connection

    header, _ = Connection(socket).request({"op": "status"})
    url: str = header["status"]["http"]
    return url


SCREENSHOT_ENV = "CACHED_DEMO_SCREENSHOT"


def _start_screenshot(http: str, path: Path) -> Callable[[], str]:
    """Save a PNG of the dashboard at ``http`` to ``path``, in a thread: the browser takes a
    second or two to start, and the training goes on meanwhile. Returns a function that
    waits for it and says how it went (printed after the epochs' table, not inside it)."""
    from .browser import capture

    # Rendered, with at least two history samples (so the charts have a line).
    ready = (
        "window.cachedDashboard && cachedDashboard.renders > 0 && "
        "cachedDashboard.history.samples.length >= 2"
    )
    said: list[str] = []

    def shoot() -> None:
        try:
            errors = asyncio.run(capture(f"{http}/", ready, path))
        except Exception as exc:  # a demo without its picture is still a demo
            said.append(f"dashboard screenshot failed: {exc}")
            return
        problems = f"; page errors: {errors}" if errors else ""
        said.append(f"dashboard screenshot: {path}{problems}")

    thread = threading.Thread(target=shoot, name="dashboard screenshot")
    thread.start()

    def finish() -> str:
        thread.join()
        return "".join(said)

    return finish


def require_demo_extras() -> None:
    """Fail with what to install when a package the demo needs is missing: moto and boto3
    (the ``demo`` extra: the S3 stand-in) and torch (the training side)."""
    missing = []
    for module, package in (
        ("moto.server", "cached-daemon[demo]"),
        ("boto3", "cached-daemon[demo]"),
        ("torch", "torch"),
    ):
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append((module.split(".")[0], package))
    if missing:
        names = ", ".join(module for module, _ in missing)
        packages = " ".join(sorted({f"'{package}'" for _, package in missing}))
        raise CachedError(
            f"`cached demo` needs {names}, which is not installed; "
            f"install it with: pip install {packages}"
        )


def main(
    epochs: int = 3,
    shards: int = 16,
    samples_per_shard: int = 256,
    workers: int = 2,
    workdir: str | None = None,
    *,
    screenshot: str | None = None,
    keep: bool = False,
) -> int:
    """Run the demo; returns the process exit code. ``screenshot`` (default:
    ``$CACHED_DEMO_SCREENSHOT``): where to save a PNG of the dashboard, taken while the last
    epoch trains. ``keep``: after the epochs, leave the S3 server and the daemon running and
    print how to use them, until Ctrl-C."""
    require_demo_extras()
    screenshot = screenshot or os.environ.get(SCREENSHOT_ENV) or None
    shot = Path(screenshot).resolve() if screenshot else None
    from cached.config import format_size

    from .stack import DaemonProcess, s3_endpoint

    tmp = tempfile.TemporaryDirectory(prefix="cached-demo-") if workdir is None else None
    root = Path(tmp.name if tmp else workdir or ".")
    root.mkdir(parents=True, exist_ok=True)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's per-request lines
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "demo")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "demo")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    socket = f"ipc://{root}/cached.sock"
    try:
        with s3_endpoint() as endpoint:
            import boto3

            s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
            s3.create_bucket(Bucket="demo")
            total = 0
            print(
                f"writing {shards} shards x {samples_per_shard} samples to s3://demo at {endpoint}"
            )
            for i in range(shards):
                body = make_shard(i, samples_per_shard)
                total += len(body)
                s3.put_object(Bucket="demo", Key=f"train-{i:06d}.tar", Body=body)
            config = root / "config.toml"
            config.write_text(
                f'[server]\nsocket = "{socket}"\nhttp = "127.0.0.1:0"\n'
                f'[cache]\ndir = "{root / "hot"}"\ncapacity = "{total * 2}"\nmin_free = "0"\n'
                f'[s3]\nendpoint_url = "{endpoint}"\n'
            )
            urls = f"s3://demo/train-{{000000..{shards - 1:06d}}}.tar"
            with DaemonProcess(config, socket, log=root / "daemon.log"):
                print(
                    f"daemon up on {socket}; dataset {format_size(total)}; training on CPU "
                    f"with {workers} DataLoader workers\n"
                )
                if epochs > 0:
                    _train(socket, urls, epochs, workers, shot)
                if keep:
                    _keep(socket, endpoint, urls, config, root)
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


def _train(socket: str, urls: str, epochs: int, workers: int, shot: Path | None) -> None:
    """Train the small CNN for ``epochs`` through the daemon at ``socket``, a table row an
    epoch."""
    import torch
    from cached_client import CachedDataset
    from cached_client.device import DeviceLoader, StallMeter, pinned_memory_available
    from torch import nn
    from torch.utils.data import DataLoader

    from cached.config import format_size

    dataset = CachedDataset(
        urls, socket=socket, shuffle=True, seed=0, decode=decode_sample, job="demo"
    )
    loader = DataLoader(
        dataset,
        batch_size=64,
        num_workers=workers,
        persistent_workers=workers > 0,
        pin_memory=pinned_memory_available(),
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(4),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 64),
        nn.ReLU(),
        nn.Linear(64, CLASSES),
    ).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    head = (
        f"{'epoch':>5} {'time s':>7} {'samples/s':>10} {'loss':>7} {'acc':>6} "
        f"{'hits':>5} {'misses':>6} {'fetched':>10} {'waited':>7}"
    )
    print(head)
    print("-" * len(head))
    shooter = None
    for epoch in range(epochs):
        dataset.set_epoch(epoch)
        if shot is not None and epoch == epochs - 1:
            shooter = _start_screenshot(_http_url(socket), shot)
        before = _counters(socket)
        meter = StallMeter()
        seen = correct = 0
        loss_sum = 0.0
        for images, labels in meter.wrap(DeviceLoader(loader, device)):
            logits = model(images)
            loss = nn.functional.cross_entropy(logits, labels)
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            seen += len(labels)
            loss_sum += float(loss.detach()) * len(labels)
            correct += int((logits.argmax(1) == labels).sum())
        after = _counters(socket)
        print(
            f"{epoch:>5} {meter.total_s:>7.2f} {seen / meter.total_s:>10.0f} "
            f"{loss_sum / seen:>7.3f} {correct / seen:>6.1%} "
            f"{after['hits'] - before['hits']:>5.0f} "
            f"{after['demand_misses'] - before['demand_misses']:>6.0f} "
            f"{format_size(after['fetched_bytes'] - before['fetched_bytes']):>10} "
            f"{meter.fraction:>7.1%}"
        )
    if shooter is not None:
        print(shooter())  # the daemon serves the page until it is taken
    print(
        "\nepoch 0 fetched every shard from S3, ahead of the readers where it could;"
        " later epochs were served from the hot tier.\n'misses' counts the shards a"
        " reader had to wait for; 'waited' is the share of loop time blocked on the"
        " next batch."
    )


def _keep(socket: str, endpoint: str, urls: str, config: Path, root: Path) -> None:
    """Print how to use the running stack from another shell, then wait for Ctrl-C."""
    http = _http_url(socket)
    print(
        "\nThe stack stays up until Ctrl-C. In another shell:\n\n"
        f"  export CACHED_SOCKET={socket}\n"
        f"  export AWS_ENDPOINT_URL={endpoint} AWS_ACCESS_KEY_ID=demo "
        "AWS_SECRET_ACCESS_KEY=demo AWS_DEFAULT_REGION=us-east-1\n"
        "  cached status\n"
        f"  cached prefetch '{urls}'\n\n"
        f"shards     {urls} (bucket demo at {endpoint})\n"
        f"dashboard  {http}/\n"
        f"config     {config} (daemon log {root / 'daemon.log'})",
        flush=True,
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("\nstopping the daemon and the S3 server", flush=True)
