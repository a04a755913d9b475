"""Structured output through the official openai client against `qiao serve` (its engine in its
own process): JSON mode, `json_schema`, vLLM's `structured_outputs` and `guided_*` fields, each
output checked against its constraint by an independent validator (jsonschema, re)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from .conftest import MODEL_NAME, PROMPT, SubprocessServer, openai_client

SCHEMA = {
    "type": "object",
    "properties": {
        "mood": {"enum": ["happy", "sad", "sleepy"]},
        "friend": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "likes_cake": {"type": "boolean"},
    },
    "required": ["mood", "friend", "count", "likes_cake"],
    "additionalProperties": False,
}
CHAT = [{"role": "user", "content": "Tell me about the little dog, as JSON."}]


@pytest.fixture(scope="module")
def client(qiao_server: SubprocessServer) -> Iterator[openai.OpenAI]:
    with openai_client(qiao_server.base_url) as c:
        yield c


def test_json_schema_outputs_validate(client: openai.OpenAI) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "dog", "schema": SCHEMA, "strict": True},
    }
    for seed in range(4):
        response = client.chat.completions.create(
            model=MODEL_NAME,
            messages=CHAT,
            response_format=response_format,  # type: ignore[arg-type]
            temperature=1.0,
            seed=seed,
            max_tokens=120,
        )
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def assert_json_object_prefix(text: str) -> None:
    """`text` is a JSON object, or the start of one cut short: the standard library's parser
    fails only at its very end (once an open string is closed)."""
    assert text.startswith("{"), text
    in_string = len(re.findall(r'(?<!\\)"', text)) % 2 == 1
    candidate = text + '"' if in_string else text
    try:
        assert isinstance(json.loads(candidate), dict)
    except json.JSONDecodeError as exc:
        # A cut literal or number ("tr", "1.") fails a few characters before the end.
        assert exc.pos >= len(candidate) - 5, (exc.msg, exc.pos, len(candidate), text)


def test_assert_json_object_prefix_can_fail() -> None:
    for good in ('{"a": 1}', '{"a": [1, {"b": "c', '{"said": "hi", "x": tr', "{"):
        assert_json_object_prefix(good)
    for bad in ('{"a" 1, "b": 2, "c": 3}', '{"a": 1} and then free text', "Once {"):
        with pytest.raises(AssertionError):
            assert_json_object_prefix(bad)


def test_json_mode_gives_a_json_object(client: openai.OpenAI) -> None:
    """stories260K never closes a free-form object within max_tokens, so each answer is checked
    as a prefix of one: every character of it is JSON."""
    for seed in range(3):
        response = client.chat.completions.create(
            model=MODEL_NAME,
            messages=CHAT,
            response_format={"type": "json_object"},
            temperature=1.0,
            seed=seed,
            max_tokens=100,
        )
        assert_json_object_prefix(response.choices[0].message.content or "")


def test_vllm_fields_regex_choice_and_grammar(client: openai.OpenAI) -> None:
    cases = [
        ({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2,5}"}}, r"[0-9]{3}-[a-z]{2,5}"),
        ({"guided_regex": r"(red|green|blue) (cat|dog)"}, r"(red|green|blue) (cat|dog)"),
        ({"guided_choice": ["yes", "no", "maybe"]}, r"yes|no|maybe"),
        ({"structured_outputs": {"choice": ["Lily", "Tom"]}}, r"Lily|Tom"),
        ({"guided_grammar": 'root ::= "ab" | "cd" "e"'}, r"ab|cde"),
    ]
    for extra, pattern in cases:
        for seed in range(2):
            response = client.completions.create(
                model=MODEL_NAME,
                prompt=PROMPT,
                max_tokens=40,
                temperature=1.0,
                seed=seed,
                extra_body=extra,
            )
            text = response.choices[0].text
            assert re.fullmatch(pattern, text), (extra, text)
            assert response.choices[0].finish_reason == "stop"


def test_streamed_json_schema_output_validates(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=120,
        temperature=0.7,
        seed=3,
        n=2,
        stream=True,
        extra_body={"guided_json": SCHEMA},
    )
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize(
    ("extra", "field", "words"),
    [
        ({"guided_json": {"type": "frobnicate"}}, "guided_json", "invalid JSON schema"),
        ({"guided_regex": "([a-"}, "guided_regex", "invalid regex"),
        ({"guided_grammar": "root ::= (((("}, "guided_grammar", "invalid grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one of"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one output constraint"),
        ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(
    client: openai.OpenAI, extra: dict, field: str, words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, extra_body=extra)
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == field and words in error["message"], error
