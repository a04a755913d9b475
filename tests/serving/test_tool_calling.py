"""Tool calling through the official `openai` client: tools and tool turns reach the chat
template, model output is parsed into `tool_calls` (whole and streamed), bad tool fields are 400s.

stories260K writes no tool calls, so the server here runs it with a Hermes-style chat template
(the parser `auto` picks hermes from it), and the parsing tests script the output text: the
engine generates as usual and each generated token's text is replaced by the next piece of a
recorded Qwen-style output.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from qiao.api.protocol import ChatCompletionRequest
from qiao.outputs import RequestOutput

from .conftest import InProcessServer, openai_client, serve_settings

MODEL = "stories-tools"

# A compact Hermes-style template (the shape of Qwen2.5's): tools as JSON in the system turn,
# an assistant's calls as <tool_call> blocks with `arguments | tojson` (so arguments must arrive
# as objects), tool results as <tool_response> blocks under a user turn.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    "<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{%- elif message.role == 'assistant' and message.tool_calls is defined %}"
    "<|im_start|>assistant\n{{ message.content }}"
    "{%- for call in message.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FOLLOW_UP = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_abc123",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_abc123", "content": '{"temperature_c": 21}'},
]
# A Qwen2.5-style answer, cut where a tokenizer would cut it.
CALL_PIECES = [
    "I", "'ll", " check", ".", "\n", "<tool_call>", "\n", '{"', "name", '":', ' "', "get", "_weather",
    '",', ' "', "arguments", '":', ' {"', "city", '":', ' "', "Paris", '"}}', "\n", "</tool_call>",
]  # fmt: skip
TWO_CALL_PIECES = [
    *CALL_PIECES,
    "\n",
    "<tool_call>",
    '\n{"name": "get_time", ',
    '"arguments": {}}',
    "\n</tool_call>",
]


@pytest.fixture(scope="module")
def tools_model_dir(stories_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """stories260K with the Hermes-style chat template."""
    target = tmp_path_factory.mktemp("tools") / MODEL
    shutil.copytree(stories_dir, target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = HERMES_TEMPLATE
    config_path.write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def server(tools_model_dir: Path) -> Iterator[InProcessServer]:
    server = InProcessServer(serve_settings(tools_model_dir))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(server: InProcessServer) -> Iterator[openai.OpenAI]:
    with openai_client(server.base_url) as c:
        yield c


class _ScriptedStream:
    """An engine stream whose outputs carry the script's text: the i-th generated token's text
    is `pieces[i]`, and a sample that ends with the script ends with "stop"."""

    def __init__(self, inner: Any, pieces: list[str]) -> None:
        self._inner, self._pieces = inner, pieces
        self._num_seen: dict[int, int] = {}

    def __aiter__(self) -> _ScriptedStream:
        return self

    async def __anext__(self) -> RequestOutput:
        output = await self._inner.__anext__()
        samples = []
        for sample in output.outputs:
            start = self._num_seen.get(sample.index, 0)
            end = start + len(sample.token_ids)
            self._num_seen[sample.index] = end
            text = "".join(self._pieces[start:end])
            reason = sample.finish_reason
            if reason == "length" and end == len(self._pieces):
                reason = "stop"
            samples.append(dataclasses.replace(sample, text=text, finish_reason=reason))
        return dataclasses.replace(output, outputs=samples)

    async def aclose(self, reason: str = "abort") -> None:
        await self._inner.aclose(reason)


@pytest.fixture
def script(server: InProcessServer, monkeypatch: pytest.MonkeyPatch) -> Any:
    """script(pieces) → the extra request fields that make the model 'write' them."""
    real = server.engine.generate_all
    current: list[str] = []

    def generate_all(requests: Any) -> list[Any]:
        return [_ScriptedStream(stream, current) for stream in real(requests)]

    monkeypatch.setattr(server.engine, "generate_all", generate_all)

    def use(pieces: list[str]) -> dict[str, Any]:
        current[:] = pieces
        return {"max_tokens": len(pieces), "extra_body": {"ignore_eos": True}}

    return use


# --- the prompt -------------------------------------------------------------------------------


def _render(tools_model_dir: Path, **body: Any) -> str:
    from qiao.api.openai_routes import render_chat

    tokenizer = AutoTokenizer.from_pretrained(str(tools_model_dir))
    request = ChatCompletionRequest(model=MODEL, **body)
    return tokenizer.decode(render_chat(request, tokenizer))


def test_prompt_holds_the_tools_and_the_tool_turns(tools_model_dir: Path) -> None:
    prompt = _render(tools_model_dir, messages=FOLLOW_UP, tools=TOOLS)
    # Each tool whole, as transformers hands tools to templates.
    for tool in TOOLS:
        assert json.dumps(tool, ensure_ascii=False) in prompt
    # The assistant's call with its arguments as an object (a string would be quoted again).
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert '<tool_response>\n{"temperature_c": 21}\n</tool_response>' in prompt
    assert prompt.rstrip().endswith("<|im_start|>assistant")


def test_prompt_without_tools_has_no_tool_block(tools_model_dir: Path) -> None:
    assert "<tools>" not in _render(tools_model_dir, messages=ASK)


# --- real generations -------------------------------------------------------------------------


def test_request_with_tools_and_the_follow_up_turn_are_answered(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert first.choices[0].finish_reason in ("stop", "length")
    assert isinstance(first.choices[0].message.content, str)
    follow_up = client.chat.completions.create(
        model=MODEL, messages=FOLLOW_UP, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert follow_up.choices[0].finish_reason in ("stop", "length")
    assert follow_up.choices[0].message.tool_calls is None
    stream = client.chat.completions.create(
        model=MODEL, messages=FOLLOW_UP, tools=TOOLS, max_tokens=8, temperature=0, stream=True
    )
    finishes = [c.choices[0].finish_reason for c in stream if c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])


# --- parsed output ----------------------------------------------------------------------------


def test_tool_call_in_the_answer(client: openai.OpenAI, script: Any) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, **script(CALL_PIECES)
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I'll check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_streamed_tool_call_deltas(client: openai.OpenAI, script: Any) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, stream=True, **script(TWO_CALL_PIECES)
    )
    content, calls, finishes, first_deltas = "", {}, [], {}
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:
                first_deltas[delta.index] = delta
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "args": ""}
            else:
                assert delta.id is None and delta.function.name is None
            calls[delta.index]["args"] += delta.function.arguments or ""
        if choice.finish_reason:
            finishes.append(choice.finish_reason)
    assert content == "I'll check."
    assert finishes == ["tool_calls"]
    assert sorted(calls) == [0, 1]
    for first in first_deltas.values():
        assert first.type == "function" and first.id.startswith("call_")
        assert first.function.arguments == ""
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_time"]
    assert [json.loads(c["args"]) for c in calls.values()] == [{"city": "Paris"}, {}]
    assert calls[0]["id"] != calls[1]["id"]


def test_parallel_tool_calls_false_answers_the_first_call(
    client: openai.OpenAI, script: Any
) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        parallel_tool_calls=False,
        **script(TWO_CALL_PIECES),
    )
    assert [c.function.name for c in response.choices[0].message.tool_calls] == ["get_weather"]


def test_tool_choice_none_leaves_the_output_as_text(client: openai.OpenAI, script: Any) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", **script(CALL_PIECES)
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == "".join(CALL_PIECES)


def test_required_without_a_call_is_text_with_stop(client: openai.OpenAI, script: Any) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", **script(["Sunny", "."])
    )
    choice = response.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("stop", "Sunny.")
    assert choice.message.tool_calls is None


def test_malformed_call_stays_content(client: openai.OpenAI, script: Any) -> None:
    broken = [
        "<tool_call>",
        '\n{"name": "get_weather", "arguments": {"city": "Paris"}\n',
        "</tool_call>",
    ]
    for stream in (False, True):
        response = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, stream=stream, **script(broken)
        )
        if stream:
            chunks = list(response)
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            assert not any(c.choices[0].delta.tool_calls for c in chunks)
            assert chunks[-1].choices[0].finish_reason == "stop"
        else:
            text = response.choices[0].message.content
            assert response.choices[0].finish_reason == "stop"
        assert text == "".join(broken)


# --- validation -------------------------------------------------------------------------------


def _function(**fields: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", **fields}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [_function(), _function()]}, "tools.1.function.name"),
        ({"tools": [_function(name="")]}, "tools.0.function.name"),
        ({"tools": [_function(name="get weather")]}, "tools.0.function.name"),
        ({"tools": [_function(parameters=["city"])]}, "tools.0.function.parameters"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
        ({"tools": [_function()], "tool_choice": "always"}, "tool_choice"),
        ({"tools": [_function()], "tool_choice": {"type": "function"}}, "tool_choice"),
        (
            {
                "tools": [_function()],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"messages": [*ASK, {"role": "tool", "content": "21 C"}]},
            "messages.1",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi", "tool_calls": FOLLOW_UP[1]["tool_calls"]}
                ]
            },
            "messages.0",
        ),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ],
)
def test_bad_tool_fields_are_400_naming_the_field(
    client: openai.OpenAI, fields: dict[str, Any], param: str
) -> None:
    body = {"messages": ASK, **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, max_tokens=4, **body)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param, caught.value.body
    assert caught.value.body["message"].startswith(param)


def test_unknown_tool_fields_are_ignored(client: openai.OpenAI) -> None:
    tool = {**TOOLS[0], "x_vendor": 1}
    tool["function"] = {**tool["function"], "x_hint": "fast"}
    response = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[tool], max_tokens=4, extra_body={"x_other": True}
    )
    assert response.choices[0].finish_reason in ("stop", "length")
