"""`/metrics`: every documented series is exported, and the counts move by what was sent.

The server is shared with other modules, so the checks compare scrapes before and after.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest

from qiao.api.vllm_names import VLLM_NAMES

from .conftest import (
    MODEL_NAME,
    PROMPT,
    InProcessServer,
    MetricKey,
    SubprocessServer,
    http_client,
    parse_metrics,
)

EXPECTED_SERIES = [
    "qiao:time_to_first_token_seconds",
    "qiao:inter_token_latency_seconds",
    "qiao:e2e_request_latency_seconds",
    "qiao:request_queue_time_seconds",
    "qiao:prompt_tokens_total",
    "qiao:generation_tokens_total",
    "qiao:num_requests_running",
    "qiao:num_requests_waiting",
    "qiao:kv_cache_usage_perc",
    "qiao:prefix_cache_hit_rate",
    "qiao:num_preemptions_total",
    "qiao:request_success_total",
    "qiao:http_requests_total",
    "qiao:request_prompt_tokens",
    "qiao:request_generation_tokens",
    "qiao:request_params_max_tokens",
    "qiao:request_prefill_time_seconds",
    "qiao:request_decode_time_seconds",
    "qiao:iteration_tokens_total",
]
PROMPT_TOKENS = 5  # "Once upon a time" with BOS
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def client(qiao_server: SubprocessServer) -> Iterator[httpx.Client]:
    with http_client(qiao_server.base_url, timeout=60.0) as c:
        yield c


def _scrape(client: httpx.Client) -> dict[MetricKey, float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return parse_metrics(response.text)


def _delta(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def _completion(client: httpx.Client, **fields: object) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    return client.post("/v1/completions", json={**body, **fields})


def test_every_documented_series_is_exported(client: httpx.Client) -> None:
    assert _completion(client).status_code == 200
    text = client.get("/metrics").text
    for name in EXPECTED_SERIES:
        assert f"\n{name}" in text, f"{name} missing from /metrics"
    assert f'model_name="{MODEL_NAME}",version="1"' in text


def test_counts_follow_the_requests_sent(client: httpx.Client) -> None:
    before = _scrape(client)
    for _ in range(3):
        assert _completion(client).status_code == 200
    with client.stream("POST", "/v1/completions", json=_stream_body()) as response:
        assert response.status_code == 200
        assert response.read().endswith(b"data: [DONE]\n\n")
    chat = client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 3,
            "temperature": 0,
        },
    )
    assert chat.status_code == 200
    chat_usage = chat.json()["usage"]
    assert _completion(client, model="not-served").status_code == 404
    assert _completion(client, n=1000).status_code == 400
    after = _scrape(client)

    num_completions, chat_tokens = 4, chat_usage["completion_tokens"]
    finished = num_completions + 1
    delta = _make_delta(before, after)
    assert delta("qiao:request_success_total", finished_reason="length") == finished
    assert delta("qiao:prompt_tokens_total") == (
        num_completions * PROMPT_TOKENS + chat_usage["prompt_tokens"]
    )
    assert delta("qiao:generation_tokens_total") == num_completions * MAX_TOKENS + chat_tokens
    for histogram in (
        "qiao:time_to_first_token_seconds",
        "qiao:e2e_request_latency_seconds",
        "qiao:request_queue_time_seconds",
    ):
        assert delta(f"{histogram}_count") == finished, histogram
        assert delta(f"{histogram}_sum") > 0, histogram
    # One gap per token after the first.
    assert delta("qiao:inter_token_latency_seconds_count") == (
        num_completions * (MAX_TOKENS - 1) + chat_tokens - 1
    )
    route = "/v1/completions"
    assert delta("qiao:http_requests_total", route=route, status_code="200") == num_completions
    assert delta("qiao:http_requests_total", route=route, status_code="404") == 1
    assert delta("qiao:http_requests_total", route=route, status_code="400") == 1
    assert delta("qiao:http_requests_total", route="/v1/chat/completions", status_code="200") == 1

    # Idle now: nothing running or waiting, and no KV block held.
    assert after[("qiao:num_requests_running", ())] == 0
    assert after[("qiao:num_requests_waiting", ())] == 0
    assert after[("qiao:kv_cache_usage_perc", ())] == 0
    assert after[("qiao:num_preemptions_total", ())] == 0


def test_prefix_cache_hits_are_counted(client: httpx.Client) -> None:
    # 40 prompt tokens seen by nobody else: two full 16-token blocks can be reused.
    prompt = list(range(100, 140))
    before = _scrape(client)
    for _ in range(2):
        assert _completion(client, prompt=prompt, max_tokens=1).status_code == 200
    after = _scrape(client)
    delta = _make_delta(before, after)
    assert delta("qiao:prefix_cache_hits_total") == 32
    assert delta("qiao:prefix_cache_queries_total") >= 80
    assert 0 < after[("qiao:prefix_cache_hit_rate", ())] <= 1


def test_per_request_histograms_follow_the_requests_sent(client: httpx.Client) -> None:
    before = _scrape(client)
    num_completions, chat_max_tokens = _send_mix(client)
    after = _scrape(client)
    delta = _make_delta(before, after)

    chat_prompt = delta("qiao:prompt_tokens_total") - num_completions * PROMPT_TOKENS
    chat_tokens = delta("qiao:generation_tokens_total") - num_completions * MAX_TOKENS
    finished = num_completions + 1
    assert delta("qiao:request_prompt_tokens_count") == finished
    assert delta("qiao:request_prompt_tokens_sum") == num_completions * PROMPT_TOKENS + chat_prompt
    assert delta("qiao:request_generation_tokens_count") == finished
    assert delta("qiao:request_generation_tokens_sum") == (
        num_completions * MAX_TOKENS + chat_tokens
    )
    assert delta("qiao:request_params_max_tokens_count") == finished
    assert delta("qiao:request_params_max_tokens_sum") == (
        num_completions * MAX_TOKENS + chat_max_tokens
    )
    for histogram in ("qiao:request_prefill_time_seconds", "qiao:request_decode_time_seconds"):
        assert delta(f"{histogram}_count") == finished, histogram
        assert delta(f"{histogram}_sum") >= 0, histogram
    # The requests ran one after another: a prefill step and then one single-token decode step
    # per token after the first, for each of them.
    num_decode_steps = num_completions * (MAX_TOKENS - 1) + chat_tokens - 1
    num_steps = delta("qiao:iteration_tokens_total_count")
    assert num_decode_steps + finished <= num_steps <= delta("qiao:engine_steps_total")
    assert delta("qiao:iteration_tokens_total_bucket", le="1.0") >= num_decode_steps
    assert delta("qiao:iteration_tokens_total_sum") >= num_steps
    assert "vllm:" not in client.get("/metrics").text  # only with --metrics-vllm-names


def test_vllm_names_repeat_the_llm_series(
    make_inprocess_server: Callable[..., InProcessServer],
) -> None:
    server = make_inprocess_server(metrics_vllm_names=True)
    with http_client(server.base_url, timeout=60.0) as c:
        num_completions, chat_max_tokens = _send_mix(c, model=server.settings.model_name)
        server.wait_idle()
        text = c.get("/metrics").text
    metrics = parse_metrics(text)
    model_label = f'{{model_name="{server.settings.model_name}",version="1"}}'
    assert f"vllm:num_requests_running{model_label}" in text
    assert f"vllm:request_prompt_tokens_count{model_label}" in text
    assert metrics[("qiao:request_success_total", (("finished_reason", "length"),))] >= 4
    assert metrics[("vllm:request_params_max_tokens_sum", ())] == (
        num_completions * MAX_TOKENS + chat_max_tokens
    )
    # Every sample of every mapped family, under each of its vLLM names, with the same value.
    num_copied = 0
    for (name, labels), value in metrics.items():
        family = next((f for f in VLLM_NAMES if name.startswith(f)), None)
        if family is None or name[len(family) :].lstrip("_") not in _SUFFIXES:
            continue
        for vllm_name in VLLM_NAMES[family]:
            copy = (vllm_name + name[len(family) :], labels)
            assert metrics.get(copy) == value, copy
            num_copied += 1
    names = {name for name, _ in metrics}
    for family, vllm_names in VLLM_NAMES.items():
        if family.startswith("qiao:spec_decode_"):
            continue  # only with speculative decoding on: tests/serving/test_spec_serving.py
        assert any(n.startswith(family) for n in names), family
        assert all(any(n.startswith(v) for n in names) for v in vllm_names), family
    assert num_copied > len(VLLM_NAMES)
    assert not any(n.startswith("vllm:http_requests") for n in names)  # LLM series only


# What follows a family's name in its samples' names ("" for gauges).
_SUFFIXES = {"", "total", "created", "bucket", "count", "sum"}


def _send_mix(client: httpx.Client, model: str = MODEL_NAME) -> tuple[int, int]:
    """Three completions, a stream and a chat, one after another; returns (completions and
    streams sent, the chat's max_tokens)."""
    for _ in range(3):
        assert _completion(client, model=model).status_code == 200
    with client.stream("POST", "/v1/completions", json={**_stream_body(), "model": model}) as r:
        assert r.status_code == 200
        assert r.read().endswith(b"data: [DONE]\n\n")
    chat_max_tokens = 3
    chat = client.post(
        "/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": chat_max_tokens,
            "temperature": 0,
        },
    )
    assert chat.status_code == 200
    return 4, chat_max_tokens


def _stream_body() -> dict:
    return {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }


def _make_delta(before: dict, after: dict) -> Callable[..., float]:
    return lambda name, **labels: _delta(before, after, name, **labels)
