"""Defects found under pressure (issue 17), each reproduced against a real server: preemption of
a request already scheduled in the step, partial admission of a multi-sequence request, a request
timeout while a step hangs, an oversized version suffix, the default max_tokens on a small KV
pool, and an oversized header."""

from __future__ import annotations

import asyncio
import json
import socket
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


def test_a_timeout_is_answered_while_a_step_hangs(
    make_inprocess_server: Callable[..., InProcessServer],
) -> None:
    """The engine is held inside a step: a request with `timeout` still gets its 408 (and a
    stream its `finish_reason: "timeout"`) while the step has not returned."""
    server = make_inprocess_server()

    async def scenario() -> tuple[httpx.Response, list[dict], bool]:
        async with async_http_client(server.base_url, timeout=60.0) as client:
            server.gate.hold()
            plain = await client.post("/v1/completions", json=_greedy("Hello", 8, timeout=0.5))
            events = []
            chat = {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 8,
                "n": 2,
                "stream": True,
                "timeout": 0.5,
            }
            async with client.stream("POST", "/v1/chat/completions", json=chat) as stream:
                assert stream.status_code == 200
                async for line in stream.aiter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
            still_held = server.gate.held.is_set()
            server.gate.release()
            return plain, events, still_held

    try:
        plain, events, still_held = asyncio.run(scenario())
    finally:
        server.gate.reset()
    assert still_held, "the step was released before the answers came"
    assert plain.status_code == 408, plain.text
    assert plain.json()["error"]["code"] == "timeout"
    finishes = {
        c["index"]: c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]
    }
    assert finishes == {0: "timeout", 1: "timeout"}
    server.wait_idle()


def test_a_version_suffix_of_thousands_of_digits_is_a_400(small_client: httpx.Client) -> None:
    """`model@<5,000 digits>` passed Python's int-conversion limit: 500 and two tracebacks."""
    for suffix in ("1" * 5000, "0" * 4000 + "1" * 300, "9" * 19):
        response = small_client.post(
            "/v1/completions", json={"model": f"{MODEL_NAME}@{suffix}", "prompt": "Hi"}
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "model" and "at most 18 digits" in error["message"]
        assert len(error["message"]) < 200
    leading_zeros = small_client.post(
        "/v1/completions",
        json={"model": f"{MODEL_NAME}@{'0' * 5000}1", "prompt": "Hi", "max_tokens": 2},
    )
    assert leading_zeros.status_code == 200, leading_zeros.text
    unknown = small_client.post(
        "/v1/completions", json={"model": f"{MODEL_NAME}@{'7' * 18}", "prompt": "Hi"}
    )
    assert unknown.status_code == 404, unknown.text


def test_a_huge_content_length_is_refused_not_a_500(small_pool: InProcessServer) -> None:
    with socket.create_connection(("127.0.0.1", small_pool.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + b"9" * 5000 + b"\r\n\r\n{}"
        )
        reply = _read_all(sock)
    status = int(reply.split(b" ", 2)[1])
    assert status in (400, 413), reply[:300]


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_default_max_tokens_fits_the_kv_cache(
    small_pool: InProcessServer, small_client: httpx.Client
) -> None:
    """A chat request without max_tokens gets what one sequence can still hold: the KV pool here
    (8 blocks of 16 = 128 tokens), not the 512-token context, which the engine would refuse."""
    capacity = SMALL_POOL * 16
    assert small_pool.engine.max_sequence_tokens == capacity
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Hello"}],
        "temperature": 0,
        "ignore_eos": True,
    }
    response = small_client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == capacity
    assert response.json()["choices"][0]["finish_reason"] == "length"
    too_many = small_client.post("/v1/chat/completions", json={**body, "max_tokens": capacity})
    assert too_many.status_code == 400
    assert too_many.json()["error"]["param"] == "max_tokens"
    assert "KV cache" in too_many.json()["error"]["message"]


def test_an_oversized_header_is_a_431_in_the_error_envelope(small_pool: InProcessServer) -> None:
    with http_client(small_pool.base_url, timeout=30.0) as client:
        response = client.get("/v1/models", headers={"X-Padding": "a" * (1 << 20)})
    assert response.status_code == 431, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "headers" in error["message"]
    with http_client(small_pool.base_url, timeout=30.0) as client:
        assert client.get("/v1/models").status_code == 200  # the server is unaffected


def test_deadlines_of_finished_requests_do_not_pile_up(small_pool: InProcessServer) -> None:
    """Requests with a far deadline that finish early used to leave their deadline entries
    behind until it passed (`timeout: 1e9`: for ever)."""
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1, "timeout": 1e9}
    with http_client(small_pool.base_url, timeout=30.0) as client:
        for _ in range(150):
            assert client.post("/v1/completions", json=body).status_code == 200
    small_pool.wait_idle()
    assert len(small_pool.engine._deadlines) <= 64 + 1
