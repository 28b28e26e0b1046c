"""How rates and times read in the verdict and the table."""

from __future__ import annotations

import math


def format_rate(v: float) -> str:
    """Samples per second: "1,039", "2.5", or "unlimited" for a stage that never limits."""
    if v == math.inf:
        return "unlimited"
    return f"{v:,.0f}" if v >= 10 else f"{v:.1f}"


def format_ms(s: float) -> str:
    return f"{s * 1000:.3g} ms"


def format_us(s: float) -> str:
    return f"{s * 1e6:.3g} us"
