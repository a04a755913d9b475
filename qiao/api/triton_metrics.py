"""Triton's `nv_inference_*` Prometheus counters, read at scrape time from the served versions'
`InferStatistics` (the numbers the statistics extension reports), for dashboards built on Triton.

Appended to `/metrics` after the server's own series; labels `model` and `version` as Triton's.
Written by hand rather than through prometheus_client, whose counters would gain a `_total`
suffix that Triton's names do not have.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from qiao.repository.statistics import InferStatistics
from qiao.repository.types import ServedVersion

# name, help, the value of one version's statistics.
_COUNTERS: tuple[tuple[str, str, Callable[[InferStatistics], float]], ...] = (
    (
        "nv_inference_request_success",
        "Number of successful inference requests, all batch sizes",
        lambda s: s.success.count,
    ),
    (
        "nv_inference_request_failure",
        "Number of failed inference requests, all batch sizes",
        lambda s: s.fail.count,
    ),
    (
        "nv_inference_count",
        "Number of inferences performed (does not include cached requests)",
        lambda s: s.inference_count,
    ),
    (
        "nv_inference_exec_count",
        "Number of model executions performed (does not include cached requests)",
        lambda s: s.execution_count,
    ),
    (
        "nv_inference_request_duration_us",
        "Cumulative inference request duration in microseconds (includes cached requests)",
        lambda s: (s.success.ns + s.fail.ns) // 1000,
    ),
    (
        "nv_inference_queue_duration_us",
        "Cumulative inference queuing duration in microseconds (includes cached requests)",
        lambda s: s.queue.ns // 1000,
    ),
    (
        "nv_inference_compute_input_duration_us",
        "Cumulative compute input duration in microseconds (does not include cached requests)",
        lambda s: s.compute_input.ns // 1000,
    ),
    (
        "nv_inference_compute_infer_duration_us",
        "Cumulative compute inference duration in microseconds (does not include cached requests)",
        lambda s: s.compute_infer.ns // 1000,
    ),
    (
        "nv_inference_compute_output_duration_us",
        "Cumulative inference compute output duration in microseconds (does not include cached "
        "requests)",
        lambda s: s.compute_output.ns // 1000,
    ),
)


def render(versions: Iterable[ServedVersion]) -> bytes:
    """Prometheus text of every version's counters."""
    served = sorted(versions, key=lambda s: (s.model, int(s.version)))
    lines = []
    for name, help_text, value in _COUNTERS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
        for s in served:
            labels = f'model="{_escape(s.model)}",version="{_escape(s.version)}"'
            lines.append(f"{name}{{{labels}}} {value(s.statistics)}")
    return ("\n".join(lines) + "\n").encode()


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
