"""The health, version and request-id conventions other servers' users expect: `/health`,
`/ping`, `/version`, `GET /v1/models/{id}` (through the official openai client) and
`X-Request-Id` on every answer and in the access log."""

from __future__ import annotations

import logging
from collections.abc import Callable

import httpx
import openai
import pytest

from qiao.version import __version__

from .conftest import MODEL_NAME, InProcessServer, openai_client, wait_until

KEY = "sk-conventions-0123456789"


@pytest.fixture(scope="module")
def server(make_inprocess_server: Callable[..., InProcessServer]) -> InProcessServer:
    return make_inprocess_server()


def test_health_ping_and_version(server: InProcessServer) -> None:
    with httpx.Client(base_url=server.base_url) as client:
        for path in ("/health", "/ping"):
            response = client.get(path)
            assert response.status_code == 200, path
            assert response.json()["status"] == "ok"
        assert client.get("/version").json() == {"version": __version__}
        server.app.state.draining = True
        try:
            for path in ("/health", "/ping"):
                response = client.get(path)
                assert response.status_code == 503
                assert response.json()["error"]["message"] == "draining"
        finally:
            server.app.state.draining = False


def test_models_retrieve_with_the_openai_client(server: InProcessServer) -> None:
    with openai_client(server.base_url) as client:
        model = client.models.retrieve(MODEL_NAME)
        assert model.id == MODEL_NAME and model.object == "model"
        assert client.models.retrieve(f"{MODEL_NAME}@1").id == f"{MODEL_NAME}@1"
        for unknown in ("no-such-model", f"{MODEL_NAME}@7"):
            with pytest.raises(openai.NotFoundError) as caught:
                client.models.retrieve(unknown)
            error = caught.value.body
            assert isinstance(error, dict) and error["code"] == "model_not_found"
            assert unknown in error["message"]


def test_request_id_is_echoed_or_made_and_logged(
    server: InProcessServer, caplog: pytest.LogCaptureFixture
) -> None:
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 2}
    with httpx.Client(base_url=server.base_url) as client, caplog.at_level(logging.INFO):
        given = client.post("/v1/completions", json=body, headers={"X-Request-Id": "trace-42"})
        made = client.post("/v1/completions", json=body)
        spaced = client.get("/v1/models", headers={"X-Request-Id": "has space"})
        too_long = client.get("/v1/models", headers={"X-Request-Id": "x" * 129})
        error = client.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
        # The access line is written once the answer is sent: the last may still be on its way.
        wait_until(
            lambda: any(
                r.name == "qiao.access" and error.headers["x-request-id"] in r.getMessage()
                for r in caplog.records
            ),
            10.0,
            "the access line of the last request",
        )
    assert given.status_code == 200 and given.headers["x-request-id"] == "trace-42"
    generated = made.headers["x-request-id"]
    assert len(generated) == 32 and generated != "trace-42"
    for replaced in (spaced, too_long):
        assert replaced.headers["x-request-id"] not in ("has space", "x" * 129)
    assert error.status_code == 404 and error.headers["x-request-id"]
    lines = [r.getMessage() for r in caplog.records if r.name == "qiao.access"]
    assert any(
        '"POST /v1/completions" 200' in line and "request_id=trace-42" in line for line in lines
    )
    assert any(f"request_id={generated}" in line for line in lines)
    assert any(" 404 " in line and error.headers["x-request-id"] in line for line in lines)


def test_unauthenticated_answers_carry_a_request_id_and_health_stays_open(
    make_inprocess_server: Callable[..., InProcessServer],
) -> None:
    keyed = make_inprocess_server(api_key=[KEY])
    with httpx.Client(base_url=keyed.base_url) as client:
        refused = client.get("/version", headers={"X-Request-Id": "denied-1"})
        assert refused.status_code == 401 and refused.headers["x-request-id"] == "denied-1"
        assert client.get("/health").status_code == 200
        assert client.get("/ping").status_code == 200
        headers = {"Authorization": f"Bearer {KEY}"}
        assert client.get("/version", headers=headers).json()["version"] == __version__
