"""Per-request deadlines (`timeout` in the body): the request ends within about a step of its
deadline, whether it waits behind a batch or is generating, and its KV blocks are freed."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager

import httpx
import pytest

from .conftest import (
    GREEDY_32,
    MODEL_NAME,
    PROMPT,
    InProcessServer,
    async_http_client,
    http_client,
)

TIMEOUT_S = 0.5
STEP_DELAY_S = 0.05
# A deadline is checked between engine steps; allow a step plus slack for a loaded machine.
LATE_BY_AT_MOST_S = 1.5


@pytest.fixture(scope="module")
def server(make_inprocess_server: Callable[..., InProcessServer]) -> InProcessServer:
    # Two running sequences at most, so a third request waits behind them.
    return make_inprocess_server(max_num_seqs=2)


@pytest.fixture(autouse=True)
def _slow_engine(server: InProcessServer) -> Iterator[None]:
    server.gate.delay = STEP_DELAY_S
    yield
    server.gate.reset()


def _body(**fields: object) -> dict:
    return {"model": MODEL_NAME, "prompt": PROMPT, "temperature": 0, **fields}


async def _sse_events(response: httpx.Response) -> AsyncIterator[dict | str]:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else json.loads(data)


@asynccontextmanager
async def _busy_batch(client: httpx.AsyncClient) -> AsyncIterator[None]:
    """Two long streams fill the running batch until the block exits (then they are closed)."""
    running = [asyncio.Event(), asyncio.Event()]

    async def consume(started: asyncio.Event) -> None:
        body = _body(max_tokens=400, stream=True, ignore_eos=True)
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for _ in _sse_events(response):
                started.set()

    tasks = [asyncio.ensure_future(consume(event)) for event in running]
    try:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in running)), 30.0)
        yield
    finally:
        for task in tasks:
            task.cancel()  # closes the streams: the server aborts them
        await asyncio.gather(*tasks, return_exceptions=True)


async def _behind_batch(client: httpx.AsyncClient, body: dict) -> tuple[httpx.Response, float]:
    """POST `body` while the batch is full; the response and how long it took."""
    async with _busy_batch(client):
        started = time.monotonic()
        response = await client.post("/v1/completions", json=body)
        return response, time.monotonic() - started


def test_non_streaming_request_behind_a_batch_times_out_with_408(server: InProcessServer) -> None:
    async def scenario() -> tuple[httpx.Response, float]:
        async with async_http_client(server.base_url, timeout=30.0) as client:
            return await _behind_batch(client, _body(max_tokens=8, timeout=TIMEOUT_S))

    response, elapsed = asyncio.run(scenario())
    assert response.status_code == 408
    error = response.json()["error"]
    assert error["code"] == "timeout"
    assert error["type"] == "timeout_error"
    assert TIMEOUT_S <= elapsed <= TIMEOUT_S + LATE_BY_AT_MOST_S
    server.wait_idle()


def test_streaming_request_behind_a_batch_ends_with_finish_reason_timeout(
    server: InProcessServer,
) -> None:
    async def scenario() -> tuple[list[dict | str], float]:
        async with async_http_client(server.base_url, timeout=30.0) as client, _busy_batch(client):
            started = time.monotonic()
            body = _body(max_tokens=8, timeout=TIMEOUT_S, stream=True)
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                events = [e async for e in _sse_events(response)]
            return events, time.monotonic() - started

    events, elapsed = asyncio.run(scenario())
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "timeout"
    # It never left the waiting queue: no tokens.
    assert "".join(c["choices"][0]["text"] for c in chunks) == ""
    assert TIMEOUT_S <= elapsed <= TIMEOUT_S + LATE_BY_AT_MOST_S
    server.wait_idle()


def test_streaming_request_times_out_mid_generation_with_the_tokens_so_far(
    server: InProcessServer,
) -> None:
    async def scenario() -> tuple[list[dict | str], float]:
        async with async_http_client(server.base_url, timeout=30.0) as client:
            started = time.monotonic()
            body = _body(max_tokens=400, timeout=TIMEOUT_S, stream=True, ignore_eos=True)
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                events = [e async for e in _sse_events(response)]
            return events, time.monotonic() - started

    events, elapsed = asyncio.run(scenario())
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[-1] == "timeout"
    assert all(r is None for r in reasons[:-1])
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text, "no tokens were streamed before the deadline"
    assert GREEDY_32.startswith(text) or text.startswith(GREEDY_32)
    assert TIMEOUT_S <= elapsed <= TIMEOUT_S + LATE_BY_AT_MOST_S
    server.wait_idle()


def test_chat_request_times_out_with_408(server: InProcessServer) -> None:
    async def scenario() -> tuple[httpx.Response, float]:
        async with async_http_client(server.base_url, timeout=30.0) as client:
            started = time.monotonic()
            body = {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 400,
                "ignore_eos": True,
                "timeout": TIMEOUT_S,
            }
            response = await client.post("/v1/chat/completions", json=body)
            return response, time.monotonic() - started

    response, elapsed = asyncio.run(scenario())
    assert response.status_code == 408
    assert response.json()["error"]["code"] == "timeout"
    assert TIMEOUT_S <= elapsed <= TIMEOUT_S + LATE_BY_AT_MOST_S
    server.wait_idle()


@pytest.mark.parametrize("far", [b"1e308", b"Infinity"])
def test_a_far_deadline_does_not_stop_the_engine(server: InProcessServer, far: bytes) -> None:
    # Python's JSON parser reads both; the deadline then lies past any clock.
    raw = b'{"model": "%s", "prompt": "%s", "max_tokens": 2, "timeout": %s}' % (
        MODEL_NAME.encode(),
        PROMPT.encode(),
        far,
    )
    with http_client(server.base_url, timeout=30.0) as client:
        response = client.post(
            "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert response.status_code in (200, 400), response.text
        # The engine loop survived its idle wait on that deadline and still serves.
        ready = client.get("/health/ready")
        assert ready.status_code == 200, ready.text
        follow_up = client.post("/v1/completions", json=_body(max_tokens=2), timeout=10.0)
        assert follow_up.status_code == 200
    server.wait_idle()
