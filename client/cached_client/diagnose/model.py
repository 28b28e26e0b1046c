"""The model: the measured rates, the step time and the dataset's residency in; the next
epoch's wait, the bottleneck and each lever's wait out. Numbers only: no I/O.

docs/observability.md ("Diagnosing one dataset") has the formulas and how well they
predict a real run.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from cached_wire.units import format_ms, format_rate, format_size, format_us

from ..errors import UsageError
from .measurements import DEFAULT_CONCURRENCY, Measurements

# The share of loop time waiting below which training is not input-bound.
WAIT_THRESHOLD = 0.05
# A disk this close to the rate reads reach through the daemon is what limits them.
DISK_MARGIN = 1.5

BOTTLENECKS = ("store", "hot_tier", "transport", "decode", "none")


@dataclass(frozen=True)
class Inputs:
    """The model's inputs: the configuration, the dataset and the measured rates, as plain
    numbers. A rate not measured is None (or 0 for costs), and then never limits.

    ``read_s_per_sample`` is one reader's wall time per sample with ``workers`` readers at
    once; ``loader_samples_per_s`` (``_2x``) what a DataLoader with ``workers`` (twice as
    many) workers delivered; ``hop_s`` the training loop's own time to take one batch from
    them; ``start_s`` the time to an epoch's first batch.
    """

    batch_size: int
    step_s: float
    workers: int
    cpus: int
    epoch_samples: float
    samples_per_shard: float
    dataset_bytes: float
    capacity_bytes: float
    resident_share: float  # of the dataset, now
    tar_bytes_per_sample: float
    payload_bytes_per_sample: float
    lookahead_bytes: float
    store_bytes_per_s: float | None = None
    read_s_per_sample: float | None = None
    read_cpu_per_sample: float = 0.0
    disk_bytes_per_s: float | None = None
    decode_s_per_sample: float = 0.0
    decode_cpu_per_sample: float = 0.0
    loader_samples_per_s: float | None = None
    loader_samples_per_s_2x: float | None = None
    hop_s: float = 0.0
    start_s: float = 0.0
    fast_samples_per_s: float | None = None
    decode_given: bool = False
    concurrency: int = DEFAULT_CONCURRENCY  # the downloads the daemon runs at once

    @classmethod
    def of(
        cls, m: Measurements, *, batch_size: int, step_s: float, workers: int, decode: bool
    ) -> Inputs:
        """The model's inputs from what :func:`measure` found."""
        loader = m.loader if m.loader is not None and m.loader.workers == workers else None
        return cls(
            batch_size=batch_size,
            step_s=step_s,
            workers=workers,
            cpus=m.cpus,
            epoch_samples=m.epoch_samples,
            samples_per_shard=m.samples_per_shard,
            dataset_bytes=m.dataset_bytes,
            capacity_bytes=m.capacity_bytes,
            resident_share=min(1.0, m.resident_shards / max(1, m.shards)),
            tar_bytes_per_sample=m.tar_bytes_per_sample,
            payload_bytes_per_sample=m.payload_bytes_per_sample,
            lookahead_bytes=m.lookahead_bytes,
            store_bytes_per_s=m.store.bytes_per_s if m.store else None,
            read_s_per_sample=m.reads.s_per_sample if m.reads else None,
            read_cpu_per_sample=m.reads.cpu_per_sample if m.reads else 0.0,
            disk_bytes_per_s=m.disk_bytes_per_s,
            decode_s_per_sample=m.decode_s_per_sample or 0.0,
            decode_cpu_per_sample=m.decode_cpu_per_sample or 0.0,
            loader_samples_per_s=loader.samples_per_s if loader else None,
            loader_samples_per_s_2x=m.loader_2x.samples_per_s if loader and m.loader_2x else None,
            hop_s=loader.hop_s if loader else 0.0,
            start_s=loader.start_s if loader else 0.0,
            fast_samples_per_s=m.fast_samples_per_s,
            decode_given=decode,
            concurrency=m.concurrency,
        )


@dataclass(frozen=True)
class Epoch:
    """One epoch as the model sees it (seconds)."""

    batches: float
    loop_s: float  # batches x (step + hop): the loop alone, never waiting
    workers_s: float  # the epoch's samples at the workers' rate
    store_s: float  # the store's share at its rate, and the last downloads' samples
    start_s: float  # to the first batch
    seconds: float  # start + the longest of loop, workers, store (workers + store: serial)
    limit: str  # "loop", "workers" or "store"
    wait_fraction: float  # 1 - batches x step / seconds


@dataclass(frozen=True)
class Lever:
    """One change and the wait it predicts over the next epoch."""

    name: str
    change: str
    predicted_wait_fraction: float
    note: str


@dataclass(frozen=True)
class Prediction:
    """What the model concludes."""

    consumption: float  # samples per second the step alone would take
    stages: dict[str, float]  # samples per second each stage delivers (inf: no limit)
    epoch: Epoch
    predicted_wait_fraction: float  # over the next epoch, from the hot tier as it is now
    steady_wait_fraction: float  # long epochs, the hot tier holding what it can
    bottleneck: str
    levers: list[Lever]
    symptom: str
    diagnosis: str
    change: str
    numbers: str


def steady_store_share(x: Inputs) -> float:
    """The share of every epoch that must come from the store once the hot tier holds
    what it can of the dataset: none when it holds it all, else what does not fit."""
    if x.dataset_bytes <= 0 or x.capacity_bytes >= x.dataset_bytes:
        return 0.0
    return 1.0 - x.capacity_bytes / x.dataset_bytes


def store_share(x: Inputs) -> float:
    """The share of the next epoch that must come from the store: what is not resident
    now, and at least what cannot stay resident."""
    return max(1.0 - x.resident_share, steady_store_share(x))


def workers_rate(x: Inputs, workers: int) -> tuple[float, str]:
    """Samples per second ``workers`` DataLoader workers deliver, and the part of their
    time that limits them (``hot_tier``, ``transport`` or ``decode``).

    Measured with a real DataLoader where there is one for this many workers (another
    count: the measured rate scaled, up to the CPUs); else one worker's read and decode
    times add up, ``workers / (read + decode)``, up to ``cpus / (CPU per sample)``. The
    raw disk caps it. The part named is the largest of a worker's time per sample: reading
    through the daemon (``hot_tier`` when the disk alone is about as slow, else
    ``transport``), decoding, or the rest (collation, handing the batch over: transport).
    """
    serial = (x.read_s_per_sample or 0.0) + x.decode_s_per_sample
    cpu = x.read_cpu_per_sample + x.decode_cpu_per_sample
    cpu_cap = x.cpus / cpu if cpu > 0 else math.inf
    modelled = min(workers / serial if serial > 0 else math.inf, cpu_cap)
    measured = {x.workers: x.loader_samples_per_s, 2 * x.workers: x.loader_samples_per_s_2x}
    found = measured.get(workers)
    if found:
        # A loop that takes batches as fast as it can may itself be the limit (its hop):
        # then the workers were at least that fast.
        hop_bound = x.batch_size / found < 1.25 * x.hop_s
        rate = max(found, modelled) if hop_bound and modelled < math.inf else found
    elif x.loader_samples_per_s:
        rate = min(x.loader_samples_per_s * workers / x.workers, cpu_cap)
    else:
        rate = modelled
    disk = x.disk_bytes_per_s / x.payload_bytes_per_sample if x.disk_bytes_per_s else math.inf
    if disk < rate:
        return disk, "hot_tier"
    read, dec = x.read_s_per_sample or 0.0, x.decode_s_per_sample
    rest = max(0.0, workers / rate - read - dec) if rate < math.inf else 0.0
    if dec > 0 and dec >= read and dec >= rest:
        return rate, "decode"
    if read > 0 and read >= rest and disk < DISK_MARGIN * workers / read:
        return rate, "hot_tier"
    return rate, "transport"


def epoch(
    x: Inputs,
    *,
    workers: int | None = None,
    share: float | None = None,
    overlap: bool | None = None,
    fast: bool = False,
    steady: bool = False,
) -> Epoch:
    """The next epoch's time and wait for ``x``, or for a changed configuration.

    The loop takes ``batches x (step + hop)`` by itself; the workers need ``samples /
    rate``; the store ``share x samples x bytes per sample / store rate``, plus the
    samples of the last downloads (which run side by side and land together) at the rate
    the loop takes them. With a lookahead the daemon fetches beside the workers and the
    longest of the three sets the epoch; without, each worker waits for its next shard's
    download, then reads it: workers and store add up. The epoch starts with the time to
    its first batch. ``fast``: FastLoader, whose loop receives each batch itself (``batch
    / fast rate``) and has no workers. ``steady``: a long epoch (no start, no last
    downloads) with the store's steady share.
    """
    w = x.workers if workers is None else workers
    f = (steady_store_share(x) if steady else store_share(x)) if share is None else share
    lap = x.lookahead_bytes > 0 if overlap is None else overlap
    n = x.epoch_samples / x.batch_size
    if fast:
        take = x.batch_size / x.fast_samples_per_s if x.fast_samples_per_s else 0.0
        per_batch, made, first = x.step_s + take, math.inf, take
    else:
        per_batch, first = x.step_s + x.hop_s, x.start_s
        made, _ = workers_rate(x, w)
    first = 0.0 if steady else first
    loop = n * per_batch
    work = x.epoch_samples / made if made < math.inf else 0.0
    fetch = tail = 0.0
    if f > 0 and x.store_bytes_per_s:
        fetch = f * x.epoch_samples * x.tar_bytes_per_sample / x.store_bytes_per_s
        last = min(x.concurrency * x.samples_per_shard, f * x.epoch_samples)
        if lap and not steady:
            tail = last / min(made, x.batch_size / per_batch)
    if lap:
        terms = {"loop": loop, "workers": work, "store": fetch + tail}
    else:
        terms = {"loop": loop, "store" if fetch >= work else "workers": work + fetch}
    limit = max(terms, key=lambda k: terms[k])
    seconds = first + terms[limit]
    wait = max(0.0, 1.0 - n * x.step_s / seconds) if seconds > 0 else 0.0
    return Epoch(n, loop, work, fetch + tail, first, seconds, limit, wait)


def _name(x: Inputs, e: Epoch, workers: int) -> str:
    if e.limit == "store":
        return "store"
    if e.limit == "workers":
        return workers_rate(x, workers)[1]
    return "transport"  # the loop: the hop from the workers to the training process


def predict(x: Inputs) -> Prediction:
    """Predicted wait, bottleneck and levers for ``x`` (numbers only: no I/O).

    The bottleneck is the stage that sets the epoch's time when the wait without the
    epoch's start is above ``WAIT_THRESHOLD``, else ``none``.
    """
    if x.batch_size < 1 or x.step_s <= 0:
        raise UsageError("the batch size and the step time must be positive")
    consumption = x.batch_size / x.step_s
    now = epoch(x)
    # The bottleneck is what limits a running epoch; a start-up alone does not name one.
    without_start = epoch(dataclasses.replace(x, start_s=0.0))
    steady = epoch(x, steady=True)
    bottleneck = (
        _name(x, without_start, x.workers)
        if without_start.wait_fraction > WAIT_THRESHOLD
        else "none"
    )
    f = store_share(x)
    made, _ = workers_rate(x, x.workers)
    stages = {
        "store": (
            x.store_bytes_per_s / (f * x.tar_bytes_per_sample)
            if f > 0 and x.store_bytes_per_s
            else math.inf
        ),
        "workers": made,
        "loop": x.batch_size / (x.step_s + x.hop_s),
        "consumption": consumption,
    }
    levers = _levers(x)
    numbers = _numbers(x, now, f, made)
    if bottleneck == "none":
        symptom = f"not input-bound: the loop would wait {now.wait_fraction:.0%} of its time"
        slowest = min(stages["store"], stages["workers"])
        diagnosis = (
            f"none: the slowest stage delivers {slowest / consumption:.1f}x what the loop takes"
            if slowest < math.inf
            else "none: no measured stage limits the loop"
        )
        if now.start_s > 0 and now.wait_fraction > WAIT_THRESHOLD:
            diagnosis += f" (the epoch's start, {now.start_s:.1f} s, is most of the wait)"
        # (The steady wait is never above the running epoch's: no change needed later.)
        change = "none needed"
    else:
        symptom = f"input-bound: the loop would wait {now.wait_fraction:.0%} of its time"
        if steady.wait_fraction + 0.02 < now.wait_fraction:
            symptom += (
                f" over the next epoch; {steady.wait_fraction:.0%} once the hot tier holds "
                "what it can"
            )
        diagnosis = _diagnosis(x, bottleneck, now, stages)
        change = _change(x, levers, now.wait_fraction)
    return Prediction(
        consumption=consumption,
        stages=stages,
        epoch=now,
        predicted_wait_fraction=now.wait_fraction,
        steady_wait_fraction=steady.wait_fraction,
        bottleneck=bottleneck,
        levers=levers,
        symptom=symptom,
        diagnosis=diagnosis,
        change=change,
        numbers=numbers,
    )


def _change(x: Inputs, levers: list[Lever], wait: float) -> str:
    """The lever that cuts the wait most; a fast path that needs the decoding moved to the
    GPU (a code change) comes second to a change of configuration that helps."""
    helps = [lv for lv in levers if lv.predicted_wait_fraction < wait - 0.02]
    if not helps:
        best = min(levers, key=lambda lv: lv.predicted_wait_fraction)
        return f"no single lever helps much; the best: {best.change}"
    helps.sort(key=lambda lv: lv.predicted_wait_fraction)
    first = helps[0]
    if first.name == "fast_path" and x.decode_given and len(helps) > 1:
        first = helps[1]
    text = f"{first.change} (predicted wait {first.predicted_wait_fraction:.0%})"
    better = [lv for lv in helps if lv is not first and lv.name == "fast_path"]
    if better and better[0].predicted_wait_fraction < first.predicted_wait_fraction - 0.02:
        text += (
            f"; or {better[0].change} ({better[0].predicted_wait_fraction:.0%}, with the "
            "decoding on the GPU)"
        )
    return text


def _numbers(x: Inputs, e: Epoch, f: float, made: float) -> str:
    """The epoch's arithmetic, for the table's ``numbers`` row; ``made``: the workers'
    samples per second."""
    parts = [
        f"epoch {x.epoch_samples:,.0f} samples = {e.batches:,.0f} batches",
        f"loop {e.batches:,.0f} x ({format_ms(x.step_s)} step + {format_ms(x.hop_s)} hop) "
        f"= {e.loop_s:.2f} s",
        f"workers {x.epoch_samples:,.0f} / {format_rate(made)}/s = {e.workers_s:.2f} s",
    ]
    if f > 0 and x.store_bytes_per_s:
        parts.append(
            f"store {f:.0%} x {format_size(x.dataset_bytes)} / "
            f"{format_size(x.store_bytes_per_s)}/s + last downloads = {e.store_s:.2f} s"
        )
    elif f > 0:
        parts.append(f"store {f:.0%} of the dataset, rate not measured")
    parts.append(f"start {e.start_s:.2f} s")
    return (
        "; ".join(parts)
        + f" -> {e.seconds:.2f} s, waiting 1 - {e.batches * x.step_s:.2f}/{e.seconds:.2f} = "
        + f"{e.wait_fraction:.2f}"
    )


def _diagnosis(x: Inputs, name: str, e: Epoch, stages: dict[str, float]) -> str:
    c = format_rate(stages["consumption"])
    if name == "store":
        return (
            f"store: {store_share(x):.0%} of the epoch comes from the store at "
            f"{format_size(x.store_bytes_per_s or 0.0)}/s = {format_rate(stages['store'])} "
            f"samples/s; the step takes {c}"
        )
    if name == "hot_tier":
        return (
            f"hot_tier: the disk reads {format_size(x.disk_bytes_per_s or 0.0)}/s, about what "
            f"the workers get through the daemon: {format_rate(stages['workers'])} "
            f"samples/s; the step takes {c}"
        )
    if name == "decode":
        return (
            f"decode: {format_us(x.decode_s_per_sample)} per sample in each worker (reading "
            f"{format_us(x.read_s_per_sample or 0.0)}): {x.workers} workers deliver "
            f"{format_rate(stages['workers'])} samples/s; the step takes {c}"
        )
    if e.limit == "loop":
        return (
            "transport: taking each batch from the workers costs the loop "
            f"{format_ms(x.hop_s)} (collation, pickling, shared memory) beside a "
            f"{format_ms(x.step_s)} step"
        )
    return (
        f"transport: {x.workers} workers deliver {format_rate(stages['workers'])} samples/s "
        f"(reading through the daemon {format_us(x.read_s_per_sample or 0.0)} per sample, "
        f"the rest collating and handing over); the step takes {c}"
    )


def _levers(x: Inputs) -> list[Lever]:
    levers = []
    w2 = 2 * x.workers
    if x.loader_samples_per_s_2x:
        how = "measured with a DataLoader of that many workers"
    elif x.loader_samples_per_s:
        how = "estimated: the measured loader scaled, up to the CPUs"
    else:
        how = "estimated from the reads and the decode, up to the CPUs"
    levers.append(
        Lever(
            "workers",
            f"num_workers {x.workers} -> {w2}",
            epoch(x, workers=w2).wait_fraction,
            how,
        )
    )
    if x.lookahead_bytes <= 0:
        size = x.concurrency * x.samples_per_shard * x.tar_bytes_per_sample
        levers.append(
            Lever(
                "lookahead",
                f"[prefetch] lookahead 0 -> at least {format_size(size)}",
                epoch(x, overlap=True).wait_fraction,
                "the daemon then fetches beside the workers instead of each waiting for its "
                "next shard; nothing goes past the store's rate",
            )
        )
    else:
        levers.append(
            Lever(
                "lookahead",
                f"[prefetch] lookahead {format_size(x.lookahead_bytes)} -> larger",
                epoch(x).wait_fraction,
                "no change: prefetch already fetches beside the workers, and nothing goes "
                "past the store's rate",
            )
        )
    if x.capacity_bytes >= x.dataset_bytes:
        cold = 1.0 - x.resident_share
        change = (
            f"warm the hot tier first (cached prefetch URLS): {cold:.0%} of the dataset is "
            f"not resident, and it fits ({format_size(x.dataset_bytes)} of "
            f"{format_size(x.capacity_bytes)})"
            if cold > 0.01
            else "none: the hot tier holds the dataset"
        )
        note = "then the epochs read the hot tier alone"
    else:
        change = (
            f"[cache] capacity {format_size(x.capacity_bytes)} -> at least "
            f"{format_size(x.dataset_bytes * 1.1)}"
        )
        note = f"now the store serves {steady_store_share(x):.0%} of every epoch"
    levers.append(Lever("hot_tier", change, epoch(x, share=0.0).wait_fraction, note))
    note = (
        "measured: one process receiving in place"
        if x.fast_samples_per_s
        else "not measured (nothing resident to read)"
    )
    if x.decode_given:
        note += "; FastLoader yields raw bytes, so the decode must move to the GPU"
    levers.append(
        Lever(
            "fast_path",
            "FastLoader instead of DataLoader workers",
            epoch(x, fast=True).wait_fraction,
            note,
        )
    )
    return levers
