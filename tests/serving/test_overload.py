"""Overload: far more concurrent requests than the waiting queue holds. Every request is answered
(200, or 503 with Retry-After), none hangs, and the waiting queue never passes its limit."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import httpx

from .conftest import GREEDY_32, MODEL_NAME, PROMPT, InProcessServer, async_http_client

MAX_WAITING = 8
NUM_REQUESTS = 200
OVERALL_TIMEOUT_S = 120.0


async def _fire(server: InProcessServer) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=NUM_REQUESTS, max_keepalive_connections=NUM_REQUESTS)
    async with async_http_client(server.base_url, limits=limits, timeout=60.0) as client:
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        requests = [client.post("/v1/completions", json=body) for _ in range(NUM_REQUESTS)]
        return await asyncio.wait_for(asyncio.gather(*requests), OVERALL_TIMEOUT_S)


def _sample_in_background(read: Callable[[], int]) -> tuple[list[int], Callable[[], None]]:
    """Read `read()` every few ms in a thread until the returned stop function is called."""
    samples: list[int] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(0.002):
            samples.append(read())

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()

    def finish() -> None:
        stop.set()
        thread.join(5.0)

    return samples, finish


def test_overload_answers_every_request_and_bounds_the_queue(
    make_inprocess_server: Callable[..., InProcessServer],
) -> None:
    server = make_inprocess_server(max_waiting_requests=MAX_WAITING, max_num_seqs=4)
    # Slow steps: the batch (4 sequences) drains far slower than 200 requests arrive.
    server.gate.delay = 0.01
    samples, stop_sampling = _sample_in_background(lambda: server.engine.stats()["num_waiting"])
    try:
        responses = asyncio.run(_fire(server))
    finally:
        stop_sampling()
        max_num_waiting = server.gate.max_num_waiting
        server.gate.reset()

    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 503}, sorted(set(statuses))
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 503]
    assert ok, "no request was served"
    assert refused, "the queue limit never refused a request"
    for response in ok:
        assert GREEDY_32.startswith(response.json()["choices"][0]["text"])
    for response in refused:
        assert int(response.headers["Retry-After"]) >= 1
        assert response.json()["error"]["code"] == "queue_full"

    assert samples, "the waiting queue was never sampled"
    assert max(samples) <= MAX_WAITING
    # The gate sees the scheduler right after each step's admissions: the queue at its largest.
    assert 0 < max_num_waiting <= MAX_WAITING
    server.wait_idle()
