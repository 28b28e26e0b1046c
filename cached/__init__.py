"""cached: a per-node tiered caching daemon that keeps GPUs fed."""

__version__ = "0.1.0"
