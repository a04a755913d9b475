"""The NVML collector: nothing, and no error, where there is no GPU; each device's utilisation
and memory on CUDA."""

from __future__ import annotations

import sys

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from qiao.api.gpu_metrics import GPU_SERIES, LABELS, GpuCollector, load_nvml
from qiao.api.metrics import ServerMetrics

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")


def _gpu_samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The qiao:gpu_* samples of a scrape, by series name."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("qiao:gpu_"):
                samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


@no_cuda
def test_without_a_gpu_the_collector_exports_nothing_and_the_scrape_works() -> None:
    collector = GpuCollector()
    assert collector.nvml is None  # the driver's libnvidia-ml is not on this machine
    assert list(collector.collect()) == []
    text = ServerMetrics(list).render().decode()
    assert "qiao:gpu_" not in text
    assert "# TYPE qiao:http_requests_total counter" in text


def test_without_the_nvml_package_the_collector_exports_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    assert load_nvml() is None
    collector = GpuCollector()
    assert list(collector.collect()) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_every_device_reports_utilisation_and_memory() -> None:
    # Work on the device first, so the context (and its memory) exists while we read.
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    samples = _gpu_samples(ServerMetrics(list).render().decode())
    assert set(samples) == set(GPU_SERIES)
    total = {s[0]["uuid"]: s[1] for s in samples["qiao:gpu_memory_total_bytes"]}
    used = {s[0]["uuid"]: s[1] for s in samples["qiao:gpu_memory_used_bytes"]}
    # NVML sees every device of the machine; CUDA those it was allowed.
    assert len(total) >= torch.cuda.device_count() >= 1
    assert set(used) == set(total)
    for uuid, bytes_total in total.items():
        assert 0 < used[uuid] <= bytes_total
    props = torch.cuda.get_device_properties(0)
    assert any(abs(t - props.total_memory) / t < 0.05 for t in total.values())
    for labels, value in samples["qiao:gpu_utilization_perc"]:
        assert set(labels) == set(LABELS)
        assert labels["uuid"].startswith(("GPU-", "MIG-")) and labels["gpu_name"]
        assert 0.0 <= value <= 1.0
    del x
