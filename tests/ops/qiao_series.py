"""The series names qiao exports, read from a real `qiao serve`'s /metrics.

`exported_series()` starts bare `qiao serve` (the built-in demo LLM in its engine process and
MiniLM behind the dynamic batcher, so the collectors that only report served versions report)
with two data-parallel replicas (so the per-replica series appear), scrapes /metrics once and
stops it (after one completion and one embedding, so that labelled histograms have samples
whose labels `series_labels()` reports). A family's `# HELP`/`# TYPE` lines come before any sample does, so labelled series
that have seen no traffic still count; each family stands for the sample names Prometheus
stores from it (a histogram's `_bucket`, `_sum`, `_count`, `_created`; a counter's `_total`,
`_created`).

Two sets cannot come from this machine's scrape and come from the code that declares them:
the GPU series (`qiao.api.gpu_metrics.GPU_SERIES`), exported only where NVML finds a device, and
the replica series (`qiao.api.metrics._REPLICA_SERIES`) where fewer than two cores rule out two
replicas.
"""

from __future__ import annotations

import functools
import os
import re
import tempfile
from pathlib import Path

import httpx
from prometheus_client.core import CounterMetricFamily

from qiao.api.gpu_metrics import GPU_SERIES

_TYPE_LINE = re.compile(r"^# TYPE (\S+) (\w+)$", re.MULTILINE)
_SAMPLE_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)[{ ]", re.MULTILINE)
# A label and its quoted value (which may hold braces: route="/v2/models/{model_name}/infer").
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="(?:[^"\\]|\\.)*"')
_SUFFIXES = {
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
}


def names_in_scrape(text: str) -> set[str]:
    """The sample names a scrape stands for: its samples' and its declared families'."""
    names = set(_SAMPLE_LINE.findall(text))
    for family, kind in _TYPE_LINE.findall(text):
        if kind == "counter" and family.endswith("_total"):
            base = family.removesuffix("_total")
            names |= {family, base + "_created"}
        else:
            names |= {family + suffix for suffix in _SUFFIXES.get(kind, ("",))}
    return names


@functools.cache
def scrape() -> str:
    """One /metrics text of bare `qiao serve` with two replicas (one, given one core)."""
    # Imported here: serving's conftest is a test package module, found through pytest's path.
    from serving.conftest import SubprocessServer

    replicas = "2" if len(os.sched_getaffinity(0)) >= 2 else "1"
    with tempfile.TemporaryDirectory(prefix="qiao-series-") as folder:
        args = ["--data-dir", f"{folder}/data", "--log-interval", "0"]
        server = SubprocessServer(
            [*args, "--data-parallel-size", replicas], Path(folder) / "server.log"
        ).wait_ready()
        try:
            with httpx.Client(base_url=server.base_url, timeout=60.0) as client:
                _traffic(client)
                response = client.get("/metrics")
                response.raise_for_status()
                return response.text
        finally:
            server.stop()


def _traffic(client: httpx.Client) -> None:
    """A completion and an embedding, so the labelled histograms have samples (and labels)."""
    body = {"model": "demo_model", "prompt": "Once upon a time", "max_tokens": 4}
    client.post("/v1/completions", json=body).raise_for_status()
    body = {"model": "all-MiniLM-L6-v2", "input": "hello world"}
    client.post("/v1/embeddings", json=body).raise_for_status()


@functools.cache
def series_labels() -> dict[str, frozenset[str]]:
    """Sample name -> the label names its samples carry in the scrape (`le` left out). Read
    from the text as Prometheus stores it (prometheus_client's parser would rename Triton's
    counters, which have no `_total`)."""
    labels: dict[str, set[str]] = {}
    for line in scrape().splitlines():
        match = _SAMPLE_LINE.match(line)
        if match:
            names = labels.setdefault(match.group(1), set())
            names.update(_LABEL.findall(line, match.end(1)))
    return {name: frozenset(names - {"le"}) for name, names in labels.items()}


@functools.cache
def exported_series() -> frozenset[str]:
    """Every series name qiao exports (see the module's docstring for where each comes from)."""
    from qiao.api.metrics import _REPLICA_SERIES

    text = scrape()
    names = names_in_scrape(text)
    if "qiao:replica_up" not in names:  # one replica: the declared per-replica families
        names |= names_in_scrape(_declared(_REPLICA_SERIES))
    names |= set(GPU_SERIES)  # gauges; NVML-only
    return frozenset(names)


def _declared(series: tuple[tuple[type, str, str, str], ...]) -> str:
    """TYPE lines for (family class, name, help, key) entries, as the scrape would write them."""
    lines = []
    for kind, name, _, _ in series:
        if kind is CounterMetricFamily:
            lines.append(f"# TYPE {name}_total counter")
        else:
            lines.append(f"# TYPE {name} gauge")
    return "\n".join(lines) + "\n"
