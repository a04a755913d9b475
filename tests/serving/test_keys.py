"""Named API keys with limits (`--keys-file`): 429 with OpenAI's six x-ratelimit headers past
requests or tokens per minute, other keys unaffected, 403 for a model outside a key's list, the
priority ceiling, reload on change, and metrics by key name (never the key)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from qiao.api.keys import load_keys_file
from qiao.errors import ConfigError

from .conftest import MODEL_NAME, PROMPT, InProcessServer, http_client, parse_metrics, wait_until

BURSTY = "sk-bursty-0123456789abcdef"
HUNGRY = "sk-hungry-0123456789abcdef"
CALM = "sk-calm-0123456789abcdefgh"
CAPPED = "sk-capped-0123456789abcdef"
SIX = [
    f"x-ratelimit-{what}-{kind}"
    for kind in ("requests", "tokens")
    for what in ("limit", "remaining", "reset")
]


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _keys_yaml(bursty_rpm: int = 3) -> str:
    return f"""
keys:
  - name: bursty
    key_sha256: {_sha(BURSTY)}
    requests_per_minute: {bursty_rpm}
    tokens_per_minute: 100000
  - name: hungry
    key_env: QIAO_TEST_HUNGRY_KEY
    requests_per_minute: 1000
    tokens_per_minute: 40
    models: [{MODEL_NAME}]
  - name: capped
    key_sha256: {_sha(CAPPED)}
    max_priority: 5
  - name: calm
    key_sha256: {_sha(CALM)}
    models: [another-model]
"""


@pytest.fixture(scope="module")
def keyed(
    make_inprocess_server: Callable[..., InProcessServer],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[InProcessServer, Path]]:
    keys_file = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys_file.write_text(_keys_yaml())
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QIAO_TEST_HUNGRY_KEY", HUNGRY)
        yield make_inprocess_server(keys_file=keys_file, scheduling_policy="priority"), keys_file


def _post(client: httpx.Client, key: str, max_tokens: int = 4, **fields: object) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens, **fields}
    return client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})


def test_a_burst_past_requests_per_minute_gets_429_with_the_six_headers(
    keyed: tuple[InProcessServer, Path],
) -> None:
    server, _ = keyed
    with http_client(server.base_url, timeout=30.0) as client:
        answers = [_post(client, BURSTY) for _ in range(4)]
        assert [a.status_code for a in answers] == [200, 200, 200, 429]
        for answer in answers:
            assert all(h in answer.headers for h in SIX), answer.headers
        assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == [
            "2",
            "1",
            "0",
            "0",
        ]
        refused = answers[-1]
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.headers["x-ratelimit-limit-requests"] == "3"
        # Another key is unaffected.
        assert _post(client, HUNGRY, max_tokens=2).status_code == 200
        metrics = client.get("/metrics", headers={"Authorization": f"Bearer {CALM}"}).text
    samples = parse_metrics(metrics)
    assert (
        samples[("qiao:api_key_requests_total", (("key_name", "bursty"), ("outcome", "admitted")))]
        == 3
    )
    limited = (("key_name", "bursty"), ("outcome", "limited_requests"))
    assert samples[("qiao:api_key_requests_total", limited)] == 1
    assert BURSTY not in metrics and _sha(BURSTY) not in metrics


def test_tokens_per_minute_and_the_model_list(keyed: tuple[InProcessServer, Path]) -> None:
    server, _ = keyed
    with http_client(server.base_url, timeout=30.0) as client:
        # 5 prompt + 16 completion tokens per request; the budget is 40 a minute.
        statuses = [
            _post(client, HUNGRY, max_tokens=16, ignore_eos=True).status_code for _ in range(4)
        ]
        assert statuses[:2] == [200, 200] and statuses[-1] == 429
        refused = _post(client, HUNGRY, max_tokens=16)
        assert refused.status_code == 429
        assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
        assert all(h in refused.headers for h in SIX)
        forbidden = _post(client, CALM)
        assert forbidden.status_code == 403
        assert forbidden.json()["error"]["code"] == "model_not_allowed"
        assert (
            client.post(
                "/v1/completions",
                json={"model": MODEL_NAME, "prompt": PROMPT},
                headers={"Authorization": "Bearer sk-nobody-0123456789abcdef"},
            ).status_code
            == 401
        )


def test_the_priority_ceiling_and_a_reload(keyed: tuple[InProcessServer, Path]) -> None:
    server, keys_file = keyed
    engine = server.engine.engine
    add = engine.add_request
    seen: list[int] = []

    def recording(*args: object, **kwargs: object) -> None:
        seen.append(kwargs["priority"])  # type: ignore[arg-type]
        add(*args, **kwargs)  # type: ignore[arg-type]

    engine.add_request = recording
    try:
        with http_client(server.base_url, timeout=30.0) as client:
            assert _post(client, CAPPED, max_tokens=1, priority=0).status_code == 200
            assert _post(client, CAPPED, max_tokens=1, priority=9).status_code == 200
            assert _post(client, BURSTY, max_tokens=1, priority=0).status_code in (200, 429)
            assert seen[:2] == [5, 9]  # raised to the ceiling; a lower urgency is kept
            # A raised limit applies without a restart once the file changes.
            keys_file.write_text(_keys_yaml(bursty_rpm=1000))
            wait_until(
                lambda: _post(client, BURSTY, max_tokens=1).status_code == 200,
                10,
                "the keys file to reload",
            )
    finally:
        engine.add_request = add


def test_a_bad_keys_file_names_what_to_fix(tmp_path: Path) -> None:
    bad = tmp_path / "keys.yaml"
    bad.write_text("keys:\n  - name: x\n    requests_per_minute: 3\n")
    with pytest.raises(ConfigError, match="exactly one of key_sha256 and key_env"):
        load_keys_file(bad)
    bad.write_text("keys:\n  - name: x\n    key_env: QIAO_SURELY_UNSET_VAR\n")
    with pytest.raises(ConfigError, match="QIAO_SURELY_UNSET_VAR, which is unset"):
        load_keys_file(bad, environ={})
    bad.write_text(
        f"keys:\n  - name: x\n    key_sha256: {_sha('a')}\n  - name: x\n    key_sha256: {_sha('b')}\n"
    )
    with pytest.raises(ConfigError, match="used twice"):
        load_keys_file(bad)
