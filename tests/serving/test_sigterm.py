"""SIGTERM under load: in-flight requests finish or end cleanly ("abort" / 503), new ones are
refused, and the process exits 0 within the drain timeout (plus a little)."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import httpx

from .conftest import (
    MODEL_NAME,
    PROMPT,
    SubprocessServer,
    async_http_client,
    parse_metrics,
)

DRAIN_TIMEOUT_S = 1.0
EXIT_GRACE_S = 5.0
NUM_STREAMING = 5
NUM_NON_STREAMING = 5
MAX_TOKENS = 500  # far more than the drain timeout lets finish


def _body(index: int, stream: bool) -> dict:
    return {
        "model": MODEL_NAME,
        "prompt": f"{PROMPT} {index}",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": stream,
    }


async def _stream(client: httpx.AsyncClient, index: int, first: asyncio.Event) -> list:
    """SSE events of one streaming request (parsed chunks and the final "[DONE]")."""
    events: list = []
    async with client.stream("POST", "/v1/completions", json=_body(index, True)) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
                first.set()
    return events


async def _in_flight(server: SubprocessServer) -> float:
    async with async_http_client(server.base_url, timeout=5.0) as client:
        metrics = parse_metrics((await client.get("/metrics")).text)
    return metrics[("qiao:num_requests_running", ())] + metrics[("qiao:num_requests_waiting", ())]


async def _refused_during_drain(client: httpx.AsyncClient) -> list[int | str]:
    """What new requests get while draining: 503, or no connection once the server stopped."""
    outcomes: list[int | str] = []
    try:
        ready = await client.get("/health/ready")
        outcomes.append(ready.status_code)
        response = await client.post("/v1/completions", json=_body(99, False))
        outcomes.append(response.status_code)
        assert response.headers.get("Retry-After")
    except httpx.TransportError:
        outcomes.append("connection refused")
    return outcomes


def test_sigterm_drains_in_flight_requests_and_exits_0(stories_dir: Path, tmp_path: Path) -> None:
    server = SubprocessServer(
        [
            "--model",
            str(stories_dir),
            "--log-interval",
            "0",
            "--drain-timeout",
            str(DRAIN_TIMEOUT_S),
            "--max-num-seqs",
            "2",  # most requests wait: at the drain timeout some are surely unfinished
        ],
        tmp_path / "server.log",
    ).wait_ready()

    async def scenario() -> tuple[list, list, list[int | str], float]:
        limits = httpx.Limits(max_connections=32)
        async with async_http_client(server.base_url, limits=limits, timeout=60.0) as client:
            firsts = [asyncio.Event() for _ in range(NUM_STREAMING)]
            streams = [
                asyncio.ensure_future(_stream(client, i, first)) for i, first in enumerate(firsts)
            ]
            posts = [
                asyncio.ensure_future(client.post("/v1/completions", json=_body(100 + i, False)))
                for i in range(NUM_NON_STREAMING)
            ]
            # Wait until all ten are inside the engine and a stream has its first token.
            deadline = time.monotonic() + 30.0
            while await _in_flight(server) < NUM_STREAMING + NUM_NON_STREAMING:
                assert time.monotonic() < deadline, "the requests never reached the engine"
                await asyncio.sleep(0.02)
            await asyncio.wait_for(asyncio.wait({asyncio.ensure_future(firsts[0].wait())}), 30.0)

            server.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            refused = await _refused_during_drain(client)
            stream_events = await asyncio.wait_for(asyncio.gather(*streams), 30.0)
            responses = await asyncio.wait_for(asyncio.gather(*posts, return_exceptions=True), 30.0)
            return stream_events, responses, refused, signalled

    try:
        stream_events, responses, refused, signalled = asyncio.run(scenario())
        exit_code = server.proc.wait(
            max(signalled + DRAIN_TIMEOUT_S + EXIT_GRACE_S - time.monotonic(), 0.1)
        )
    finally:
        stop_code = server.stop()
    assert exit_code == 0 == stop_code, server.log()[-2000:]

    reasons = []
    for events in stream_events:
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [e for e in events if isinstance(e, dict)]
        reasons.append(chunks[-1]["choices"][0]["finish_reason"])
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert set(reasons) <= {"length", "abort"}, reasons

    statuses = []
    for response in responses:
        assert isinstance(response, httpx.Response), repr(response)
        statuses.append(response.status_code)
        if response.status_code == 503:
            assert response.json()["error"]["code"] == "aborted"
            assert response.headers["Retry-After"]
        else:
            assert response.status_code == 200
            assert response.json()["choices"][0]["finish_reason"] == "length"
    # The drain timeout was far too short for 5000 tokens on two slots: some were cut off.
    assert "abort" in reasons or 503 in statuses

    assert refused and all(outcome in (503, "connection refused") for outcome in refused), refused
    log = server.log()
    assert "draining" in log
    assert "Traceback" not in log
