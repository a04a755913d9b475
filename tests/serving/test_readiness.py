"""Readiness follows the engine loop: a loop stalled with work queued fails `/health/ready`
(liveness stays up), and it recovers when the loop moves again."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import pytest

from .conftest import MODEL_NAME, PROMPT, InProcessServer, http_client, wait_until

STALL_TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def server(make_inprocess_server: Callable[..., InProcessServer]) -> InProcessServer:
    return make_inprocess_server(stall_timeout=STALL_TIMEOUT_S)


def test_idle_engine_is_ready_however_long_it_idles(server: InProcessServer) -> None:
    with http_client(server.base_url, timeout=10.0) as client:
        # Idling past the stall timeout must not count as a stall: there is no work to do.
        time.sleep(STALL_TIMEOUT_S * 2)
        assert client.get("/health/ready").status_code == 200
        assert client.get("/health/live").status_code == 200


def test_stalled_engine_fails_readiness_until_released(server: InProcessServer) -> None:
    result: list[httpx.Response] = []
    with http_client(server.base_url, timeout=30.0) as client:
        server.gate.hold()
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        sender = threading.Thread(
            target=lambda: result.append(client.post("/v1/completions", json=body)), daemon=True
        )
        try:
            sender.start()
            assert server.gate.held.wait(10.0), "the engine never started a step"
            probes: list[tuple[int, int]] = []

            def stalled() -> bool:
                probes.append(
                    (
                        client.get("/health/live").status_code,
                        client.get("/health/ready").status_code,
                    )
                )
                return probes[-1][1] == 503

            wait_until(stalled, 10.0, "/health/ready to report the stall")
            response = client.get("/health/ready")
            assert response.status_code == 503
            assert "stalled" in response.json()["error"]["message"]
            assert all(live == 200 for live, _ in probes)
        finally:
            server.gate.release()
        wait_until(
            lambda: client.get("/health/ready").status_code == 200, 10.0, "readiness to recover"
        )
        assert client.get("/health/live").status_code == 200
        sender.join(30.0)
    assert [r.status_code for r in result] == [200]
    server.wait_idle()
