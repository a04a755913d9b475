"""Prometheus metrics, named as operators already chart them (vLLM's names, `qiao:` prefix).

The engine produces plain data (per-request timings in `RequestOutput.metrics`, a stats dict per
step; a `BatchStats` per encoder batch); this module only exports it. Every model series carries
`model_name` and `version` labels, so canary and stable versions chart side by side. Each app
has its own registry, so several servers in one process (tests) never share counters. With
`vllm_names` the LLM series are exported a second time under vLLM's own `vllm:` names
(`vllm_names.py`), so a stock vLLM dashboard charts qiao unchanged.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from qiao.api.gpu_metrics import GpuCollector
from qiao.api.vllm_names import WithVllmNames
from qiao.engine.batcher import BatchStats
from qiao.engine.llm_engine import ITERATION_TOKEN_BUCKETS
from qiao.outputs import RequestOutput
from qiao.repository.cache import CacheUsageCollector

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
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
QUEUE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
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

# Token counts per request (prompt, generated, max_tokens): 1-2-5 steps up to a million.
# E.g. 1, 2, 5, 10, 20, 50, ..., 500000, 1000000.
TOKEN_COUNT_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5)) + (1_000_000,)


class ServerMetrics:
    def __init__(self, llm_versions: Callable[[], list[Any]], *, vllm_names: bool = False) -> None:
        """`llm_versions()` lists the served LLM versions (`.model`, `.version`, `.engine`)
        whose engine stats are exported at scrape time. `vllm_names`: export the LLM series
        under their `vllm:` names too."""
        self.vllm_names = vllm_names
        self.registry = CollectorRegistry()
        labels = ["model_name", "version"]
        r = self.registry
        # process_resident_memory_bytes and friends of the API process (Linux).
        ProcessCollector(registry=r)
        self.key_requests = Counter(
            "qiao:api_key_requests",
            "Requests of named API keys by outcome (admitted, limited_requests, limited_tokens, "
            "limited_concurrency, model_not_allowed); the key itself is never a label.",
            ["key_name", "outcome"],
            registry=r,
        )
        self.key_tokens = Counter(
            "qiao:api_key_tokens",
            "Prompt + completion tokens charged to named API keys.",
            ["key_name"],
            registry=r,
        )
        self.http_requests = Counter(
            "qiao:http_requests",
            "HTTP requests by route and status code.",
            ["route", "status_code"],
            registry=r,
        )
        self.request_success = Counter(
            "qiao:request_success",
            "Finished requests by finish reason.",
            [*labels, "finished_reason"],
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
        self.prefill_time = Histogram(
            "qiao:request_prefill_time_seconds",
            "First scheduled step to first generated token.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_time = Histogram(
            "qiao:request_decode_time_seconds",
            "First generated token to finish.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_prompt_tokens = Histogram(
            "qiao:request_prompt_tokens",
            "Prompt tokens per finished request.",
            labels,
            buckets=TOKEN_COUNT_BUCKETS,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            "qiao:request_generation_tokens",
            "Generated tokens per finished request (all its samples).",
            labels,
            buckets=TOKEN_COUNT_BUCKETS,
            registry=r,
        )
        self.request_max_tokens = Histogram(
            "qiao:request_params_max_tokens",
            "The max_tokens of finished requests.",
            labels,
            buckets=TOKEN_COUNT_BUCKETS,
            registry=r,
        )
        # Encoders behind the dynamic batcher.
        self.infer_requests = Counter(
            "qiao:infer_requests",
            "Requests run by a batched (non-generative) model.",
            labels,
            registry=r,
        )
        self.batch_size = Histogram(
            "qiao:batch_size",
            "Rows per batch run by a batched model.",
            labels,
            buckets=BATCH_SIZE_BUCKETS,
            registry=r,
        )
        self.batch_queue_time = Histogram(
            "qiao:batch_queue_time_seconds",
            "Time a request waited in the batcher queue.",
            labels,
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.batch_exec_time = Histogram(
            "qiao:batch_execution_time_seconds",
            "Model time of one batch.",
            labels,
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        # The Batch API (/v1/batches): lines by outcome, their generated tokens, jobs by status.
        self.batch_lines = Counter(
            "qiao:batch_lines",
            "Batch lines recorded, by outcome (answered or failed).",
            ["outcome"],
            registry=r,
        )
        self.batch_generation_tokens = Counter(
            "qiao:batch_generation_tokens", "Tokens generated for batch lines.", registry=r
        )
        # Set by the batch worker: batches per status, read at scrape time.
        self.batch_jobs: Callable[[], dict[str, int]] = dict
        r.register(_BatchJobsCollector(lambda: self.batch_jobs()))
        # Set by a remote model repository: its local cache's disk usage, read at scrape time.
        self.repository_cache_root: Path | None = None
        r.register(CacheUsageCollector(lambda: self.repository_cache_root))
        # The latest batch observer of each encoder version (model, version).
        self._batch_observers: dict[tuple[str, str], BatchObserver] = {}
        r.register(_EngineCollector(llm_versions, self._encoder_stats))
        # GPU utilisation and memory from NVML; nothing on a machine without one.
        r.register(GpuCollector())
        self._last_token_time: dict[str, float] = {}

    def batch_observer(self, model: str, version: str) -> BatchObserver:
        """An `on_batch` callback for one encoder version's batcher."""
        observer = BatchObserver(self, model, version)
        self._batch_observers[(model, version)] = observer
        return observer

    def _encoder_stats(self) -> list[tuple[str, str, dict[str, Any]]]:
        return [
            (model, version, {**observer.engine(), **observer.adaptive})
            for (model, version), observer in list(self._batch_observers.items())
            if observer.engine is not None
        ]

    def output_observer(
        self, model: str, version: str
    ) -> Callable[[Iterable[RequestOutput]], None]:
        """An output listener for one LLM version's engine."""
        return lambda outputs: self.observe_outputs(model, version, outputs)

    def observe_outputs(self, model: str, version: str, outputs: Iterable[RequestOutput]) -> None:
        """Called on the event loop with every step's delta outputs."""
        for output in outputs:
            m = output.metrics
            if m is None:
                continue
            num_new = sum(len(o.token_ids) for o in output.outputs)
            if num_new:
                self.generation_tokens.labels(model, version).inc(num_new)
                previous = self._last_token_time.get(output.request_id)
                if previous is None and m.first_token_time is not None:
                    self.ttft.labels(model, version).observe(m.first_token_time - m.arrival_time)
                elif previous is not None and m.last_token_time is not None:
                    self.itl.labels(model, version).observe(m.last_token_time - previous)
                if m.last_token_time is not None:
                    self._last_token_time[output.request_id] = m.last_token_time
            if output.finished:
                self._observe_finished(model, version, output)

    def _observe_finished(self, model: str, version: str, output: RequestOutput) -> None:
        m = output.metrics
        self._last_token_time.pop(output.request_id, None)
        num_prompt = len(output.prompt_token_ids)
        self.prompt_tokens.labels(model, version).inc(num_prompt)
        self.request_prompt_tokens.labels(model, version).observe(num_prompt)
        for sample in output.outputs:
            self.request_success.labels(model, version, sample.finish_reason or "unknown").inc()
        if m is None:
            return
        self.request_generation_tokens.labels(model, version).observe(m.num_generation_tokens)
        if m.max_tokens is not None:
            self.request_max_tokens.labels(model, version).observe(m.max_tokens)
        if m.first_token_time is not None and m.first_scheduled_time is not None:
            self.prefill_time.labels(model, version).observe(
                m.first_token_time - m.first_scheduled_time
            )
        if m.finished_time is None:
            return
        self.e2e.labels(model, version).observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.labels(model, version).observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is not None:
            self.decode_time.labels(model, version).observe(m.finished_time - m.first_token_time)

    def render(self) -> bytes:
        if self.vllm_names:
            return generate_latest(WithVllmNames(self.registry))  # type: ignore[arg-type]
        return generate_latest(self.registry)


class BatchObserver:
    """The `on_batch` callback of one encoder version's batcher: batch sizes, queue and execution
    times. The version hands it its engine figures too (`watch_engine`: up, restarts, breaker),
    exported at scrape time under the names an LLM version's have."""

    def __init__(self, metrics: ServerMetrics, model: str, version: str) -> None:
        self._size = metrics.batch_size.labels(model, version)
        self._requests = metrics.infer_requests.labels(model, version)
        self._queue = metrics.batch_queue_time.labels(model, version)
        self._exec_time = metrics.batch_exec_time.labels(model, version)
        self.engine: Callable[[], dict[str, Any]] | None = None
        self.adaptive: dict[str, float] = {}  # adaptive batching's latest choice (if on)

    def __call__(self, stats: BatchStats) -> None:
        if stats.queue_delay_s is not None and stats.p99_latency_s is not None:
            self.adaptive = {
                "adaptive_queue_delay_seconds": stats.queue_delay_s,
                "adaptive_p99_latency_seconds": stats.p99_latency_s,
            }
        self._size.observe(stats.rows)
        self._requests.inc(stats.requests)
        for waited in stats.queue_times_s:
            self._queue.observe(waited)
        self._exec_time.observe(stats.exec_time_s)

    def watch_engine(self, stats: Callable[[], dict[str, Any]] | None) -> None:
        """Export `stats()` from now on (None: no longer; the version stopped)."""
        self.engine = stats


class _BatchJobsCollector(Collector):
    """`qiao:batch_jobs{status}`: batches in each of OpenAI's states, 0 included."""

    STATUSES = (
        "validating",
        "in_progress",
        "finalizing",
        "completed",
        "failed",
        "expired",
        "cancelling",
        "cancelled",
    )

    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self.counts = counts

    def collect(self) -> Iterable[Any]:
        counts = self.counts()
        family = GaugeMetricFamily("qiao:batch_jobs", "Batches by status.", labels=["status"])
        for status in self.STATUSES:
            family.add_metric([status], counts.get(status, 0))
        yield family


class _EngineCollector(Collector):
    """Gauges and engine counters read from each version's latest stats at scrape time: every
    LLM version's, and the supervision figures of each encoder version."""

    def __init__(
        self,
        llm_versions: Callable[[], list[Any]],
        encoder_stats: Callable[[], list[tuple[str, str, dict[str, Any]]]],
    ) -> None:
        self.llm_versions = llm_versions
        self.encoder_stats = encoder_stats

    def collect(self) -> Iterable[Any]:
        names = ["model_name", "version"]
        families: dict[str, Any] = {}

        def add(kind: type, name: str, doc: str, label: list[str], value: float) -> None:
            if name not in families:
                families[name] = kind(name, doc, labels=names)
            families[name].add_metric(label, value)

        G, C = GaugeMetricFamily, CounterMetricFamily
        for served in self.llm_versions():
            s = served.engine.stats()
            label = [served.model, served.version]
            add(
                G,
                "qiao:num_requests_running",
                "Sequences in the running batch.",
                label,
                s["num_running"],
            )
            add(
                G,
                "qiao:num_requests_waiting",
                "Sequences waiting to start.",
                label,
                s["num_waiting"],
            )
            add(
                G,
                "qiao:kv_cache_usage_perc",
                "Share of KV blocks in use (0-1).",
                label,
                s["kv_cache_usage"],
            )
            add(C, "qiao:num_preemptions", "Preemptions (recompute).", label, s["num_preemptions"])
            add(
                C,
                "qiao:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                label,
                s["prefix_cache_queried_tokens"],
            )
            add(
                C,
                "qiao:prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                label,
                s["prefix_cache_hit_tokens"],
            )
            queried = s["prefix_cache_queried_tokens"]
            add(
                G,
                "qiao:prefix_cache_hit_rate",
                "Prefix-cache hit tokens / queried tokens.",
                label,
                s["prefix_cache_hit_tokens"] / queried if queried else 0.0,
            )
            add(C, "qiao:engine_steps", "Engine steps run.", label, s["num_steps"])
            if "iteration_token_counts" in s:
                name = "qiao:iteration_tokens_total"
                if name not in families:
                    doc = "Tokens per engine step (prompt chunks and decode rows)."
                    families[name] = HistogramMetricFamily(name, doc, labels=names)
                families[name].add_metric(
                    label,
                    _cumulative_buckets(s["iteration_token_counts"]),
                    s["num_computed_tokens_total"],
                )
            _add_supervision(add, label, s)
            _add_spec_decode(add, label, s)
            _add_adaptive(add, label, s)
            _add_replicas(families, names, label, s.get("replicas", []))
        for model, version, s in self.encoder_stats():
            _add_supervision(add, [model, version], s)
            _add_adaptive(add, [model, version], s)
        yield from families.values()


_REPLICA_SERIES = (
    (GaugeMetricFamily, "qiao:replica_up", "Whether the data-parallel replica is ready.", "up"),
    (
        GaugeMetricFamily,
        "qiao:replica_requests_unfinished",
        "Requests the replica holds now.",
        "num_unfinished",
    ),
    (
        CounterMetricFamily,
        "qiao:replica_requests_routed",
        "API requests routed to the replica.",
        "routed",
    ),
    (
        CounterMetricFamily,
        "qiao:replica_requests_routed_by_affinity",
        "API requests routed to the replica by prefix affinity.",
        "routed_by_affinity",
    ),
    (
        CounterMetricFamily,
        "qiao:replica_engine_restarts",
        "Restarts of the replica's engine process.",
        "engine_restarts",
    ),
)


def _add_replicas(
    families: dict[str, Any], names: list[str], label: list[str], replicas: list[dict[str, Any]]
) -> None:
    """Per-replica series of a data-parallel version (`--data-parallel-size`)."""
    for kind, name, doc, key in _REPLICA_SERIES if replicas else ():
        if name not in families:
            families[name] = kind(name, doc, labels=[*names, "replica"])
        for i, replica in enumerate(replicas):
            families[name].add_metric([*label, str(i)], replica[key])


def _cumulative_buckets(counts: list[int]) -> list[tuple[str, float]]:
    """Steps per ITERATION_TOKEN_BUCKETS bucket -> Prometheus (le, steps <= le) pairs.
    E.g. [2, 0, 1, ...] -> [("1", 2), ("8", 2), ("16", 3), ...]."""
    bounds = [*(floatToGoString(b) for b in ITERATION_TOKEN_BUCKETS), "+Inf"]
    return list(zip(bounds, itertools.accumulate(counts), strict=True))


def _add_adaptive(add: Callable[..., None], label: list[str], s: dict[str, Any]) -> None:
    """Adaptive batching's current choice and the smoothed measurement it holds at target
    (qiao/engine/adaptive.py), when a target is set."""
    G = GaugeMetricFamily
    for key, doc in (
        ("adaptive_token_budget", "Step token budget adaptive batching chose."),
        ("adaptive_step_time_seconds", "Smoothed decode step time adaptive batching holds."),
        ("adaptive_queue_delay_seconds", "Encoder batch queue delay adaptive batching chose."),
        ("adaptive_p99_latency_seconds", "Encoder request p99 latency adaptive batching holds."),
    ):
        if key in s:
            add(G, f"qiao:{key}", doc, label, s[key])


def _add_spec_decode(add: Callable[..., None], label: list[str], s: dict[str, Any]) -> None:
    """Speculative decoding's counters (vLLM's `spec_decode_*`), when the engine speculates:
    acceptance rate = accepted / draft tokens; tokens per verifying step = 1 + accepted / drafts."""
    if "spec_decode_num_drafts" not in s:
        return
    C = CounterMetricFamily
    for key, doc in (
        ("num_drafts", "Request steps that verified draft tokens."),
        ("num_draft_tokens", "Draft tokens proposed and verified."),
        ("num_accepted_tokens", "Draft tokens accepted (equal to the target's own)."),
    ):
        add(C, f"qiao:spec_decode_{key}", doc, label, s[f"spec_decode_{key}"])


def _add_supervision(add: Callable[..., None], label: list[str], s: dict[str, Any]) -> None:
    """The series every version has: its engine process (up, restarts, memory) and its breaker."""
    G, C = GaugeMetricFamily, CounterMetricFamily
    add(
        G,
        "qiao:engine_up",
        "1 while the engine runs, 0 while it restarts.",
        label,
        s.get("engine_up", 1),
    )
    if "resident_bytes" in s:
        add(
            G,
            "qiao:engine_resident_memory_bytes",
            "Resident memory of the version's engine process.",
            label,
            s["resident_bytes"],
        )
    add(
        G,
        "qiao:circuit_breaker_state",
        "The version's circuit breaker: 0 closed, 1 open, 2 half-open.",
        label,
        s.get("breaker_state", 0),
    )
    add(
        C,
        "qiao:circuit_breaker_opened",
        "Times the version's circuit breaker opened.",
        label,
        s.get("breaker_opened", 0),
    )
    add(
        C,
        "qiao:engine_restarts",
        "Engine process restarts (exits, kills, stalls).",
        label,
        s.get("engine_restarts", 0),
    )
