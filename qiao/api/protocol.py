"""OpenAI wire models: request bodies in, response bodies out. Kept apart from engine types.

Unknown request fields are ignored (OpenAI-compatible tools send fields we don't use); fields we
know are validated here, and the request's limits are checked in `qiao/api/limits.py`.
`template_messages` turns chat messages into what chat templates read.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields the completions and chat requests share (OpenAI's, then qiao's extensions)."""

    model: str
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # qiao / vLLM extensions
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    timeout: float | None = Field(
        None, gt=0.0, description="deadline for the whole request, seconds"
    )
    # Structured output (qiao/api/structured.py): OpenAI's, vLLM's object, vLLM's older fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: logprobs of the prompt tokens (top-k per position), returned as `prompt_logprobs`.
    prompt_logprobs: int | None = Field(None, ge=0)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo: score the prompt alone
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionDefinition(_Request):
    name: str = Field(
        pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="1 to 64 letters, digits, underscores and dashes (OpenAI's rule)",
    )
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="JSON schema of the arguments object"
    )
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(_Request):
    name: str
    arguments: str | dict[str, Any] = Field(description="JSON text of an object (or the object)")


class ToolCallItem(_Request):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise PydanticCustomError(
                "tool_call_id", "a message of role 'tool' needs the tool_call_id it answers"
            )
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError(
                "tool_calls",
                "only assistant messages carry tool_calls, not {role}",
                {"role": self.role},
            )
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = Field(
        None, description="default: auto with tools, none without"
    )
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, value: Any) -> Any:
        # One message naming the field, instead of one error per member of the union.
        if value is None or value in ("none", "auto", "required"):
            return value
        function = value.get("function") if isinstance(value, dict) else None
        if (
            isinstance(value, dict)
            and value.get("type") == "function"
            and isinstance(function, dict)
            and isinstance(function.get("name"), str)
        ):
            return value
        raise PydanticCustomError(
            "tool_choice",
            "must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
        )

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """`tool_choice`, defaulted as OpenAI does: auto with tools, none without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates read them (transformers' convention): `developer` as
    `system`; an assistant's `tool_calls` with their arguments as objects; a `tool` message
    with its `tool_call_id` and the `name` of the function that call named."""
    names: dict[str, str] = {}
    rendered = []
    for m in messages:
        message: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": m.text(),
        }
        if m.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments_object(call.function.arguments),
                    },
                }
                for call in m.tool_calls
            ]
            names.update((call.id, call.function.name) for call in m.tool_calls)
        if m.role == "tool":
            message["tool_call_id"] = m.tool_call_id
            name = m.name or names.get(m.tool_call_id or "")
            if name:
                message["name"] = name
        rendered.append(message)
    return rendered


def _arguments_object(arguments: str | dict[str, Any]) -> Any:
    """Arguments as an object when they are JSON text of one (templates write them with
    `tojson`); other text is passed on as it is."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "qiao"
    max_model_len: int | None = None
    # A LoRA adapter's base model (vLLM lists adapters so); None for a model.
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
