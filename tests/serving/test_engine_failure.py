"""A failure inside the engine loop fails the requests in flight, never the server."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from .conftest import MODEL_NAME, PROMPT, InProcessServer, http_client


@pytest.fixture(scope="module")
def server(make_inprocess_server: Callable[..., InProcessServer]) -> InProcessServer:
    return make_inprocess_server()


@pytest.mark.logs_errors
@pytest.mark.parametrize("where", ["step", "add_request"])
def test_engine_failure_answers_503_and_the_loop_keeps_serving(
    server: InProcessServer, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    llm = server.engine.engine
    original = getattr(llm, where)
    calls = {"n": 0}

    def fail_once(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(llm, where, fail_once)
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    with http_client(server.base_url, timeout=30.0) as client:
        failed = client.post("/v1/completions", json=body)
        assert failed.status_code == 503
        assert "engine failed" in failed.json()["error"]["message"]
        assert "injected" not in failed.text  # the cause stays in the server log
        recovered = client.post("/v1/completions", json=body)
        assert recovered.status_code == 200
        assert client.get("/health/ready").status_code == 200
    server.wait_idle()
