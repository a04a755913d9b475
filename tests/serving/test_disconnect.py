"""Clients that go away: every request they leave behind is aborted and its KV blocks freed."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import httpx
import pytest

from .conftest import (
    MODEL_NAME,
    PROMPT,
    InProcessServer,
    async_http_client,
    http_status_counts,
    parse_metrics,
)

NUM_STREAMS = 20
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def server(make_inprocess_server: Callable[..., InProcessServer]) -> InProcessServer:
    return make_inprocess_server()


def _server_errors(server: InProcessServer) -> float:
    """5xx responses the server counted (a client that left must not show up as a 500)."""
    counts = http_status_counts(parse_metrics(server.app.state.metrics.render().decode()))
    return sum(value for status, value in counts.items() if status.startswith("5"))


def _request(index: int, stream: bool) -> tuple[str, dict]:
    common = {"model": MODEL_NAME, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": stream}
    if index % 2:
        messages = [{"role": "user", "content": f"Story number {index}"}]
        return "/v1/chat/completions", {**common, "messages": messages}
    return "/v1/completions", {**common, "prompt": f"{PROMPT} {index}"}


async def _stream_then_leave(
    client: httpx.AsyncClient,
    index: int,
    num_events: int,
    admitted: asyncio.Event,
    released: asyncio.Event,
) -> int:
    """Open a stream, read `num_events` SSE events (0: none, only the headers), then close it.

    Returns how many events were read. The early leavers (0) go once every request is admitted,
    while the engine is still held: before any token. The others read once it is `released`.
    """
    url, body = _request(index, stream=True)
    read = 0
    async with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        await admitted.wait()
        if num_events == 0:
            return 0
        await released.wait()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                read += 1
                if read == num_events:
                    break
    return read


def test_abandoned_streams_and_requests_free_their_blocks(server: InProcessServer) -> None:
    rng = random.Random(20240611)
    # 0: gone after the headers, before any token; otherwise gone after that many events.
    plan = [rng.choice([0, 0, 1, 2, 3, 5, 8, 13]) for _ in range(NUM_STREAMS)]
    assert 0 in plan and max(plan) > 2
    server.wait_idle()
    generated_before = server.engine.stats()["num_generated_tokens_total"]
    errors_before = _server_errors(server)

    async def scenario() -> list[int]:
        admitted, released = asyncio.Event(), asyncio.Event()
        limits = httpx.Limits(max_connections=NUM_STREAMS + 1)
        async with async_http_client(server.base_url, limits=limits, timeout=30.0) as client:
            server.gate.hold()
            streams = [
                asyncio.ensure_future(_stream_then_leave(client, i, n, admitted, released))
                for i, n in enumerate(plan)
            ]
            url, body = _request(99, stream=False)
            non_streaming = asyncio.ensure_future(client.post(url, json=body))
            # Everything is admitted and the engine is held in its first step.
            await _until(lambda: server.engine.num_unfinished() == NUM_STREAMS + 1)
            await _until(server.gate.held.is_set)
            admitted.set()
            early = [t for t, n in zip(streams, plan, strict=True) if n == 0]
            await asyncio.wait_for(asyncio.gather(*early), 30.0)
            # The non-streaming client goes away too (cancelling closes its connection).
            non_streaming.cancel()
            await asyncio.gather(non_streaming, return_exceptions=True)
            server.gate.delay = 0.005  # slow enough that the others leave mid-stream
            server.gate.release()
            released.set()
            return await asyncio.wait_for(asyncio.gather(*streams), 60.0)

    try:
        read = asyncio.run(scenario())
    finally:
        server.gate.reset()
    assert read == plan
    server.wait_idle()
    assert server.num_free_kv_blocks() == server.num_kv_blocks
    # Nothing ran to the end: every request was aborted part-way.
    generated = server.engine.stats()["num_generated_tokens_total"] - generated_before
    assert generated < (NUM_STREAMS + 1) * MAX_TOKENS
    assert _server_errors(server) == errors_before


def test_non_streaming_client_gone_while_generating_aborts(server: InProcessServer) -> None:
    server.wait_idle()
    generated_before = server.engine.stats()["num_generated_tokens_total"]
    errors_before = _server_errors(server)
    server.gate.delay = 0.01

    async def scenario() -> None:
        async with async_http_client(server.base_url, timeout=30.0) as client:
            url, body = _request(0, stream=False)
            body["max_tokens"] = 400
            task = asyncio.ensure_future(client.post(url, json=body))
            await _until(
                lambda: server.engine.stats()["num_generated_tokens_total"] > generated_before
            )
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(scenario())
        server.wait_idle()
    finally:
        server.gate.reset()
    generated = server.engine.stats()["num_generated_tokens_total"] - generated_before
    assert 0 < generated < 400
    assert _server_errors(server) == errors_before


async def _until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "timed out waiting for the server"
        await asyncio.sleep(0.01)
