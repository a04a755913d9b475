"""The response cache's pieces without a server: key normalisation, which requests are
deterministic, the memory backend's bounds (entries, bytes, TTL, LRU order), stored-body
replay as stream chunks."""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qiao.api.cache_backends import ENTRY_OVERHEAD_BYTES, CachedResponse, MemoryBackend
from qiao.api.protocol import ChatCompletionRequest, CompletionRequest
from qiao.api.response_cache import (
    CacheSettings,
    body_fields,
    cache_key,
    is_deterministic,
    kserve_fields,
    replay_chunks,
)
from qiao.api.settings import load_settings
from qiao.errors import ConfigError


def key_of(body: dict, *, scope: str = "key-1", version: str = "1", tag: str = "t") -> str:
    return cache_key(
        "completions", "m", version, tag, scope, body_fields(CompletionRequest(**body))
    )


BASE = {"model": "m", "prompt": "Once upon a time", "temperature": 0}


def test_defaults_and_delivery_fields_do_not_change_the_key() -> None:
    same = [
        BASE,
        {**BASE, "max_tokens": 16, "n": 1, "echo": False, "top_k": -1},  # the defaults, spelt out
        {**BASE, "stream": True, "stream_options": {"include_usage": True}},
        {**BASE, "user": "someone", "priority": 3, "timeout": 5.0, "cache": True},
        dict(reversed(list(BASE.items()))),  # key order
        {**BASE, "unknown_field": 1},  # ignored by the wire model, so not part of the answer
    ]
    assert len({key_of(body) for body in same}) == 1


def test_everything_that_changes_the_answer_changes_the_key() -> None:
    keys = {
        key_of(BASE),
        key_of({**BASE, "prompt": "Once upon a time,"}),
        key_of({**BASE, "max_tokens": 17}),
        key_of({**BASE, "temperature": 0.5, "seed": 1}),
        key_of({**BASE, "temperature": 0.5, "seed": 2}),
        key_of({**BASE, "model": "m@2"}),
        key_of({**BASE, "logprobs": 2}),
        key_of({**BASE, "stop": ["."]}),
        key_of(BASE, scope="key-2"),
        key_of(BASE, version="2"),
        key_of(BASE, tag="another build"),
    }
    assert len(keys) == 11
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    assert cache_key("chat", "m", "1", "t", "", body_fields(chat)) != key_of(BASE, scope="")


def test_only_greedy_or_seeded_requests_are_deterministic() -> None:
    assert is_deterministic(CompletionRequest(**BASE))
    assert is_deterministic(CompletionRequest(**{**BASE, "temperature": 0.9, "seed": 7}))
    assert is_deterministic(CompletionRequest(**{**BASE, "temperature": None, "seed": 0}))
    assert not is_deterministic(CompletionRequest(**{**BASE, "temperature": 0.9}))
    assert not is_deterministic(CompletionRequest(model="m", prompt="x"))  # default: 1.0


def test_kserve_scheduling_parameters_are_not_in_the_key_but_binary_data_is() -> None:
    payload = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1]}]}
    with_params = {**payload, "parameters": {"priority": 2, "timeout": 100, "user": "u"}}
    assert kserve_fields(payload, b"ab") == kserve_fields(with_params, b"ab")
    assert kserve_fields(payload, b"ab") != kserve_fields(payload, b"ac")
    binary_out = {**payload, "parameters": {"binary_data_output": True}}
    assert kserve_fields(payload, b"") != kserve_fields(binary_out, b"")


def response(size: int) -> CachedResponse:
    return CachedResponse(b"x" * size, "application/json")


def test_cached_response_round_trips_through_bytes() -> None:
    value = CachedResponse(b"\x00body", "application/octet-stream", {"a": "1"})
    assert CachedResponse.decode(value.encode()) == value


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_lru_order_entry_bound_and_evictions() -> None:
    evicted: list[str] = []
    backend = MemoryBackend(1 << 20, 2, on_evict=evicted.append)
    backend.put_now("a", ("m", "1"), response(10), 60)
    backend.put_now("b", ("m", "1"), response(10), 60)
    assert backend.get_now("a") is not None  # a is now the most recently used
    backend.put_now("c", ("n", "1"), response(10), 60)
    assert backend.get_now("b") is None and backend.get_now("a") is not None
    assert evicted == ["m"]
    assert backend.usage() == {
        "m": (response(10).size, 1),
        "n": (response(10).size, 1),
    }


def test_byte_bound_and_entries_larger_than_it() -> None:
    one = response(100).size
    backend = MemoryBackend(2 * one + 10, 100)
    for key in "abc":
        backend.put_now(key, ("m", "1"), response(100), 60)
    assert len(backend) == 2 and backend.total_bytes == 2 * one
    backend.put_now("huge", ("m", "1"), response(3 * one), 60)
    assert backend.get_now("huge") is None and len(backend) == 2


def test_entries_expire_after_their_ttl() -> None:
    clock = Clock()
    backend = MemoryBackend(1 << 20, 10, clock=clock)
    backend.put_now("a", ("m", "1"), response(1), 5.0)
    clock.now = 4.9
    assert backend.get_now("a") is not None
    clock.now = 5.0
    assert backend.get_now("a") is None
    assert len(backend) == 0 and backend.total_bytes == 0


def test_dropping_a_version_removes_only_its_entries() -> None:
    backend = MemoryBackend(1 << 20, 10)
    backend.put_now("a", ("m", "1"), response(1), 60)
    backend.put_now("b", ("m", "2"), response(1), 60)
    assert asyncio.run(backend.drop_group(("m", "1"))) == 1
    assert backend.get_now("a") is None and backend.get_now("b") is not None


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 30), st.integers(0, 2000)), min_size=1, max_size=80),
    st.integers(1, 8),
    st.integers(ENTRY_OVERHEAD_BYTES, 6000),
)
def test_bounds_hold_under_any_sequence_of_puts(
    puts: list[tuple[int, int]], max_entries: int, max_bytes: int
) -> None:
    """Against a plain LRU model: the same entries kept, the same evictions counted."""
    evictions: list[str] = []
    backend = MemoryBackend(max_bytes, max_entries, on_evict=evictions.append)
    model: OrderedDict[str, int] = OrderedDict()
    expected_evictions = 0
    for key, size in puts:
        backend.put_now(str(key), ("m", "1"), response(size), 60)
        assert len(backend) <= max_entries and backend.total_bytes <= max_bytes
        entry_size = response(size).size
        if entry_size > max_bytes:
            continue
        model.pop(str(key), None)
        model[str(key)] = entry_size
        while len(model) > max_entries or sum(model.values()) > max_bytes:
            model.popitem(last=False)
            expected_evictions += 1
    assert len(evictions) == expected_evictions
    assert backend.total_bytes == sum(model.values())
    assert all(backend.get_now(key) is not None for key in model) and len(backend) == len(model)


def test_chat_body_replays_as_role_then_content_and_tool_call_chunks() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 5,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi"},
                "logprobs": None,
                "finish_reason": "stop",
            },
            {
                "index": 1,
                "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                "logprobs": None,
                "finish_reason": "tool_calls",
            },
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
    }
    chunks = replay_chunks(body, include_usage=True)
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 5
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [
        {"role": "assistant", "content": ""}
    ] * 2
    assert chunks[2]["choices"][0]["delta"] == {"content": "hi"}
    assert chunks[3]["choices"][0]["delta"] == {"tool_calls": [{"index": 0, **call}]}
    assert [c["choices"][0]["finish_reason"] for c in chunks[2:4]] == ["stop", "tool_calls"]
    assert chunks[4] == {
        **{k: body[k] for k in ("id", "created", "model")},
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": body["usage"],
    }
    assert json.dumps(replay_chunks(body, include_usage=False)[-1]).count("usage") == 0


def test_settings_come_from_flags_environment_and_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = load_settings(
        [
            "--response-cache",
            "--response-cache-max-bytes",
            "4096",
            "--response-cache-scope",
            "shared",
        ]
    )
    cache = CacheSettings.from_serve(settings)
    assert (cache.enabled, cache.max_bytes, cache.scope, cache.backend) == (
        True,
        4096,
        "shared",
        "memory",
    )
    assert not CacheSettings.from_serve(load_settings([])).enabled  # off by default
    monkeypatch.setenv("QIAO_RESPONSE_CACHE_TTL", "12.5")
    config = tmp_path / "serve.yaml"
    config.write_text("response-cache: true\nresponse_cache_backend: redis://127.0.0.1:1/0\n")
    cache = CacheSettings.from_serve(load_settings(["--config", str(config)]))
    assert (cache.enabled, cache.ttl, cache.backend) == (True, 12.5, "redis://127.0.0.1:1/0")
    with pytest.raises(ConfigError, match="response-cache-backend"):
        load_settings(["--response-cache-backend", "memcached://x"])
    with pytest.raises(ConfigError, match="response-cache-ttl"):
        load_settings(["--response-cache-ttl", "0"])


def test_a_models_config_turns_its_cache_on_or_off_and_checks_its_values(tmp_path: Path) -> None:
    from qiao.repository.config import read_model_config

    path = tmp_path / "config.yaml"
    path.write_text("backend: embedding\nresponse_cache: {enabled: false, ttl: 30}\n")
    section = read_model_config(path).response_cache
    assert section is not None and (section.enabled, section.ttl) == (False, 30)
    path.write_text("backend: embedding\nresponse_cache: {ttl: -1}\n")
    with pytest.raises(ConfigError, match=r"response_cache\.ttl"):
        read_model_config(path)
