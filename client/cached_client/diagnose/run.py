"""``cached diagnose`` from end to end: check the arguments, measure, model, print."""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from cached_wire.urls import expand_all

from ..errors import UsageError
from .measure import measure
from .model import Inputs, predict
from .rates import Decode
from .report import render, report


def run(
    socket: str,
    patterns: Sequence[str],
    *,
    step_ms: float,
    workers: int,
    batch_size: int,
    decode_spec: str | None,
    as_json: bool,
    budget_s: float,
) -> int:
    """``cached diagnose``: measure, predict, print; returns the exit code."""
    if step_ms <= 0:
        raise UsageError(f"--step-ms must be positive, not {step_ms:g}")
    if batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, not {batch_size}")
    if workers < 1:
        raise UsageError(f"--workers must be at least 1, not {workers}")
    if budget_s <= 0:
        raise UsageError(f"--budget must be positive, not {budget_s:g}")
    expand_all(list(patterns))  # bad URLs fail before anything else
    decode = load_decode(decode_spec) if decode_spec else None

    def progress(line: str) -> None:
        print(f"diagnose: {line}", file=sys.stderr, flush=True)

    m = measure(
        socket,
        patterns,
        workers=workers,
        batch_size=batch_size,
        decode=decode,
        budget_s=budget_s,
        progress=progress,
    )
    x = Inputs.of(
        m, batch_size=batch_size, step_s=step_ms / 1000, workers=workers, decode=bool(decode)
    )
    p = predict(x)
    if as_json:
        print(json.dumps(report(m, p, x, decode_spec=decode_spec), indent=2, sort_keys=True))
    else:
        print(render(m, p, x, decode_spec=decode_spec))
    return 0


def load_decode(spec: str) -> Decode:
    """``MODULE:FUNC`` imported (the current directory first on the path, as ``python -m``
    has it); raises :class:`UsageError` with one line for a bad spec."""
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise UsageError(f"--decode {spec!r}: expected MODULE:FUNC, e.g. mytrain.data:decode")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        found: Any = importlib.import_module(module_name)
    except Exception as exc:  # whatever the import raised, it is the spec's: one line
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(f"--decode {spec!r}: cannot import {module_name}: {first}") from None
    for part in func_name.split("."):
        found = getattr(found, part, None)
        if found is None:
            raise UsageError(f"--decode {spec!r}: {module_name} has no {func_name}")
    if not callable(found):
        raise UsageError(f"--decode {spec!r}: {func_name} is not callable")
    decode: Decode = found
    return decode
