"""Request limits: each breach gets its documented 4xx in the OpenAI error envelope, naming the
field, before any engine work. Also the suite's check that no body leaks internals."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from .conftest import (
    MODEL_NAME,
    PROMPT,
    InProcessServer,
    find_leaks,
    http_client,
    http_status_counts,
    parse_metrics,
)

MAX_REQUEST_BYTES = 16384
MAX_N = 2
MAX_STOP_SEQUENCES = 2
MAX_STOP_LENGTH = 8
MAX_TOP_LOGPROBS = 3
CONTEXT = 512  # stories260K's max_position_embeddings


@pytest.fixture(scope="module")
def server(make_inprocess_server: Callable[..., InProcessServer]) -> InProcessServer:
    return make_inprocess_server(
        max_request_bytes=MAX_REQUEST_BYTES,
        max_n=MAX_N,
        max_stop_sequences=MAX_STOP_SEQUENCES,
        max_stop_length=MAX_STOP_LENGTH,
        max_top_logprobs=MAX_TOP_LOGPROBS,
    )


@pytest.fixture(scope="module")
def client(server: InProcessServer) -> Iterator[httpx.Client]:
    with http_client(server.base_url, timeout=30.0) as c:
        yield c


def _completion(**fields: Any) -> dict:
    return {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, **fields}


def _chat(content: str = "Hello", **fields: Any) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], **fields}


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


CASES: list[tuple[str, str, dict, str | None, str]] = [
    # (case id, route, body, expected param, text the message must contain)
    ("n", "/v1/completions", _completion(n=MAX_N + 1), "n", str(MAX_N)),
    ("n-chat", "/v1/chat/completions", _chat(n=MAX_N + 1), "n", str(MAX_N)),
    (
        "stop-count",
        "/v1/completions",
        _completion(stop=["a", "b", "c"]),
        "stop",
        str(MAX_STOP_SEQUENCES),
    ),
    (
        "stop-length",
        "/v1/chat/completions",
        _chat(stop="x" * (MAX_STOP_LENGTH + 1)),
        "stop",
        str(MAX_STOP_LENGTH),
    ),
    ("stop-empty", "/v1/completions", _completion(stop=[""]), "stop", "empty"),
    (
        "logprobs",
        "/v1/completions",
        _completion(logprobs=MAX_TOP_LOGPROBS + 1),
        "logprobs",
        str(MAX_TOP_LOGPROBS),
    ),
    (
        "top-logprobs",
        "/v1/chat/completions",
        _chat(logprobs=True, top_logprobs=MAX_TOP_LOGPROBS + 1),
        "top_logprobs",
        str(MAX_TOP_LOGPROBS),
    ),
    (
        "top-logprobs-without-logprobs",
        "/v1/chat/completions",
        _chat(top_logprobs=1),
        "top_logprobs",
        "logprobs",
    ),
    (
        "prompt-over-context",
        "/v1/completions",
        _completion(prompt=[1] * CONTEXT),
        "prompt",
        str(CONTEXT),
    ),
    (
        "messages-over-context",
        "/v1/chat/completions",
        _chat("story " * 700),
        "messages",
        str(CONTEXT),
    ),
    (
        "max-tokens-over-room",
        "/v1/completions",
        _completion(max_tokens=CONTEXT),
        "max_tokens",
        str(CONTEXT - 5),
    ),
    (
        "max-tokens-chat",
        "/v1/chat/completions",
        _chat(max_tokens=CONTEXT),
        "max_tokens",
        str(CONTEXT),
    ),
    (
        "max-completion-tokens",
        "/v1/chat/completions",
        _chat(max_completion_tokens=CONTEXT),
        "max_completion_tokens",
        str(CONTEXT),
    ),
    ("empty-prompt", "/v1/completions", _completion(prompt=""), "prompt", "empty"),
    ("token-id-outside-vocab", "/v1/completions", _completion(prompt=[1, 99999]), "prompt", "["),
    ("wrong-type-max-tokens", "/v1/completions", _completion(max_tokens="many"), "max_tokens", ""),
    ("wrong-type-n", "/v1/chat/completions", _chat(n="two"), "n", ""),
    ("negative-max-tokens", "/v1/completions", _completion(max_tokens=0), "max_tokens", ""),
    ("temperature-range", "/v1/completions", _completion(temperature=5), "temperature", ""),
    (
        "messages-not-a-list",
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": "hi"},
        "messages",
        "",
    ),
    ("no-messages", "/v1/chat/completions", {"model": MODEL_NAME, "messages": []}, "messages", ""),
    ("missing-prompt", "/v1/completions", {"model": MODEL_NAME}, "prompt", ""),
    ("bad-role", "/v1/chat/completions", _chat() | {"messages": [{"role": "robot"}]}, None, ""),
]


@pytest.mark.parametrize(
    ("route", "body", "param", "mentions"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_limit_breach_is_a_400_naming_the_field(
    client: httpx.Client,
    server: InProcessServer,
    route: str,
    body: dict,
    param: str | None,
    mentions: str,
) -> None:
    steps_before = server.engine.stats()["num_steps"]
    error = _error(client.post(route, json=body), 400)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
        assert error["message"].startswith(param) or param in error["message"]
    else:
        assert error["param"]
    assert mentions in error["message"]
    # Refused before any engine work.
    assert server.engine.stats()["num_steps"] == steps_before


def test_body_over_the_limit_is_413(client: httpx.Client) -> None:
    big = _completion(prompt="a" * (MAX_REQUEST_BYTES + 1))
    error = _error(client.post("/v1/completions", json=big), 413)
    assert str(MAX_REQUEST_BYTES) in error["message"]


def test_chunked_body_over_the_limit_is_413(client: httpx.Client) -> None:
    # No Content-Length: the limit must hold while the body is read.
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "' + MODEL_NAME.encode() + b'", "prompt": "'
        for _ in range(MAX_REQUEST_BYTES // 512 + 1):
            yield b"a" * 512
        yield b'"}'

    response = client.post(
        "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    error = _error(response, 413)
    assert str(MAX_REQUEST_BYTES) in error["message"]


def test_unknown_model_is_404(client: httpx.Client) -> None:
    for route, body in (
        ("/v1/completions", _completion(model="gpt-17")),
        ("/v1/chat/completions", _chat(model="gpt-17")),
    ):
        error = _error(client.post(route, json=body), 404)
        assert error["param"] == "model"
        assert error["code"] == "model_not_found"
        assert "gpt-17" in error["message"]


def test_bad_json_is_400(client: httpx.Client) -> None:
    response = client.post(
        "/v1/completions",
        content=b'{"model": "stories260K-hf", "prompt": ',
        headers={"content-type": "application/json"},
    )
    error = _error(response, 400)
    assert "JSON" in error["message"]


def test_unknown_route_and_wrong_method_use_the_envelope(client: httpx.Client) -> None:
    assert _error(client.get("/v1/nothing-here"), 404)["type"] == "not_found_error"
    _error(client.get("/v1/completions"), 405)


def test_a_request_within_every_limit_is_served(client: httpx.Client) -> None:
    body = _completion(n=MAX_N, stop=["x" * MAX_STOP_LENGTH, "y"], logprobs=MAX_TOP_LOGPROBS)
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == MAX_N


@pytest.mark.logs_errors
def test_unexpected_error_is_a_generic_500_and_is_counted(
    client: httpx.Client,
    server: InProcessServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret = "engine exploded in /work/main/qiao/x.py talking to 10.1.2.3:7000"

    def explode(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(secret)

    monkeypatch.setattr(server.engine, "generate_all", explode)
    before = http_status_counts(parse_metrics(server.app.state.metrics.render().decode()))
    error = _error(client.post("/v1/completions", json=_completion()), 500)
    assert error["code"] == "internal_error"
    assert error["type"] == "server_error"
    assert "exploded" not in error["message"]
    # The details go to the server log instead.
    assert any(secret in str(r.exc_info[1]) for r in caplog.records if r.exc_info)
    after = http_status_counts(parse_metrics(server.app.state.metrics.render().decode()))
    assert after.get("500", 0) - before.get("500", 0) == 1


@pytest.mark.parametrize(
    "body",
    [
        b'Traceback (most recent call last):\n  File "x.py", line 1',
        b"see /work/main/qiao/api/app.py",
        b"/usr/lib/python3/site-packages/fastapi",
        b"connect to 127.0.0.1:8000 failed",
        b"http://localhost:8000/v1",
        b"[::1]:8000",
    ],
)
def test_leak_check_catches_internals(body: bytes) -> None:
    assert find_leaks(body)


def test_leak_check_passes_ordinary_bodies() -> None:
    assert not find_leaks(b'{"choices": [{"text": "Once upon a time, at 3:15 pm"}]}')
    assert not find_leaks(b'qiao:time_to_first_token_seconds_bucket{le="0.5"} 1.0')
