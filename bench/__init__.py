"""Benchmarks of cached: they print figures and ratios, never pass/fail."""
