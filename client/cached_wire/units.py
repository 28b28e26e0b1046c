"""How sizes, rates and times read for people: the daemon's logs and status (``cached.config``
imports :func:`format_size` from here) and ``cached diagnose``'s verdict and table."""

from __future__ import annotations

import math


def format_size(n: float) -> str:
    """Format bytes for humans: ``1536 -> '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_rate(v: float) -> str:
    """Samples per second: "1,039", "2.5", or "unlimited" for a stage that never limits."""
    if v == math.inf:
        return "unlimited"
    return f"{v:,.0f}" if v >= 10 else f"{v:.1f}"


def format_ms(s: float) -> str:
    return f"{s * 1000:.3g} ms"


def format_us(s: float) -> str:
    return f"{s * 1e6:.3g} us"
