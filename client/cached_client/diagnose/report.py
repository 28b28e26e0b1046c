"""What ``cached diagnose`` prints: the JSON object of ``--json``, or the text report (what was
measured, the verdict as a table, the levers)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

from cached_wire.units import format_ms, format_size, format_us

from .measurements import Measurements
from .model import Inputs, Prediction, steady_store_share, store_share


def _finite(v: float) -> float | None:
    return None if v == math.inf else round(v, 3)


def report(m: Measurements, p: Prediction, x: Inputs, *, decode_spec: str | None) -> dict[str, Any]:
    """The JSON object of ``--json``."""
    return {
        "bottleneck": p.bottleneck,
        "predicted_wait_fraction": round(p.predicted_wait_fraction, 4),
        "steady_wait_fraction": round(p.steady_wait_fraction, 4),
        "symptom": p.symptom,
        "diagnosis": p.diagnosis,
        "change": p.change,
        "numbers": p.numbers,
        "config": {
            "workers": x.workers,
            "batch_size": x.batch_size,
            "step_ms": round(x.step_s * 1000, 3),
            "decode": decode_spec,
        },
        "model": {
            "stages_samples_per_s": {k: _finite(v) for k, v in p.stages.items()},
            "store_share": round(store_share(x), 4),
            "steady_store_share": round(steady_store_share(x), 4),
            "epoch": dataclasses.asdict(p.epoch),
        },
        "levers": [dataclasses.asdict(lv) for lv in p.levers],
        "recommendations": [p.change],
        "measurements": dataclasses.asdict(m),
    }


def render(m: Measurements, p: Prediction, x: Inputs, *, decode_spec: str | None) -> str:
    """The text report: what was measured, the verdict as a table (symptom, diagnosis,
    recommended change, numbers), and the levers."""
    estimated = "" if m.shards_opened >= m.shards else " (estimated)"
    lines = [
        f"cached diagnose: {m.shards} shards, {format_size(m.dataset_bytes)}{estimated}, "
        f"{m.epoch_samples:,.0f} samples; {x.workers} workers, batch {x.batch_size}, step "
        f"{format_ms(x.step_s)}" + (f", decode {decode_spec}" if decode_spec else ""),
        "",
        "measured",
    ]

    def row(name: str, value: str) -> None:
        lines.append(f"  {name:<10} {value}")

    s = m.store
    if s is None:
        row("store", "not measured: every shard opened was resident")
    elif s.bytes_per_s is None:
        row("store", s.note)
    else:
        row(
            "store",
            f"{'< ' if s.upper_bound else ''}{format_size(s.bytes_per_s)}/s ({s.shards} cold "
            f"shards, {format_size(s.bytes)} in {s.seconds:.1f} s"
            + (f"; {s.note})" if s.note else ")"),
        )
    row(
        "hot tier",
        f"{m.resident_shards:.0f} of {m.shards} shards resident ({m.residency_from}); "
        f"{format_size(m.used_bytes)} of {format_size(m.capacity_bytes)} used; lookahead "
        f"{format_size(m.lookahead_bytes)}",
    )
    if m.disk_bytes_per_s:
        row("disk", f"{format_size(m.disk_bytes_per_s)}/s reading the shard files raw")
    if m.reads is not None:
        row(
            "transport",
            f"{m.reads.readers} readers {m.reads.samples_per_s:,.0f} samples/s "
            f"({format_size(m.reads.bytes_per_s)}/s), {format_us(m.reads.s_per_sample)} per "
            "sample each",
        )
    if m.decode_s_per_sample is not None:
        row(
            "decode",
            f"{1 / m.decode_s_per_sample:,.0f} samples/s in one process "
            f"({format_us(m.decode_s_per_sample)} per sample)",
        )
    for loader in (m.loader, m.loader_2x):
        if loader is not None:
            row(
                "loader",
                f"{loader.workers} workers {loader.samples_per_s:,.0f} samples/s, first batch "
                f"{loader.start_s:.2f} s, {format_ms(loader.hop_s)} to take a ready batch",
            )
    if m.fast_samples_per_s is not None:
        row("fast path", f"{m.fast_samples_per_s:,.0f} samples/s in one process")
    lines += ["", *_table(p), "", "levers        wait  change"]
    for lv in p.levers:
        lines.append(f"  {lv.name:<10} {lv.predicted_wait_fraction:>5.0%}  {lv.change} ({lv.note})")
    lines += [f"note: {note}" for note in m.notes]
    lines.append(f"(measured in {m.seconds:.0f} s)")
    return "\n".join(lines)


def _table(p: Prediction) -> Iterator[str]:
    for name, value in (
        ("symptom", p.symptom),
        ("diagnosis", p.diagnosis),
        ("change", p.change),
        ("numbers", p.numbers),
    ):
        yield f"{name:<10} {value}"
