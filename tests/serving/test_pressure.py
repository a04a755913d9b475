"""Defects found under pressure (issue 17), each reproduced against a real server: preemption of
a request already scheduled in the step, partial admission of a multi-sequence request, a request
timeout while a step hangs, an oversized version suffix, the default max_tokens on a small KV
pool, and an oversized header."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator

import httpx
import pytest

from .conftest import MODEL_NAME, InProcessServer, async_http_client, http_client

SMALL_POOL = 8  # KV blocks of 16 tokens: one 103-token sequence needs 7 of them


@pytest.fixture(scope="module")
def small_pool(make_inprocess_server: Callable[..., InProcessServer]) -> InProcessServer:
    return make_inprocess_server(num_kv_blocks=SMALL_POOL)


@pytest.fixture(scope="module")
def small_client(small_pool: InProcessServer) -> Iterator[httpx.Client]:
    with http_client(small_pool.base_url, timeout=120.0) as client:
        yield client


def _greedy(prompt: str, max_tokens: int, **fields: object) -> dict:
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **fields,
    }


async def _n8_beside_a_stream(base_url: str) -> tuple[httpx.Response, str, str | None]:
    async with async_http_client(base_url, timeout=120.0) as client:
        many = asyncio.ensure_future(
            client.post("/v1/completions", json=_greedy("Hello", 100, n=8))
        )
        text, finish = "", None
        body = _greedy("Once upon a time", 60, stream=True)
        async with client.stream("POST", "/v1/completions", json=body) as stream:
            assert stream.status_code == 200
            async for line in stream.aiter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    finish = choice["finish_reason"] or finish
        return await many, text, finish


def test_preemption_of_scheduled_requests_keeps_every_sequence_exact(
    small_pool: InProcessServer, small_client: httpx.Client
) -> None:
    """n=8 sequences that each need most of the pool, beside a stream: requests are preempted
    after being scheduled in the same step, over and over. Every sequence still ends with the
    tokens it generates alone, and the stream is not cut."""
    alone = small_client.post("/v1/completions", json=_greedy("Hello", 100))
    assert alone.status_code == 200, alone.text
    alone_stream = small_client.post("/v1/completions", json=_greedy("Once upon a time", 60))
    assert alone_stream.status_code == 200, alone_stream.text
    preemptions_before = small_pool.engine.stats()["num_preemptions"]

    response, streamed, finish = asyncio.run(_n8_beside_a_stream(small_pool.base_url))

    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 8
    expected = alone.json()["choices"][0]["text"]
    for choice in choices:
        assert choice["text"] == expected
        assert choice["finish_reason"] == "length"
    assert streamed == alone_stream.json()["choices"][0]["text"]
    assert finish == "length"
    assert small_pool.engine.stats()["num_preemptions"] > preemptions_before
    small_pool.wait_idle()


def test_a_request_is_admitted_whole_or_not_at_all(
    make_inprocess_server: Callable[..., InProcessServer],
) -> None:
    """With the engine held and 3 of 4 waiting places taken, a request with two prompts gets 503
    and leaves nothing behind (it used to leave its first prompt counted in flight, and SIGTERM
    waited the whole drain timeout for it); one that could never fit gets 400 at once."""
    server = make_inprocess_server(max_waiting_requests=4)

    async def scenario() -> tuple[httpx.Response, httpx.Response, httpx.Response, int]:
        async with async_http_client(server.base_url, timeout=60.0) as client:
            server.gate.hold()
            first = asyncio.ensure_future(
                client.post("/v1/completions", json=_greedy("Hello", 4, n=3))
            )
            while server.engine.num_unfinished() == 0:
                await asyncio.sleep(0.005)
            two = {"model": MODEL_NAME, "prompt": ["Hello", "Once"], "max_tokens": 4}
            refused = await client.post("/v1/completions", json=two)
            never = await client.post("/v1/completions", json=_greedy("Hello", 4, n=5))
            in_flight = server.engine.num_unfinished()
            server.gate.release()
            return await first, refused, never, in_flight

    try:
        first, refused, never, in_flight = asyncio.run(scenario())
    finally:
        server.gate.reset()
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "queue_full"
    assert refused.headers["Retry-After"]
    assert in_flight == 1, "a refused request left engine requests behind"
    assert never.status_code == 400, never.text
    error = never.json()["error"]
    assert error["param"] == "n" and "at most 4" in error["message"]
    assert first.status_code == 200, first.text
    assert len(first.json()["choices"]) == 3
    server.wait_idle()
