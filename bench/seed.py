"""The seed experiment, reproduced: a small MNIST model's training time, loader by loader.

The published experiment trained a 784-128-64-10 feed-forward network (Linear 784->128,
ReLU, Linear 128->64, ReLU, Linear 64->10) on MNIST, batch 64, 5 epochs, Adam (lr 1e-3),
cross-entropy, and timed the 5 epochs: 22.67 s with ``num_workers=0``, 9.14 s with 8
workers and 9.00 s with ``pin_memory=True`` and non-blocking copies (22.67 / 9.00 = 2.52x).

This runs the same loop on this machine's device ("cuda" if torch has it, else "cpu") over
MNIST-shaped *synthetic* data: ``--samples`` 28x28 uint8 grey images made deterministically
with numpy (a blocky pattern per class, shifted by up to 3 pixels, plus Gaussian noise), as
WebDataset tar shards (``<key>.bin``: the 784 raw pixel bytes, ``<key>.cls``: the label in
ASCII), in a bucket of moto's S3 server (its own process, on loopback). Five
configurations and a reference, each with a freshly seeded model:

  baseline     webdataset (``pipe:curl`` on presigned URLs) in a DataLoader, num_workers=0
  workers      the same, ``--workers`` persistent workers (the seed used 8)
  pinned       the same, ``pin_memory=True`` and ``.to(device, non_blocking=True)``; with
               CPU torch there is no pinned memory: the row says so and runs without it
  cached       ``cached_client.CachedDataset`` in the same DataLoader (``--workers``
               workers, pinned where available, non-blocking copies), served by a real
               ``cached serve`` with an empty hot tier reading the same bucket
  fast         ``cached_client.FastLoader`` (batch 64, host batches, pinned where
               available) from another fresh daemon, no DataLoader
  memory       a reference, not in the seed: the same samples decoded once (untimed) into
               tensors in memory, batches cut from a per-epoch permutation: the loop's
               compute with no loading at all

Every sample is decoded the same way: pixels ``uint8 -> float32 / 255`` (784 values) and
the label ``int(ascii)``; the DataLoader configurations decode per sample in the loader
(workers), FastLoader applies the same two steps to the batch it received. Per
configuration: the 5 epochs' time, epoch 1 (the cold hot tier for the two cached ones;
worker start-up for the others) and the mean of the later epochs, samples/s, the training
accuracy of the last epoch, the share of loop time spent waiting for data, and
baseline time / its time (the seed's "2.52x" is baseline / pinned). A configuration that
cannot run prints a row saying why. ``--repeats N`` runs the list N times round-robin and
the tables show medians. The result document goes to ``bench/out/seed-<timestamp>.json``
and is printed at the end.

The training process uses torch's default number of intra-op threads unless
``--torch-threads`` says otherwise; on a 2-core machine this choice moves the loop's
compute time by several times (docs/seed-experiment.md).

    python bench/seed.py                    # 60,000 samples, 5 epochs (minutes)
    python bench/seed.py --small            # a smoke run for CI: every path, seconds
    python bench/seed.py --samples 20000 --epochs 3 --repeats 3 --torch-threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shlex
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from bench import common, shaping
from bench import epochs as bench_epochs
from bench.peers_systems import base
from cached_demo.tars import make_tar

BUCKET = "bench-seed"
PREFIX = "mnist"
SIDE = 28
PIXELS = SIDE * SIDE
CLASSES = 10
SHUFFLE_BUFFER = 1000  # samples: webdataset's .shuffle() and CachedDataset's, the same
PRESIGN_S = 6 * 3600
CONFIGS = ("baseline", "workers", "pinned", "cached", "fast", "memory")
LOADERS = {
    "baseline": "webdataset + DataLoader",
    "workers": "webdataset + DataLoader",
    "pinned": "webdataset + DataLoader",
    "cached": "CachedDataset + DataLoader",
    "fast": "FastLoader",
    "memory": "tensors in memory (reference)",
}
# The published figures (5 epochs, seconds) and what each configuration here stands for.
PUBLISHED_S = {"baseline": 22.67, "workers": 9.14, "pinned": 9.00}
PUBLISHED_SETUP = {
    "baseline": "num_workers=0",
    "workers": "num_workers=8",
    "pinned": "num_workers=8, pin_memory, non_blocking",
}
NO_PINNED = "pinned memory: not available (CPU torch)"

Pair = tuple[torch.Tensor, torch.Tensor]  # a batch: inputs [B, 784] float32, labels [B]
EpochSource = Callable[[int], Iterable[Pair]]  # epoch -> that epoch's batches (host)


# -- the data -----------------------------------------------------------------------------------


def synthetic_mnist(n: int, seed: int) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
    """``n`` MNIST-shaped samples: images ``[n, 28, 28]`` uint8 and labels ``[n]`` in 0-9.

    Deterministic for ``seed``. Each class has a blocky 7x7 pattern scaled to 28x28; a
    sample is its class's pattern shifted by up to 3 pixels each way, at a random contrast,
    plus Gaussian noise (sigma 60 grey levels), clipped to 0-255. Learnable, and easy: the
    model reaches about 96% training accuracy in its first epoch.
    """
    rng = np.random.default_rng(seed)
    templates = np.kron(rng.random((CLASSES, 7, 7)), np.ones((4, 4)))  # [10, 28, 28] in 0-1
    labels = rng.integers(0, CLASSES, n).astype(np.int64)
    images = np.empty((n, SIDE, SIDE), np.uint8)
    chunk = 10_000  # keeps the float temporaries small
    for at in range(0, n, chunk):
        lab = labels[at : at + chunk]
        m = len(lab)
        shifts = rng.integers(-3, 4, (m, 2))
        contrast = rng.uniform(120, 220, (m, 1, 1))
        pics = templates[lab] * contrast
        for dy in range(-3, 4):
            for dx in range(-3, 4):
                idx = np.flatnonzero((shifts[:, 0] == dy) & (shifts[:, 1] == dx))
                if len(idx):
                    pics[idx] = np.roll(pics[idx], (dy, dx), axis=(1, 2))
        pics += rng.normal(20, 60, pics.shape)
        images[at : at + m] = np.clip(pics, 0, 255).astype(np.uint8)
    return images, labels


@dataclass
class Dataset:
    """The shards in the bucket."""

    samples: int
    shards: int
    keys: list[str]
    tar_bytes: int
    make_s: float
    upload_s: float

    @property
    def urls(self) -> list[str]:
        """``s3://`` URLs of the shards (what ``cached`` reads)."""
        return [f"s3://{BUCKET}/{k}" for k in self.keys]


def upload_dataset(endpoint: str, samples: int, shards: int, seed: int) -> Dataset:
    """Make the samples, write them as ``shards`` WebDataset tars and put them into the
    bucket (``<key>.bin``: 784 raw pixel bytes; ``<key>.cls``: the label in ASCII)."""
    started = time.perf_counter()
    images, labels = synthetic_mnist(samples, seed)
    flat = images.reshape(samples, PIXELS)
    tars: list[bytes] = []
    done = 0
    for s in range(shards):
        n = samples // shards + (1 if s < samples % shards else 0)
        tars.append(
            make_tar(
                (f"s{s:06d}-{i:06d}", {"bin": flat[done + i].tobytes(), "cls": b"%d" % lab})
                for i, lab in enumerate(labels[done : done + n].tolist())
            )
        )
        done += n
    made = time.perf_counter()
    client = shaping.s3_client(endpoint)
    client.create_bucket(Bucket=BUCKET)
    keys = []
    for s, body in enumerate(tars):
        key = f"{PREFIX}/train-{s:06d}.tar"
        client.put_object(Bucket=BUCKET, Key=key, Body=body)
        keys.append(key)
    return Dataset(
        samples=samples,
        shards=shards,
        keys=keys,
        tar_bytes=sum(len(t) for t in tars),
        make_s=made - started,
        upload_s=time.perf_counter() - made,
    )


# -- the decode, the same everywhere ------------------------------------------------------------


def to_input(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 pixels (``[784]`` or ``[B, 784]``) -> float32 scaled to 0-1 (a new tensor)."""
    return pixels.to(torch.float32).div_(255.0)


def parse_label(raw: bytes) -> int:
    """A ``.cls`` member (ASCII digits) -> the label."""
    return int(raw)


def decode_sample(sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """A WebDataset sample dict -> (784 float32 inputs, label). Runs in the DataLoader's
    workers (or the main process without workers); module-level, so workers can pickle it."""
    pixels = torch.frombuffer(bytearray(sample["bin"]), dtype=torch.uint8)
    if pixels.numel() != PIXELS:
        raise ValueError(f"{sample.get('__key__')}: {pixels.numel()} pixel bytes, not {PIXELS}")
    return to_input(pixels), parse_label(sample["cls"])


def decode_batch(batch: Any) -> Pair:
    """A FastLoader batch (packed member bytes) -> the same inputs and labels as
    :func:`decode_sample` gives sample by sample, stacked."""
    x = to_input(batch.view("bin", torch.uint8, (PIXELS,)))
    offsets: list[int] = batch.offsets["cls"]
    raw = batch.data["cls"].cpu().numpy().tobytes()
    y = torch.tensor(
        [parse_label(raw[a:b]) for a, b in itertools.pairwise(offsets)],
        dtype=torch.int64,
    )
    return x, y


# -- the loop -----------------------------------------------------------------------------------


def make_model(seed: int) -> nn.Module:
    """The seed's network, with weights fixed by ``seed`` (the same start everywhere)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(PIXELS, 128),
        nn.ReLU(),
        nn.Linear(128, 64),
        nn.ReLU(),
        nn.Linear(64, CLASSES),
    )


@dataclass
class Epoch:
    """One epoch of one configuration."""

    epoch: int  # 1-based, as the tables say
    wall_s: float  # from asking for the first batch to the last step done
    wait_s: float  # of it, blocked waiting for the next batch
    samples: int
    loss: float  # mean training loss over the epoch
    accuracy: float  # training accuracy over the epoch (the model as it learns)
    cache: dict[str, int] = field(default_factory=dict)  # the daemon's counters' deltas


@dataclass
class Outcome:
    """One configuration: what ran, and its epochs or why it did not."""

    name: str
    loader: str
    workers: int
    pin_memory: bool
    non_blocking: bool
    note: str = ""
    skipped: str = ""  # why it cannot run here (a missing tool): not a failure
    error: str = ""  # why it failed
    epochs: list[Epoch] = field(default_factory=list)
    setup_s: float = 0.0  # before the timed epochs: daemon start-up (cached, fast)

    @property
    def ok(self) -> bool:
        return not self.error and not self.skipped and bool(self.epochs)

    @property
    def total_s(self) -> float:
        return sum(e.wall_s for e in self.epochs)

    @property
    def later_mean_s(self) -> float | None:
        later = [e.wall_s for e in self.epochs[1:]]
        return statistics.mean(later) if later else None

    @property
    def samples(self) -> int:
        """Samples over all epochs."""
        return sum(e.samples for e in self.epochs)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.total_s if self.total_s > 0 else 0.0

    @property
    def wait_share(self) -> float:
        return sum(e.wait_s for e in self.epochs) / self.total_s if self.total_s > 0 else 0.0

    def record(self) -> dict[str, Any]:
        """A JSON-able record of this run."""
        out = asdict(self)
        if self.ok:
            out.update(
                total_s=round(self.total_s, 3),
                epoch1_s=round(self.epochs[0].wall_s, 3),
                later_epochs_mean_s=None
                if self.later_mean_s is None
                else round(self.later_mean_s, 3),
                samples_per_s=round(self.samples_per_s, 1),
                final_accuracy=round(self.epochs[-1].accuracy, 4),
                wait_share=round(self.wait_share, 4),
            )
        return out


@dataclass
class Summary:
    """A configuration's runs (``--repeats``): medians of the runs that completed."""

    name: str
    runs: list[Outcome]

    @property
    def done(self) -> list[Outcome]:
        return [o for o in self.runs if o.ok]

    @property
    def ok(self) -> bool:
        return bool(self.done)

    @property
    def first(self) -> Outcome:
        return self.runs[0]

    @property
    def why_not(self) -> str:
        """Why no run completed."""
        o = self.first
        return o.skipped or o.error or "no epochs"

    def median(self, measure: Callable[[Outcome], float | None]) -> float | None:
        values = [v for v in (measure(o) for o in self.done) if v is not None]
        return statistics.median(values) if values else None

    @property
    def total_s(self) -> float:
        """The median of the runs' total times."""
        return self.median(lambda o: o.total_s) or 0.0

    @property
    def samples_per_s(self) -> float:
        """Samples of all epochs / the median total time."""
        return self.done[0].samples / self.total_s if self.ok and self.total_s > 0 else 0.0

    def record(self, baseline_s: float | None) -> dict[str, Any]:
        """A JSON-able record: the medians, the ratio baseline / this, and every run."""
        first = self.first
        out: dict[str, Any] = {
            "name": self.name,
            "loader": first.loader,
            "workers": first.workers,
            "pin_memory": first.pin_memory,
            "non_blocking": first.non_blocking,
            "note": first.note,
            "ran": len(self.done),
            "of": len(self.runs),
        }
        if not self.ok:
            out["skipped" if first.skipped else "error"] = self.why_not
        else:
            later = self.median(lambda o: o.later_mean_s)
            out.update(
                median_total_s=round(self.total_s, 3),
                median_epoch1_s=round(self.median(lambda o: o.epochs[0].wall_s) or 0.0, 3),
                median_later_epochs_mean_s=None if later is None else round(later, 3),
                samples_per_s=round(self.samples_per_s, 1),
                median_final_accuracy=round(self.median(lambda o: o.epochs[-1].accuracy) or 0.0, 4),
                median_wait_share=round(self.median(lambda o: o.wait_share) or 0.0, 4),
                baseline_over_this=ratio(baseline_s, self.total_s),
            )
        out["runs"] = [o.record() for o in self.runs]
        return out


def ratio(baseline_s: float | None, this_s: float) -> float | None:
    """baseline time / this time (how many times faster), None without a baseline."""
    return round(baseline_s / this_s, 3) if baseline_s and this_s > 0 else None


def train(
    source: EpochSource,
    outcome: Outcome,
    *,
    epochs: int,
    expect: int,
    device: torch.device,
    seed: int,
    counters: Callable[[], dict[str, int]] | None = None,
) -> None:
    """The seed's loop: ``epochs`` epochs of Adam (lr 1e-3) on cross-entropy over the
    batches ``source(epoch)`` gives, copied to ``device`` (non-blocking where the
    configuration says). Appends each epoch to ``outcome.epochs``; an epoch that delivers
    another number of samples than ``expect`` raises."""
    model = make_model(seed).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    nb = outcome.non_blocking
    for epoch in range(epochs):
        before = counters() if counters is not None else {}
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), dtype=torch.int64, device=device)
        n, wait = 0, 0.0
        started = time.perf_counter()
        batches = iter(source(epoch))
        while True:
            asked = time.perf_counter()
            try:
                x, y = next(batches)
            except StopIteration:
                break
            wait += time.perf_counter() - asked
            x, y = x.to(device, non_blocking=nb), y.to(device, non_blocking=nb)
            opt.zero_grad(set_to_none=True)
            out = model(x)
            loss = loss_fn(out, y)
            loss.backward()
            opt.step()
            # Summed on the device: no synchronisation per step.
            loss_sum += loss.detach() * len(y)
            correct += (out.detach().argmax(1) == y).sum()
            n += len(y)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - started
        if n != expect:
            raise RuntimeError(f"epoch {epoch + 1} delivered {n} samples, expected {expect}")
        after = counters() if counters is not None else {}
        e = Epoch(
            epoch=epoch + 1,
            wall_s=wall,
            wait_s=wait,
            samples=n,
            loss=loss_sum.item() / n,
            accuracy=correct.item() / n,
            cache={k: after[k] - before.get(k, 0) for k in after},
        )
        outcome.epochs.append(e)
        cache = ""
        if e.cache:
            cache = (
                f", fetched {common.human(e.cache.get('fetched_bytes', 0))}, "
                f"{e.cache.get('hits', 0)} hits / {e.cache.get('misses', 0)} misses"
            )
        common.log(
            f"  {outcome.name:<9} epoch {e.epoch}: {e.wall_s:6.2f}s, waited "
            f"{e.wait_s / e.wall_s if e.wall_s else 0:4.0%}, loss {e.loss:.3f}, "
            f"acc {e.accuracy:6.1%}{cache}"
        )


# -- the loaders --------------------------------------------------------------------------------


def data_loader(dataset: Any, args: argparse.Namespace, workers: int, pin: bool) -> Any:
    """The DataLoader every DataLoader configuration uses: batch 64, default collation
    (stacked inputs, a label tensor), persistent workers when there are any."""
    from torch.utils.data import DataLoader

    return DataLoader(
        dataset,
        batch_size=args.batch_size,
        num_workers=workers,
        persistent_workers=workers > 0,
        pin_memory=pin,
        timeout=300 if workers > 0 else 0,
    )


def wds_unavailable() -> str | None:
    """Why the webdataset configurations cannot run here, or None."""
    try:
        import webdataset  # noqa: F401
    except ImportError as exc:
        return f"webdataset is not installed ({exc})"
    if shutil.which("curl") is None:
        return "no curl command (webdataset reads S3 through `pipe:curl`)"
    return None


@contextlib.contextmanager
def wds_source(
    endpoint: str, data: Dataset, args: argparse.Namespace, workers: int, pin: bool
) -> Iterator[EpochSource]:
    """webdataset reading the shards from S3 as its documentation says: ``pipe:`` URLs
    (curl on presigned URLs), shard order shuffled per epoch, a 1000-sample shuffle
    buffer, :func:`decode_sample` in the pipeline."""
    import webdataset as wds

    client = base.s3_client(endpoint)
    urls = [
        "pipe:curl -s -f -L "
        + shlex.quote(
            client.generate_presigned_url(
                "get_object", Params={"Bucket": BUCKET, "Key": key}, ExpiresIn=PRESIGN_S
            )
        )
        for key in data.keys
    ]
    ds = (
        wds.WebDataset(
            urls,
            shardshuffle=len(urls),  # a full shuffle of the shard order ...
            detshuffle=True,  # ... different every epoch, the same for the same seed
            seed=args.seed,
            empty_check=False,
        )
        .shuffle(SHUFFLE_BUFFER)
        .map(decode_sample)
    )
    loader = data_loader(ds, args, workers, pin)

    def source(epoch: int) -> Iterable[Pair]:
        return loader  # type: ignore[no-any-return]

    try:
        yield source
    finally:
        base.shutdown_workers(loader)


def capacity_for(data: Dataset) -> int:
    """A hot tier that holds the whole dataset with room to spare."""
    return 2 * data.tar_bytes + (256 << 20)


@contextlib.contextmanager
def cached_dataset_source(
    daemon: bench_epochs.Daemon, data: Dataset, args: argparse.Namespace, pin: bool
) -> Iterator[EpochSource]:
    """``CachedDataset`` (shuffled, seed fixed, :func:`decode_sample` in the workers) in the
    same DataLoader as the webdataset configurations."""
    from cached_client import CachedDataset

    ds = CachedDataset(
        data.urls,
        socket=daemon.socket,
        shuffle=True,
        seed=args.seed,
        shuffle_buffer=SHUFFLE_BUFFER,
        decode=decode_sample,
        job="seed-cached",
    )
    loader = data_loader(ds, args, args.workers, pin)

    def source(epoch: int) -> Iterable[Pair]:
        ds.set_epoch(epoch)  # reaches the persistent workers too
        return loader  # type: ignore[no-any-return]

    try:
        yield source
    finally:
        base.shutdown_workers(loader)


@contextlib.contextmanager
def fast_source(
    daemon: bench_epochs.Daemon, data: Dataset, args: argparse.Namespace, pin: bool
) -> Iterator[EpochSource]:
    """``FastLoader`` in the training process: host batches of ``--batch-size`` (pinned
    where there is a GPU), decoded with :func:`decode_batch`."""
    from cached_client import FastLoader

    loader = FastLoader(
        data.urls,
        batch_size=args.batch_size,
        exts=["bin", "cls"],
        socket=daemon.socket,
        shuffle=True,
        seed=args.seed,
        pin_memory=pin,
        job="seed-fast",
    )

    def source(epoch: int) -> Iterable[Pair]:
        loader.set_epoch(epoch)
        return (decode_batch(batch) for batch in loader)

    try:
        yield source
    finally:
        conn = getattr(loader, "_conn", None)
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()


@contextlib.contextmanager
def memory_source(
    images: npt.NDArray[np.uint8], labels: npt.NDArray[np.int64], args: argparse.Namespace
) -> Iterator[EpochSource]:
    """A reference, not a loader: the same samples decoded once (untimed) into tensors in
    memory, batches cut from a per-epoch permutation. What is left is the loop's compute."""
    x = to_input(torch.from_numpy(images.reshape(len(images), PIXELS)))
    y = torch.from_numpy(labels)

    def source(epoch: int) -> Iterable[Pair]:
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(args.seed + epoch))
        for at in range(0, len(order), args.batch_size):
            idx = order[at : at + args.batch_size]
            yield x[idx], y[idx]

    yield source


# -- one configuration --------------------------------------------------------------------------


def run_config(
    name: str,
    args: argparse.Namespace,
    *,
    endpoint: str,
    data: Dataset,
    work: Path,
    device: torch.device,
    arrays: tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]] | None = None,
) -> Outcome:
    """Run configuration ``name`` once, in ``work``; never raises (an error becomes
    ``outcome.error``). ``arrays``: the samples in memory, for ``memory``."""
    cuda = device.type == "cuda"
    workers = {"baseline": 0, "fast": 0, "memory": 0}.get(name, args.workers)
    pin = cuda and name in ("pinned", "cached", "fast")
    outcome = Outcome(
        name=name,
        loader=LOADERS[name],
        workers=workers,
        pin_memory=pin,
        non_blocking=name in ("pinned", "cached", "fast"),
    )
    if name in ("pinned", "cached", "fast") and not cuda:
        outcome.note = NO_PINNED
    common.log(f"\n-- {name}: {outcome.loader}, {workers} worker(s)")
    train_kw: dict[str, Any] = {
        "epochs": args.epochs,
        "expect": data.samples,
        "device": device,
        "seed": args.seed,
    }
    daemon: bench_epochs.Daemon | None = None
    try:
        if name == "memory":
            if arrays is None:
                raise RuntimeError("no samples in memory")
            with memory_source(*arrays, args) as source:
                train(source, outcome, **train_kw)
            return outcome
        if name in ("baseline", "workers", "pinned"):
            why = wds_unavailable()
            if why is not None:
                outcome.skipped = why
                common.log(f"  skipped: {why}")
                return outcome
            with wds_source(endpoint, data, args, workers, pin) as source:
                train(source, outcome, **train_kw)
            return outcome
        started = time.perf_counter()
        capacity = capacity_for(data)
        daemon = bench_epochs.Daemon(
            work / f"daemon-{name}", endpoint, capacity, capacity, "belady"
        )
        # Its own hot tier: empty at the start (epoch 1 is cold), removed afterwards.
        with daemon:
            outcome.setup_s = time.perf_counter() - started
            make = cached_dataset_source if name == "cached" else fast_source
            with make(daemon, data, args, pin) as source:
                train(source, outcome, counters=daemon.counters, **train_kw)
    except Exception as exc:
        outcome.error = f"{type(exc).__name__}: {exc}".strip()
        common.log(f"  FAILED {name}: {outcome.error}")
        if daemon is not None:
            common.log(f"--- end of {daemon.log}:\n{daemon.log_tail(2000)}")
    return outcome


# -- the tables ---------------------------------------------------------------------------------


def results_table(
    summaries: Sequence[Summary], baseline_s: float | None, epochs: int, repeats: int
) -> str:
    """The markdown table of every configuration (medians over the runs when repeated)."""
    later = f"mean epochs 2-{epochs} s" if epochs > 2 else "epoch 2 s"
    head = [
        "config",
        "loader",
        "workers",
        f"{epochs} epochs s",
        "epoch 1 s",
        later,
        "samples/s",
        "final train acc",
        "waited",
        "baseline / this",
    ]
    if repeats > 1:
        head.append(f"runs ({epochs} epochs s)")
    head.append("note")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for sm in summaries:
        o = sm.first
        if not sm.ok:
            cells = [o.name, o.loader, str(o.workers), *["-"] * (len(head) - 4)]
            cells.append(f"did not run: {sm.why_not}")
        else:
            r = ratio(baseline_s, sm.total_s)
            mean = sm.median(lambda x: x.later_mean_s)
            cells = [
                o.name,
                o.loader,
                str(o.workers),
                f"{sm.total_s:.2f}",
                f"{sm.median(lambda x: x.epochs[0].wall_s) or 0.0:.2f}",
                "-" if mean is None else f"{mean:.2f}",
                f"{sm.samples_per_s:,.0f}",
                f"{sm.median(lambda x: x.epochs[-1].accuracy) or 0.0:.1%}",
                f"{sm.median(lambda x: x.wait_share) or 0.0:.0%}",
                "-" if r is None else f"{r:.2f}x",
            ]
            if repeats > 1:
                cells.append(" ".join(f"{x.total_s:.2f}" if x.ok else "failed" for x in sm.runs))
            failed = [x.error for x in sm.runs if x.error]
            cells.append(
                "; ".join([n for n in (o.note,) if n] + [f"a run failed: {f}" for f in failed])
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def published_table(summaries: Sequence[Summary], baseline_s: float | None) -> str:
    """Here next to the published figures (their 5 epochs on MNIST)."""
    base_pub = PUBLISHED_S["baseline"]
    head = "| config | published setup | published s | published ratio | here s | here ratio |"
    lines = [head, "|---|---|---|---|---|---|"]
    for sm in summaries:
        o = sm.first
        pub = PUBLISHED_S.get(o.name)
        here = f"{sm.total_s:.2f}" if sm.ok else "did not run"
        r = ratio(baseline_s, sm.total_s) if sm.ok else None
        lines.append(
            f"| {o.name} ({o.workers} workers) | {PUBLISHED_SETUP.get(o.name, '-')} | "
            + ("-" if pub is None else f"{pub:.2f}")
            + " | "
            + ("-" if pub is None else f"{base_pub / pub:.2f}x")
            + f" | {here} | "
            + ("-" if r is None else f"{r:.2f}x")
            + " |"
        )
    return "\n".join(lines)


# -- the run ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The options; ``--small`` picks the CI sizes."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--small", action="store_true", help="a smoke run: 400 samples, 2 epochs, 4 shards"
    )
    p.add_argument("--samples", type=int, help="samples in the dataset (60000; --small 400)")
    p.add_argument("--epochs", type=int, help="epochs per configuration (5; --small 2)")
    p.add_argument(
        "--shards", type=int, help="tar shards (one per 1000 samples, at least 4; --small 4)"
    )
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (2; the seed's 8)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per batch (64)")
    p.add_argument("--seed", type=int, default=0, help="data, weights and shuffle seed (0)")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of every configuration, round-robin; the tables show medians (1)",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        help="torch.set_num_threads in the training process (default: torch's own, "
        "usually the number of cores)",
    )
    p.add_argument(
        "--config",
        action="append",
        default=[],
        help=f"configurations to run, repeatable or comma-separated (default {','.join(CONFIGS)})",
    )
    p.add_argument("--out", type=Path, default=common.OUT_DIR, help="where the JSON goes")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = p.parse_args(argv)
    args.samples = args.samples or (400 if args.small else 60_000)
    args.epochs = args.epochs or (2 if args.small else 5)
    args.shards = args.shards or (4 if args.small else max(4, args.samples // 1000))
    args.configs = [c.strip() for v in args.config for c in v.split(",") if c.strip()] or list(
        CONFIGS
    )
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad:
        p.error(f"unknown configuration {', '.join(bad)}; known: {', '.join(CONFIGS)}")
    if min(args.epochs, args.workers, args.batch_size, args.repeats) < 1:
        p.error("--epochs, --workers, --batch-size and --repeats must be at least 1")
    if args.torch_threads is not None and args.torch_threads < 1:
        p.error("--torch-threads must be at least 1")
    if args.samples < args.shards:
        p.error("--samples must be at least --shards")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Make the data, upload it, run every configuration, print the tables, write the JSON."""
    args = parse_args(argv)
    head, started = common.start_run(
        "seed", "cached seed experiment: the 784-128-64-10 MNIST model, loader by loader"
    )
    log = common.log
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    log(
        f"device: {device}; torch threads {torch.get_num_threads()}; "
        + ("pinned memory: available" if cuda else NO_PINNED)
    )
    doc: dict[str, Any] = {
        **head,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "config")},
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "pinned_memory": "available" if cuda else NO_PINNED,
        "published": {
            "seconds": PUBLISHED_S,
            "setup": PUBLISHED_SETUP,
            "baseline_over_pinned": round(PUBLISHED_S["baseline"] / PUBLISHED_S["pinned"], 3),
        },
    }
    doc["settings"]["out"] = str(args.out)
    runs: dict[str, list[Outcome]] = {name: [] for name in args.configs}
    with (
        common.workdir("cached-bench-seed-", keep=args.keep) as work,
        shaping.moto_server(work / "moto.log") as endpoint,
    ):
        data = upload_dataset(endpoint, args.samples, args.shards, args.seed)
        doc["dataset"] = {k: v for k, v in asdict(data).items() if k != "keys"}
        log(
            f"dataset: {data.samples:,} synthetic 28x28 samples in {data.shards} shards, "
            f"{common.human(data.tar_bytes)} of tar, in s3://{BUCKET}/{PREFIX}/ at "
            f"{endpoint} (made in {data.make_s:.1f}s, uploaded in {data.upload_s:.1f}s)"
        )
        log(
            f"loop: {args.epochs} epochs, batch {args.batch_size}, Adam lr 1e-3, "
            f"cross-entropy, model seed {args.seed}; {args.repeats} run(s) of each "
            "configuration, round-robin"
        )
        # The same samples, regenerated (deterministic), for the in-memory reference.
        arrays = synthetic_mnist(args.samples, args.seed) if "memory" in args.configs else None
        for rep in range(args.repeats):
            if args.repeats > 1:
                log(f"\n== run {rep + 1} of {args.repeats}")
            for name in args.configs:
                runs[name].append(
                    run_config(
                        name,
                        args,
                        endpoint=endpoint,
                        data=data,
                        work=work / f"r{rep}",
                        device=device,
                        arrays=arrays,
                    )
                )
                # The daemon's hot tier is no longer needed; keep /tmp small.
                shutil.rmtree(work / f"r{rep}" / f"daemon-{name}" / "hot", ignore_errors=True)
    summaries = [Summary(name, rs) for name, rs in runs.items()]
    baseline = next((sm for sm in summaries if sm.name == "baseline" and sm.ok), None)
    baseline_s = baseline.total_s if baseline is not None else None
    log(
        f"\n{data.samples:,} samples, {args.epochs} epochs, device {device}, torch threads "
        f"{torch.get_num_threads()}"
        + (f", medians of {args.repeats} runs" if args.repeats > 1 else "")
        + ":\n"
    )
    log(results_table(summaries, baseline_s, args.epochs, args.repeats))
    log("")
    log(published_table(summaries, baseline_s))
    if not cuda:
        log(f"\n{NO_PINNED}: 'pinned' ran without it; non-blocking copies to the CPU are no-ops")
    doc["configurations"] = [sm.record(baseline_s) for sm in summaries]
    common.finish_run("seed", doc, started, args.out)
    log(json.dumps(doc, indent=2))
    # A configuration that could not run here (skipped) is not a failure; one that failed is.
    return 1 if any(o.error for rs in runs.values() for o in rs) else 0


if __name__ == "__main__":
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    sys.exit(main())
