"""GPU utilization and memory per GPU in ``/metrics``, where an NVIDIA driver and
``nvidia-ml-py`` are present; elsewhere nothing at all, and no error.

Read at scrape time (NVML answers in microseconds), so there is no polling task, and the
daemon's view is never staler than the scrape. Next to ``cached_job_wait_seconds_total``
this tells a starving GPU (low utilization, jobs waiting) from a busy one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)


class GpuCollector(Collector):
    """``cached_gpu_utilization_ratio``, ``cached_gpu_memory_used_bytes`` and
    ``cached_gpu_memory_total_bytes``, labelled by GPU index, from NVML."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self._failed = False

    def collect(self) -> Iterator[Metric]:
        nvml = self._nvml
        util = GaugeMetricFamily(
            "cached_gpu_utilization_ratio",
            "Share of the last sample period in which a kernel ran on the GPU (NVML)",
            labels=["gpu"],
        )
        used = GaugeMetricFamily(
            "cached_gpu_memory_used_bytes", "GPU memory in use (NVML)", labels=["gpu"]
        )
        total = GaugeMetricFamily(
            "cached_gpu_memory_total_bytes", "GPU memory in all (NVML)", labels=["gpu"]
        )
        try:
            for i in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                rates = nvml.nvmlDeviceGetUtilizationRates(handle)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                util.add_metric([str(i)], rates.gpu / 100.0)
                used.add_metric([str(i)], float(memory.used))
                total.add_metric([str(i)], float(memory.total))
        except Exception as exc:  # a driver that went away (reset, unload): no GPU series
            if not self._failed:
                log.warning("GPU metrics unavailable: NVML failed: %s", exc)
                self._failed = True
            return
        self._failed = False
        yield from (util, used, total)


def nvml() -> Any | None:
    """The initialized ``pynvml`` module, or None without the package or a driver."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...: no GPU here
        log.debug("no GPU metrics: %s", exc)
        return None
    return pynvml


def register(registry: CollectorRegistry) -> bool:
    """Register the GPU collector when NVML works here; whether it was."""
    module = nvml()
    if module is None:
        return False
    registry.register(GpuCollector(module))
    return True
