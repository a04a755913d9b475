"""Faults contained to the request that causes them: a forward that fails only with one request
in the batch is retried in halves, that request alone fails (500 request_failed, its prompt then
refused for a while) and the others finish exactly as without it; an out-of-memory error retries
the batch smaller and a request too large even alone fails alone with a 400."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import torch

from .conftest import MODEL_NAME, InProcessServer, async_http_client, parse_metrics, wait_until

MARK = 400  # a token-id prompt starting with this id makes the forward raise
PROMPTS = [
    "Once upon a time",
    "The little dog",
    "One day, a girl named",
    "Tom and his friend",
    "The sun was",
    "In the park,",
    "She liked to",
    "The big red ball",
    "Mom said",
    "A cat and a bird",
    "They went to the",
    "He was very",
    "The tree was tall",
    "Lily wanted to",
    "It was a sunny day",
    "The boy saw a",
]


def _body(prompt: Any, max_tokens: int = 24) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


@pytest.fixture(scope="module")
def server(make_inprocess_server: Callable[..., InProcessServer]) -> InProcessServer:
    return make_inprocess_server()


@pytest.fixture
def faulty(server: InProcessServer) -> Iterator[Callable[[Callable[[Any], None]], None]]:
    """faulty(check): run `check(scheduler_output)` before every forward (it may raise)."""
    runner = server.engine.engine.runner
    execute = runner.execute

    def install(check: Callable[[Any], None]) -> None:
        def checked(scheduler_output: Any) -> Any:
            check(scheduler_output)
            return execute(scheduler_output)

        runner.execute = checked

    yield install
    runner.execute = execute


async def _all_at_once(server: InProcessServer, bodies: list[dict]) -> list[httpx.Response]:
    """Send every body while the engine is held, so they share their first steps."""
    limits = httpx.Limits(max_connections=len(bodies) + 1)
    async with async_http_client(server.base_url, limits=limits, timeout=120.0) as client:
        server.gate.hold()
        try:
            tasks = [asyncio.ensure_future(client.post("/v1/completions", json=b)) for b in bodies]
            while server.engine.num_unfinished() < len(bodies):
                await asyncio.sleep(0.005)
        finally:
            server.gate.release()
        return await asyncio.gather(*tasks)


def _texts(responses: list[httpx.Response]) -> list[str]:
    for response in responses:
        assert response.status_code == 200, response.text
    return [r.json()["choices"][0]["text"] for r in responses]


@pytest.mark.logs_errors
def test_a_request_that_breaks_the_forward_fails_alone(
    server: InProcessServer, faulty: Callable[[Callable[[Any], None]], None]
) -> None:
    normal = [_body(p) for p in PROMPTS[:10]]
    expected = _texts(asyncio.run(_all_at_once(server, normal)))

    def raise_on_mark(scheduler_output: Any) -> None:
        if any(s.request.prompt_token_ids[0] == MARK for s in scheduler_output.scheduled):
            raise RuntimeError("kernel fault at /work/secret.cpp:42")

    faulty(raise_on_mark)
    marked = _body([MARK, 5, 6, 7, 8])
    responses = asyncio.run(_all_at_once(server, [*normal[:5], marked, *normal[5:]]))
    failed = responses.pop(5)
    assert failed.status_code == 500, failed.text
    error = failed.json()["error"]
    assert error["code"] == "request_failed" and "secret" not in error["message"]
    assert _texts(responses) == expected
    with httpx.Client(base_url=server.base_url, timeout=30.0) as client:
        again = client.post("/v1/completions", json=marked)
        assert again.status_code == 500 and "refused" in again.json()["error"]["message"]
        assert client.post("/v1/completions", json=normal[0]).status_code == 200
    server.wait_idle()


@pytest.mark.logs_errors
def test_out_of_memory_retries_smaller_and_a_request_too_large_fails_alone(
    server: InProcessServer, faulty: Callable[[Callable[[Any], None]], None]
) -> None:
    bodies = [_body(p, max_tokens=12) for p in PROMPTS]
    expected = _texts(asyncio.run(_all_at_once(server, bodies)))
    steps: list[int] = []

    def out_of_memory_over_8(scheduler_output: Any) -> None:
        steps.append(len(scheduler_output.scheduled))
        if len(scheduler_output.scheduled) > 8:
            raise torch.OutOfMemoryError("injected: 16 rows do not fit")
        if any(s.request.num_prompt_tokens > 100 for s in scheduler_output.scheduled):
            raise torch.OutOfMemoryError("injected: a long prompt does not fit")

    faulty(out_of_memory_over_8)
    long_prompt = _body([1] + [13] * 150, max_tokens=4)
    responses = asyncio.run(_all_at_once(server, [*bodies, long_prompt]))
    too_large = responses.pop()
    assert max(steps) > 8  # the batch was tried whole, then smaller
    # ... and later steps stay smaller (the cap), rather than failing and halving every time.
    assert sum(n > 8 for n in steps) <= 3, steps
    assert _texts(responses) == expected
    assert too_large.status_code == 400, too_large.text
    assert "memory" in too_large.json()["error"]["message"]
    server.wait_idle()


@pytest.mark.logs_errors
def test_repeated_failures_open_the_breaker_and_a_good_probe_closes_it(
    make_inprocess_server: Callable[..., InProcessServer],
) -> None:
    server = make_inprocess_server(breaker_failures=3, breaker_window=60, breaker_cooldown=1.0)
    runner = server.engine.engine.runner
    execute = runner.execute

    def raising(scheduler_output: Any) -> Any:
        if any(s.request.prompt_token_ids[0] == MARK for s in scheduler_output.scheduled):
            raise RuntimeError("injected fault")
        return execute(scheduler_output)

    runner.execute = raising
    try:
        with httpx.Client(base_url=server.base_url, timeout=30.0) as client:
            for i in range(3):  # distinct prompts: a failed one is refused without a run
                failed = client.post("/v1/completions", json=_body([MARK, 5 + i]))
                assert failed.json()["error"]["code"] == "request_failed"
            assert client.get("/health/ready").json()["circuit_breakers"] == {
                f"{MODEL_NAME}@1": "open"
            }
            server.gate.hold()  # refused without queueing: the held engine never sees it
            refused = client.post("/v1/completions", json=_body(PROMPTS[0]))
            assert not server.gate.held.is_set() and server.engine.num_unfinished() == 0
            server.gate.release()
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "circuit_open"
            assert int(refused.headers["Retry-After"]) >= 1
            wait_until(
                lambda: (
                    client.get("/health/ready").json()["circuit_breakers"][f"{MODEL_NAME}@1"]
                    == "half-open"
                ),
                10,
                "the breaker to half-open",
            )
            probe = client.post("/v1/completions", json=_body(PROMPTS[1]))
            assert probe.status_code == 200, probe.text
            assert client.get("/health/ready").json()["circuit_breakers"] == {
                f"{MODEL_NAME}@1": "closed"
            }
            assert client.post("/v1/completions", json=_body(PROMPTS[2])).status_code == 200
            metrics = parse_metrics(client.get("/metrics").text)
            assert metrics[("qiao:circuit_breaker_opened_total", ())] == 1
            assert metrics[("qiao:circuit_breaker_state", ())] == 0
    finally:
        runner.execute = execute
        server.gate.reset()
