"""The official `openai` client against `qiao serve` on stories260K: the wire format as clients
parse it, checked against the offline engine for the same prompt."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from qiao import LLM, SamplingParams

from .conftest import (
    GREEDY_32,
    MODEL_NAME,
    PROMPT,
    SubprocessServer,
    http_client,
    openai_client,
    parse_metrics,
    wait_until,
)

CHAT = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture(scope="module")
def client(qiao_server: SubprocessServer) -> Iterator[openai.OpenAI]:
    with openai_client(qiao_server.base_url) as c:
        yield c


@pytest.fixture(scope="module")
def offline(stories_dir: Path) -> LLM:
    return LLM(str(stories_dir), num_kv_blocks=64)


def _greedy(max_tokens: int, **extra: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_greedy_completion_matches_offline_engine(client: openai.OpenAI, offline: LLM) -> None:
    expected = offline.generate(PROMPT, _greedy(32), use_tqdm=False)[0].outputs[0]
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=32, temperature=0
    )
    assert expected.text == GREEDY_32
    assert response.choices[0].text == expected.text
    assert response.choices[0].finish_reason == "length"
    assert response.usage is not None
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (5, 32)
    assert response.usage.total_tokens == 37


def test_streaming_completion_matches_non_streaming(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert text == GREEDY_32
    assert finish == ["length"]
    # The usage chunk comes last, with no choices.
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (5, 32)
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_without_include_usage_has_no_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, stream=True
        )
    )
    assert chunks
    assert all(c.usage is None and c.choices for c in chunks)


def test_chat_greedy_matches_offline_engine(client: openai.OpenAI, offline: LLM) -> None:
    expected = offline.chat(CHAT, _greedy(12), use_tqdm=False)[0]
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=12, temperature=0
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == "length"
    assert response.usage is not None
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == 12


def test_chat_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=12, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=CHAT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == whole.choices[0].message.content
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12


def test_n_2_gives_two_choices(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, n=2, seed=7
    )
    assert sorted(c.index for c in response.choices) == [0, 1]
    assert all(c.text and c.finish_reason == "length" for c in response.choices)
    assert response.usage is not None
    assert response.usage.completion_tokens == 16

    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=4, temperature=1.0, n=2
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert chat.usage is not None
    assert chat.usage.completion_tokens == 8


def test_n_2_streaming_labels_both_choices(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, n=2, stream=True
        )
    )
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    # Greedy: both samples are the same continuation.
    assert texts[0] == texts[1]
    assert GREEDY_32.startswith(texts[0])
    assert texts[0]


def test_completion_logprobs(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2
    )
    lp = response.choices[0].logprobs
    assert lp is not None
    assert lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for chosen, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2
        assert logprob <= 0.0
        # Greedy: the chosen token is the most likely one.
        assert top[chosen] == pytest.approx(max(top.values()))
        assert logprob == pytest.approx(top[chosen])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_logprob_tokens_spell_the_text(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1
    )
    lp = response.choices[0].logprobs
    assert lp is not None and lp.tokens is not None
    assert "".join(lp.tokens) == response.choices[0].text


def test_chat_logprobs(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    logprobs = response.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert len(logprobs.content) == 5
    for item in logprobs.content:
        assert len(item.top_logprobs) == 2
        assert item.logprob == pytest.approx(max(t.logprob for t in item.top_logprobs))
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert bytes(item.bytes or []) == item.token.encode()


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=32, temperature=0, stop=["Lily"]
    )
    choice = response.choices[0]
    assert choice.text == GREEDY_32[: GREEDY_32.index("Lily")]
    assert choice.finish_reason == "stop"

    streamed = list(
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=32, temperature=0, stop="Lily", stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_a_stop_string_stops_the_engine_too(
    client: openai.OpenAI, qiao_server: SubprocessServer
) -> None:
    """The API process finds the stop string and tells the engine process to end the sample: it
    does not go on to max_tokens unseen."""
    with http_client(qiao_server.base_url) as http:

        def engine_stat(name: str) -> float:
            return parse_metrics(http.get("/metrics").text)[(name, ())]

        steps_before = engine_stat("qiao:engine_steps_total")
        response = client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=400,
            temperature=0,
            stop=["Lily"],
            extra_body={"ignore_eos": True},
        )
        assert response.choices[0].finish_reason == "stop"
        wait_until(lambda: engine_stat("qiao:num_requests_running") == 0, 30, "the engine to idle")
        steps = engine_stat("qiao:engine_steps_total") - steps_before
    assert steps < 40, f"the engine ran {steps:.0f} steps for a text cut after ~10 tokens"


def test_sampled_stop_strings_and_logprobs_match_offline_engine(
    client: openai.OpenAI, offline: LLM
) -> None:
    """The server's engine process sends token ids; its API process makes the text, ends samples
    on stop strings (dropping what the engine sampled past them) and names the logprob tokens.
    The offline engine detokenizes in-process: both must agree, streamed or not."""
    extra = {"stop": [" the", "."], "include_stop_str_in_output": False}
    params = SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=40, logprobs=2, **extra)
    expected = offline.generate(PROMPT, params, use_tqdm=False)[0].outputs
    assert {c.finish_reason for c in expected} == {"stop"}
    kwargs: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": 40,
        "temperature": 1.0,
        "seed": 11,
        "n": 2,
        "logprobs": 2,
        "stop": extra["stop"],
    }
    response = client.completions.create(**kwargs)
    for want, got in zip(expected, sorted(response.choices, key=lambda c: c.index), strict=True):
        assert got.text == want.text
        assert got.finish_reason == "stop"
        assert got.logprobs is not None and want.logprobs is not None
        assert got.logprobs.tokens == [
            entry[tid].decoded_token
            for tid, entry in zip(want.token_ids, want.logprobs, strict=True)
        ]
    streamed: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, str | None] = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    assert streamed == {c.index: c.text for c in expected}
    assert finishes == {0: "stop", 1: "stop"}


def test_seed_makes_sampling_repeatable(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        response = client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed
        )
        return response.choices[0].text

    first, again = sample(1234), sample(1234)
    assert first == again
    # Sampling really happens: some other seed gives another text.
    assert any(sample(seed) != first for seed in (1, 2, 3, 4))

    chat = [
        client.chat.completions.create(
            model=MODEL_NAME, messages=CHAT, max_tokens=8, temperature=1.0, seed=99
        )
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert chat[0] == chat[1]


def test_extra_body_priority_and_timeout_are_accepted(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        extra_body={"priority": 3, "timeout": 30.0},
    )
    assert GREEDY_32.startswith(response.choices[0].text)
    assert response.usage is not None
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=4,
        extra_body={"priority": -1, "timeout": 30.0},
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 4
    # The fields are read, not ignored: an invalid timeout is refused, naming the field.
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=4, extra_body={"timeout": -1}
        )
    assert excinfo.value.body["param"] == "timeout"  # type: ignore[index]


def test_errors_reach_the_client_as_openai_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as excinfo:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert excinfo.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=100_000)
    assert bad.value.body["param"] == "max_tokens"  # type: ignore[index]


def test_tiny_temperature_behaves_like_greedy(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1e-300
    )
    assert GREEDY_32.startswith(response.choices[0].text)
    assert response.choices[0].text
