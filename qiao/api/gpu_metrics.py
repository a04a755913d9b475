"""GPU utilisation and memory, read from NVML at scrape time (what `nvidia-smi` shows).

`GpuCollector` exports one sample per device NVML reports, labelled `gpu` (NVML's index, which
is PCI bus order and may differ from CUDA's order), `uuid` and `gpu_name`:

- `qiao:gpu_utilization_perc`: the share (0-1, like `qiao:kv_cache_usage_perc`) of NVML's last
  sample period (1/6 s to 1 s by device) in which a kernel ran: nvidia-smi's GPU-Util / 100;
- `qiao:gpu_memory_used_bytes`, `qiao:gpu_memory_total_bytes`: device memory in use (by every
  process, the KV cache qiao preallocates included) and installed.

NVML comes from the `nvidia-ml-py` package (`import pynvml`) and the driver's libnvidia-ml.
Without either, or where NVML fails to start (a CPU-only machine), the collector exports
nothing and never raises: a scrape must not fail for want of a GPU. A device that stops
answering (lost, reset) is left out of that scrape; one whose utilisation NVML does not report
(a MIG instance) still has its memory series.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

LABELS = ("gpu", "uuid", "gpu_name")
# name -> help; the names the collector can export (the tests take them from here, as no GPU
# series exist on a CPU machine).
GPU_SERIES = {
    "qiao:gpu_utilization_perc": "Share of NVML's last sample period a kernel ran on the GPU (0-1).",
    "qiao:gpu_memory_used_bytes": "GPU memory in use, by all processes.",
    "qiao:gpu_memory_total_bytes": "GPU memory installed.",
}


def load_nvml() -> ModuleType | None:
    """`pynvml`, initialised; None where the package, the driver library or a device is missing."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...: no GPU here
        logger.debug("NVML unavailable, no GPU metrics: %s", exc)
        return None
    return pynvml


class GpuCollector(Collector):
    """The GPU series of every NVML device, read at each scrape; nothing without NVML."""

    def __init__(self) -> None:
        self.nvml = load_nvml()
        self._warned: set[str] = set()  # each NVML failure is logged once, not every scrape

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self.nvml is None:
            return
        try:
            count = self.nvml.nvmlDeviceGetCount()
            readings = [r for i in range(count) if (r := self._read(i))]
        except Exception as exc:  # whatever the bindings raise, the scrape goes on without GPUs
            self._warn_once("count", "NVML failed, no GPU metrics: %s", exc)
            return
        if not readings:
            return
        families = {
            name: GaugeMetricFamily(name, doc, labels=LABELS) for name, doc in GPU_SERIES.items()
        }
        for labels, values in readings:
            for name, value in values.items():
                families[name].add_metric(labels, value)
        yield from families.values()

    def _read(self, index: int) -> tuple[list[str], dict[str, float]] | None:
        """One device's labels and values; None if it does not answer."""
        nvml = self.nvml
        assert nvml is not None
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            labels = [str(index), _text(nvml.nvmlDeviceGetUUID(handle))]
            labels.append(_text(nvml.nvmlDeviceGetName(handle)))
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        except nvml.NVMLError as exc:
            self._warn_once(f"device {index}", "NVML device %d did not answer: %s", index, exc)
            return None
        values = {
            "qiao:gpu_memory_used_bytes": float(memory.used),
            "qiao:gpu_memory_total_bytes": float(memory.total),
        }
        # Not reported for some devices (a MIG instance): their memory still is.
        with contextlib.suppress(nvml.NVMLError):
            utilization = nvml.nvmlDeviceGetUtilizationRates(handle)
            values["qiao:gpu_utilization_perc"] = utilization.gpu / 100
        return labels, values

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)


def _text(value: Any) -> str:
    """NVML strings: str in current nvidia-ml-py, bytes in old releases."""
    return value.decode() if isinstance(value, bytes) else str(value)
