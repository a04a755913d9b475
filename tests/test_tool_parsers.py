"""Tool-call parsers on outputs as Qwen2.5 / Qwen3 (hermes), Llama 3.1 / 3.2 (llama3_json) and
Mistral models write them; the stream parser against the one-shot parser; `tool_call_schema`."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from qiao.api.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ParsedText,
    ToolCallParser,
    detect_parser,
    tool_call_schema,
    tool_parsing,
)

# --- recorded outputs -------------------------------------------------------------------------

QWEN25_TWO_CALLS = (
    '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, '
    'CA, USA"}}\n</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": '
    '{"location": "San Francisco, CA, USA", "date": "2024-10-01"}}\n</tool_call>'
)
QWEN25_TEXT_FIRST = (
    "I'll look up the current weather in Paris for you.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
)
QWEN3_THINKING = (
    "<think>\nThe user wants the weather in Beijing. I should call get_weather with city "
    'Beijing.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Beijing"}}'
    "\n</tool_call>"
)
QWEN_CODE_ARGUMENT = (  # a raw newline inside a JSON string, as small models write code
    '<tool_call>\n{"name": "write_file", "arguments": {"path": "a.py", "text": "def f():\n    '
    'return {\\"a\\": [1, 2]}\\n"}}\n</tool_call>'
)
QWEN_MISSING_BRACE = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'
)
QWEN_SINGLE_QUOTES = (
    "<tool_call>\n{'name': 'get_weather', 'arguments': {'city': 'Paris'}}\n</tool_call>"
)
QWEN_TRUNCATED = '<tool_call>\n{"name": "get_weather", "arguments": {"ci'
LLAMA31_JSON = (
    '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
    '"unit": "Fahrenheit"}}'
)
LLAMA31_PYTHON_TAG = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA32_TWO_CALLS = (
    '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"type": "function", "name": "get_time", "parameters": {"timezone": "Europe/Paris"}}'
)
LLAMA_PLAIN_JSON_ANSWER = '{"name": "Ada Lovelace", "born": 1815}'
LLAMA_TEXT = "The capital of France is Paris."
MISTRAL_V03 = (
    '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
    '"format": "celsius"}}, {"name": "get_current_weather", "arguments": {"location": '
    '"Tokyo, Japan", "format": "celsius"}}]'
)
MISTRAL_V11 = (
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"timezone": '
    '"Europe/Paris"}'
)
MISTRAL_BAD_JSON = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris",}}]'

_TOKEN = re.compile(
    r"<tool_call>|</tool_call>|<\|python_tag\|>|\[TOOL_CALLS\]|\[ARGS\]|</s>|\s+|\w{1,4}|[^\w\s]"
)


def _calls(parsed: ParsedText) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def _streamed(parser: ToolCallParser, pieces: list[str]) -> ParsedText:
    out = ParsedText()
    for piece in pieces:
        out += parser.feed(piece)
    return out + parser.finish()


# --- hermes -----------------------------------------------------------------------------------


def test_hermes_two_calls() -> None:
    parsed = HermesParser().parse(QWEN25_TWO_CALLS)
    assert parsed.content == ""
    assert _calls(parsed) == [
        ("get_current_temperature", {"location": "San Francisco, CA, USA"}),
        ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"}),
    ]
    assert [c.index for c in parsed.calls] == [0, 1]
    ids = [c.id for c in parsed.calls]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids) and len(set(ids)) == 2


def test_hermes_text_before_the_call_is_content() -> None:
    parsed = HermesParser().parse(QWEN25_TEXT_FIRST)
    assert parsed.content == "I'll look up the current weather in Paris for you."
    assert _calls(parsed) == [("get_weather", {"city": "Paris", "unit": "celsius"})]


def test_hermes_qwen3_thinking_stays_content() -> None:
    parsed = HermesParser().parse(QWEN3_THINKING)
    assert parsed.content.startswith("<think>\nThe user wants")
    assert parsed.content.endswith("</think>")
    assert _calls(parsed) == [("get_weather", {"city": "Beijing"})]


def test_hermes_code_argument_with_raw_newline() -> None:
    parsed = HermesParser().parse(QWEN_CODE_ARGUMENT)
    assert _calls(parsed) == [
        ("write_file", {"path": "a.py", "text": 'def f():\n    return {"a": [1, 2]}\n'})
    ]


@pytest.mark.parametrize("text", [QWEN_MISSING_BRACE, QWEN_SINGLE_QUOTES, QWEN_TRUNCATED])
def test_hermes_malformed_call_stays_content(text: str) -> None:
    parsed = HermesParser().parse(text)
    assert parsed.calls == []
    assert parsed.content == text


def test_hermes_good_call_kept_beside_a_malformed_one() -> None:
    parsed = HermesParser().parse(QWEN_MISSING_BRACE + "\n" + QWEN25_TEXT_FIRST)
    assert _calls(parsed) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert parsed.content.startswith(QWEN_MISSING_BRACE)
    assert "<tool_call>" in parsed.content and parsed.content.count("<tool_call>") == 1


def test_hermes_unclosed_but_complete_call_at_the_end() -> None:
    parsed = HermesParser().parse('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n')
    assert _calls(parsed) == [("f", {"a": 1})]


def test_hermes_plain_text_untouched() -> None:
    text = "  No tools needed: 2 < 3 and <b>bold</b>.\n"
    assert HermesParser().parse(text) == ParsedText(text, [])


def test_arguments_as_json_string_are_taken() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>'
    assert _calls(HermesParser().parse(text)) == [("f", {"a": 1})]


# --- llama 3 ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            LLAMA31_JSON,
            [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})],
        ),
        (LLAMA31_PYTHON_TAG, [("get_weather", {"city": "Paris"})]),
        (
            LLAMA32_TWO_CALLS,
            [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})],
        ),
        ("\n\n" + LLAMA31_PYTHON_TAG + "\n", [("get_weather", {"city": "Paris"})]),
    ],
)
def test_llama3_json_calls(text: str, expected: list) -> None:
    parsed = Llama3JsonParser().parse(text)
    assert _calls(parsed) == expected
    assert parsed.content == ""


@pytest.mark.parametrize(
    "text", [LLAMA_TEXT, LLAMA_PLAIN_JSON_ANSWER, '{"name": "f", "parameters": {"a": 1,}}']
)
def test_llama3_json_text_and_non_calls_stay_content(text: str) -> None:
    parsed = Llama3JsonParser().parse(text)
    assert parsed == ParsedText(text, [])


def test_llama3_json_text_after_the_calls_is_content() -> None:
    parsed = Llama3JsonParser().parse(LLAMA31_JSON + "\n\nLet me know if you need more.")
    assert parsed.content == "Let me know if you need more."
    assert len(parsed.calls) == 1


# --- mistral ----------------------------------------------------------------------------------


def test_mistral_v03_array() -> None:
    parsed = MistralParser().parse(MISTRAL_V03)
    assert parsed.content == ""
    assert _calls(parsed) == [
        ("get_current_weather", {"location": "Paris, France", "format": "celsius"}),
        ("get_current_weather", {"location": "Tokyo, Japan", "format": "celsius"}),
    ]
    # Mistral's templates take back only 9-character alphanumeric ids.
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in parsed.calls)


def test_mistral_v11_name_args_form() -> None:
    parsed = MistralParser().parse("Checking both." + MISTRAL_V11)
    assert parsed.content == "Checking both."
    assert _calls(parsed) == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"timezone": "Europe/Paris"}),
    ]


@pytest.mark.parametrize(
    "text", [MISTRAL_BAD_JSON, "[TOOL_CALLS]", "[TOOL_CALLS]get weather now", "[TOOL_CALLS]f[ARGS]"]
)
def test_mistral_malformed_stays_content(text: str) -> None:
    assert MistralParser().parse(text) == ParsedText(text, [])


# --- streaming equals one-shot ----------------------------------------------------------------

ALL_RECORDED = [
    (HermesParser, QWEN25_TWO_CALLS),
    (HermesParser, QWEN25_TEXT_FIRST),
    (HermesParser, QWEN3_THINKING),
    (HermesParser, QWEN_CODE_ARGUMENT),
    (HermesParser, QWEN_MISSING_BRACE + "\n" + QWEN25_TEXT_FIRST),
    (HermesParser, QWEN_SINGLE_QUOTES),
    (HermesParser, QWEN_TRUNCATED),
    (HermesParser, "Hello <tool_c world, no call <tool_call"),
    (Llama3JsonParser, LLAMA31_JSON),
    (Llama3JsonParser, LLAMA31_PYTHON_TAG),
    (Llama3JsonParser, LLAMA32_TWO_CALLS),
    (Llama3JsonParser, LLAMA_PLAIN_JSON_ANSWER),
    (Llama3JsonParser, LLAMA_TEXT),
    (Llama3JsonParser, LLAMA31_JSON + "\n\nLet me know."),
    (MistralParser, MISTRAL_V03),
    (MistralParser, "Checking both." + MISTRAL_V11),
    (MistralParser, MISTRAL_BAD_JSON),
    (MistralParser, "[TOOL_CALLS]get weather now"),
]


@pytest.mark.parametrize("split", ["tokens", "chars"])
@pytest.mark.parametrize(("parser_cls", "text"), ALL_RECORDED)
def test_stream_equals_one_shot(parser_cls: type[ToolCallParser], text: str, split: str) -> None:
    pieces = _TOKEN.findall(text) if split == "tokens" else list(text)
    assert "".join(pieces) == text
    one_shot = parser_cls().parse(text)
    streamed = _streamed(parser_cls(), pieces)
    assert streamed.content == one_shot.content
    assert [(c.index, c.name, c.arguments) for c in streamed.calls] == [
        (c.index, c.name, c.arguments) for c in one_shot.calls
    ]


@pytest.mark.parametrize(
    ("parser_cls", "text", "markup"),
    [
        (HermesParser, QWEN25_TEXT_FIRST, "<tool_call>"),
        (Llama3JsonParser, LLAMA31_PYTHON_TAG, "<|python_tag|>"),
        (MistralParser, "Checking both." + MISTRAL_V11, "[TOOL_CALLS]"),
    ],
)
def test_stream_never_leaks_markup_into_content(
    parser_cls: type[ToolCallParser], text: str, markup: str
) -> None:
    parser = parser_cls()
    streamed = ""
    for piece in text:
        streamed += parser.feed(piece).content
        # No prefix of a marker longer than one character ever reaches content.
        assert not any(streamed.endswith(markup[:n]) for n in range(2, len(markup) + 1))
    streamed += parser.finish().content
    assert markup not in streamed and "{" not in streamed


def test_stream_releases_content_before_a_call_as_it_comes() -> None:
    parser = HermesParser()
    assert parser.feed("I'll look ").content == "I'll look"  # the space waits for what follows
    assert parser.feed("it up.").content == " it up."
    assert parser.feed("\n<tool").content == ""
    out = parser.feed('_call>\n{"name": "f", "arguments": {}}\n</tool_call>')
    assert (out.content, [c.name for c in out.calls]) == ("", ["f"])
    assert parser.finish() == ParsedText()


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    for parser in (HermesParser(parallel_tool_calls=False), HermesParser([], False)):
        parsed = parser.parse(QWEN25_TWO_CALLS)
        assert [c.name for c in parsed.calls] == ["get_current_temperature"]
        assert parser.num_calls == 1 and parsed.content == ""


def test_strip_texts_drop_special_tokens() -> None:
    parser = MistralParser(strip_texts=("</s>",))
    pieces = _TOKEN.findall(MISTRAL_V03 + "</s>")
    parsed = _streamed(parser, pieces)
    assert parsed.content == "" and len(parsed.calls) == 2
    assert MistralParser(strip_texts=("</s>",)).parse("Hi there</s>").content == "Hi there"


# --- choosing a parser ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{- '<tool_call>\\n{\"name\": ' }}", "hermes"),
        ("{{- '[AVAILABLE_TOOLS]' }}...{{- '[TOOL_CALLS]' }}", "mistral"),
        ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
        ('Respond in the format {"name": function name, "parameters": dictionary}', "llama3_json"),
        ({"default": "{{ messages }}", "tool_use": "<tool_call>"}, "hermes"),
        ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}", None),
        (None, None),
    ],
)
def test_detect_parser(template: object, expected: str | None) -> None:
    assert detect_parser(template) == expected  # type: ignore[arg-type]


def _tokenizer(template: str, special: list[str]) -> SimpleNamespace:
    return SimpleNamespace(chat_template=template, all_special_tokens=special)


def test_tool_parsing_choice() -> None:
    qwen = _tokenizer("<tool_call>", ["<|im_end|>", "<|endoftext|>"])
    auto = tool_parsing("auto", qwen, parallel_tool_calls=True, skip_special_tokens=True)
    assert auto is not None and auto.parser_cls is HermesParser
    assert not auto.keeps_special_tokens
    assert tool_parsing("none", qwen, parallel_tool_calls=True, skip_special_tokens=True) is None
    plain = _tokenizer("{{ messages }}", [])
    assert tool_parsing("auto", plain, parallel_tool_calls=True, skip_special_tokens=True) is None
    forced = tool_parsing("llama3_json", plain, parallel_tool_calls=False, skip_special_tokens=True)
    assert forced is not None and forced.parser_cls is Llama3JsonParser
    assert forced.new().parse(LLAMA32_TWO_CALLS).calls[0].name == "get_weather"


def test_special_marker_keeps_special_tokens_and_strips_the_others() -> None:
    mistral = _tokenizer("[TOOL_CALLS]", ["<s>", "</s>", "<unk>", "[TOOL_CALLS]", "[ARGS]"])
    parsing = tool_parsing("auto", mistral, parallel_tool_calls=True, skip_special_tokens=True)
    assert parsing is not None and parsing.keeps_special_tokens
    assert set(parsing.strip_texts) == {"<s>", "</s>", "<unk>"}
    assert _calls(parsing.new().parse(MISTRAL_V11 + "</s>"))[0] == (
        "get_weather",
        {"city": "Paris"},
    )
    # A request that keeps special tokens itself gets them as they are.
    kept = tool_parsing("auto", mistral, parallel_tool_calls=True, skip_special_tokens=False)
    assert kept is not None and not kept.keeps_special_tokens and kept.strip_texts == ()


# --- the schema of constrained tool calls -----------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]
WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
TIME = {"name": "get_time", "arguments": {}}


def _validator(schema: dict):
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    jsonschema_rs.meta.validate(schema)  # a valid JSON schema itself
    return jsonschema_rs.validator_for(schema)


def test_schema_for_required() -> None:
    validator = _validator(tool_call_schema(TOOLS, "required", parallel_tool_calls=True))
    assert validator.is_valid([WEATHER])
    assert validator.is_valid([WEATHER, TIME])
    assert not validator.is_valid([])  # at least one call
    assert not validator.is_valid([{"name": "get_wether", "arguments": {"city": "Paris"}}])
    assert not validator.is_valid([{"name": "get_weather", "arguments": {"unit": "celsius"}}])
    assert not validator.is_valid([{"name": "get_weather", "arguments": {"city": 3}}])
    assert not validator.is_valid([{**WEATHER, "extra": 1}])
    assert not validator.is_valid(WEATHER)  # an array, not one object


def test_schema_for_required_without_parallel_calls() -> None:
    validator = _validator(tool_call_schema(TOOLS, "required", parallel_tool_calls=False))
    assert validator.is_valid([TIME])
    assert not validator.is_valid([WEATHER, TIME])


def test_schema_for_a_named_function() -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    validator = _validator(tool_call_schema(TOOLS, choice, parallel_tool_calls=True))
    assert validator.is_valid(WEATHER)
    assert not validator.is_valid(TIME)  # another function
    assert not validator.is_valid({"name": "get_weather", "arguments": {"city": "Paris", "x": 1}})
    assert not validator.is_valid({"name": "get_weather"})


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_no_schema_for_auto_and_none(choice: str) -> None:
    assert tool_call_schema(TOOLS, choice, parallel_tool_calls=True) is None
