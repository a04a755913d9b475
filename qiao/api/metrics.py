"""Prometheus metrics, named as operators already chart them (vLLM's names, `qiao:` prefix).

The engine produces plain data (per-request timings in `RequestOutput.metrics`, a stats dict per
step); this module only exports it. Each app has its own registry, so several servers in one
process (tests) never share counters.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from qiao.outputs import RequestOutput

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
TOKEN_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)


class ServerMetrics:
    def __init__(self, model_name: str, stats: Any) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry
        self.http_requests = Counter(
            "qiao:http_requests",
            "HTTP requests by route and status code.",
            ["model_name", "route", "status_code"],
            registry=r,
        )
        self.request_success = Counter(
            "qiao:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "qiao:prompt_tokens", "Prompt tokens of finished requests.", labels, registry=r
        )
        self.generation_tokens = Counter(
            "qiao:generation_tokens", "Generated tokens.", labels, registry=r
        )
        self.ttft = Histogram(
            "qiao:time_to_first_token_seconds",
            "Arrival to first generated token.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "qiao:inter_token_latency_seconds",
            "Time between consecutive outputs of a request.",
            labels,
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "qiao:e2e_request_latency_seconds",
            "Arrival to finish.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "qiao:request_queue_time_seconds",
            "Arrival to first scheduled step.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        r.register(_EngineCollector(model_name, stats))
        self._last_token_time: dict[str, float] = {}

    def observe_outputs(self, outputs: Iterable[RequestOutput]) -> None:
        """Called on the event loop with every step's delta outputs."""
        name = self.model_name
        for output in outputs:
            m = output.metrics
            if m is None:
                continue
            num_new = sum(len(o.token_ids) for o in output.outputs)
            if num_new:
                self.generation_tokens.labels(name).inc(num_new)
                previous = self._last_token_time.get(output.request_id)
                if previous is None and m.first_token_time is not None:
                    self.ttft.labels(name).observe(m.first_token_time - m.arrival_time)
                elif previous is not None and m.last_token_time is not None:
                    self.itl.labels(name).observe(m.last_token_time - previous)
                if m.last_token_time is not None:
                    self._last_token_time[output.request_id] = m.last_token_time
            if output.finished:
                self._observe_finished(output)

    def _observe_finished(self, output: RequestOutput) -> None:
        name, m = self.model_name, output.metrics
        self._last_token_time.pop(output.request_id, None)
        self.prompt_tokens.labels(name).inc(len(output.prompt_token_ids))
        for sample in output.outputs:
            self.request_success.labels(name, sample.finish_reason or "unknown").inc()
        if m is not None and m.finished_time is not None:
            self.e2e.labels(name).observe(m.finished_time - m.arrival_time)
            if m.first_scheduled_time is not None:
                self.queue_time.labels(name).observe(m.first_scheduled_time - m.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Gauges and engine counters read from the engine's latest stats snapshot at scrape time."""

    def __init__(self, model_name: str, stats: Any) -> None:
        self.model_name = model_name
        self.stats = stats

    def collect(self) -> Iterable[Any]:
        s = self.stats()
        label = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        yield gauge(
            "qiao:num_requests_running", "Sequences in the running batch.", s["num_running"]
        )
        yield gauge("qiao:num_requests_waiting", "Sequences waiting to start.", s["num_waiting"])
        yield gauge(
            "qiao:kv_cache_usage_perc", "Share of KV blocks in use (0-1).", s["kv_cache_usage"]
        )
        yield counter("qiao:num_preemptions", "Preemptions (recompute).", s["num_preemptions"])
        yield counter(
            "qiao:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s["prefix_cache_queried_tokens"],
        )
        yield counter(
            "qiao:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            s["prefix_cache_hit_tokens"],
        )
        queried = s["prefix_cache_queried_tokens"]
        yield gauge(
            "qiao:prefix_cache_hit_rate",
            "Prefix-cache hit tokens / queried tokens.",
            s["prefix_cache_hit_tokens"] / queried if queried else 0.0,
        )
        yield counter("qiao:engine_steps", "Engine steps run.", s["num_steps"])
