"""qiao's LLM series under vLLM's own names, so a stock vLLM dashboard charts qiao unchanged.

`WithVllmNames(registry)` scrapes like the registry, each mapped family followed by its copies:
`qiao:time_to_first_token_seconds` then `vllm:time_to_first_token_seconds`, same samples, same
labels (`model_name`, `version`). Series of qiao's own (HTTP, keys, breaker, encoders) have none.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

# qiao family -> its vLLM names (the second ones: older names that dashboards still chart).
VLLM_NAMES = {
    "qiao:num_requests_running": ("vllm:num_requests_running",),
    "qiao:num_requests_waiting": ("vllm:num_requests_waiting",),
    "qiao:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "qiao:num_preemptions": ("vllm:num_preemptions",),
    "qiao:prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "qiao:prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "qiao:request_success": ("vllm:request_success",),
    "qiao:prompt_tokens": ("vllm:prompt_tokens",),
    "qiao:generation_tokens": ("vllm:generation_tokens",),
    "qiao:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "qiao:inter_token_latency_seconds": (
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
    ),
    "qiao:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "qiao:request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "qiao:request_prefill_time_seconds": ("vllm:request_prefill_time_seconds",),
    "qiao:request_decode_time_seconds": ("vllm:request_decode_time_seconds",),
    "qiao:request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "qiao:request_generation_tokens": ("vllm:request_generation_tokens",),
    "qiao:request_params_max_tokens": ("vllm:request_params_max_tokens",),
    "qiao:iteration_tokens_total": ("vllm:iteration_tokens_total",),
    "qiao:spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "qiao:spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "qiao:spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
}


class WithVllmNames:
    """The registry's families, each LLM one followed by its copies under `VLLM_NAMES`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        for family in self.registry.collect():
            yield family
            for name in VLLM_NAMES.get(family.name, ()):
                yield _renamed(family, name)


def _renamed(family: Metric, name: str) -> Metric:
    """`family` under `name`; its samples keep their suffixes (`_total`, `_bucket`, ...)."""
    copy = Metric(name, family.documentation, family.type, family.unit)
    copy.samples = [s._replace(name=name + s.name[len(family.name) :]) for s in family.samples]
    return copy
