"""`/metrics`: every documented series is exported, and the counts move by what was sent.

The server is shared with other modules, so the checks compare scrapes before and after.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest

from .conftest import MODEL_NAME, PROMPT, MetricKey, SubprocessServer, http_client, parse_metrics

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
