"""Tool calls in model output: per-family parsers, fed whole or in stream deltas.

Each family writes its calls in its own markup:

- `hermes` (Qwen2.5, Qwen3, Hermes): one block per call,
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; text outside them is content.
- `llama3_json` (Llama 3.1 / 3.2): the whole output is `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`, several separated by `;`; output that does not start with a
  call is content.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
  `[TOOL_CALLS]name[ARGS]{...}` once per call; text before the marker is content.

A parser is incremental: `feed` takes each new piece of text and returns the content and the
complete calls it can now tell apart; `finish` flushes the rest. Text that may be the start of a
marker is held back, so markup never reaches content. A call is returned once its JSON is
complete, so a streamed call's arguments arrive as one fragment, always whole JSON, and a stream
ends with exactly what `parse` returns for the same text, however it was cut. A call region that
is not valid JSON of the family's shape (a truncated output, say) stays content. Whitespace that
touches a call region is dropped from the content.

`tool_call_schema` is the JSON schema the output must match when `tool_choice` is `required` or
names a function: the constrained-decoding half of those choices (see its docstring).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

PARSER_NAMES = ("hermes", "llama3_json", "mistral")

_DECODER = json.JSONDecoder(strict=False)  # models write raw newlines inside strings (code)
_NOT_WS = re.compile(r"\S")
_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.:-]*")
_CLOSING = re.compile(r"[}\]]")


@dataclass
class ToolCall:
    """One parsed call, in OpenAI's terms: `arguments` is JSON text of an object."""

    index: int
    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ParsedText:
    """What a piece of output holds: content text and complete tool calls."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __add__(self, other: ParsedText) -> ParsedText:
        return ParsedText(self.content + other.content, self.calls + other.calls)


def _skip_ws(text: str, pos: int) -> int:
    match = _NOT_WS.search(text, pos)
    return match.start() if match else len(text)


def _held_from(text: str, start: int, markers: tuple[str, ...]) -> int:
    """Where the end of `text[start:]` may begin one of `markers` (len(text) when it cannot)."""
    longest = max(len(m) for m in markers)
    for i in range(max(start, len(text) - longest + 1), len(text)):
        tail = text[i:]
        if any(m.startswith(tail) for m in markers):
            return i
    return len(text)


def _call_fields(value: Any, needs_arguments: bool) -> tuple[str, str] | None:
    """(name, arguments JSON) of a call object `{"name", "arguments" | "parameters"}`; None
    when `value` is not one. Arguments given as a JSON string holding an object are accepted;
    missing ones are `{}` unless `needs_arguments`."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return None
    if needs_arguments and "arguments" not in value and "parameters" not in value:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args, strict=False)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)


def _calls_in(value: Any, needs_arguments: bool = False) -> list[tuple[str, str]] | None:
    """The calls of a call object or a list of them; None unless every item is one."""
    items = value if isinstance(value, list) else [value]
    calls = [_call_fields(item, needs_arguments) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


class ToolCallParser(ABC):
    """One choice's output → content and tool calls. Use a fresh parser per choice."""

    markers: ClassVar[tuple[str, ...]]  # text that opens a call region
    markup: ClassVar[tuple[str, ...]]  # every marker the parser reads
    required_markers: ClassVar[tuple[str, ...]]  # must reach the text for calls to parse
    # Whether a call object must name its arguments (markup-less JSON could be an answer).
    needs_arguments: ClassVar[bool] = False

    def __init__(self, strip_texts: tuple[str, ...] = (), parallel_tool_calls: bool = True) -> None:
        # Special tokens to drop (the output is decoded with them when a marker is one).
        self._strip_texts = tuple(t for t in strip_texts if t)
        self._parallel = parallel_tool_calls
        self._raw_tail = ""  # may be the start of a strip text
        self._buf = ""
        self._pos = 0  # self._buf[:self._pos] is consumed
        self._out = ParsedText()
        self._num_calls = 0
        self._held_ws = ""  # trailing whitespace of the content, dropped if a call follows
        self._after_call = False
        self._tried_len = -1  # buffer length at the last JSON decode that found no value

    @property
    def num_calls(self) -> int:
        return min(self._num_calls, 1) if not self._parallel else self._num_calls

    def feed(self, text: str) -> ParsedText:
        """Content and complete calls that `text` (the next piece of output) makes certain."""
        self._buf += self._strip(text, final=False)
        self._advance(final=False)
        return self._take()

    def finish(self) -> ParsedText:
        """Everything still held, once the output is complete."""
        self._buf += self._strip("", final=True)
        self._advance(final=True)
        if not self._after_call:
            self._out.content += self._held_ws
        self._held_ws = ""
        return self._take()

    def parse(self, text: str) -> ParsedText:
        """A whole output at once (on a fresh parser)."""
        return self.feed(text) + self.finish()

    @abstractmethod
    def _advance(self, final: bool) -> None:
        """Consume `self._buf` from `self._pos` as far as it can be told apart."""

    def new_call_id(self) -> str:
        return f"call_{secrets.token_hex(12)}"

    # --- helpers for the families --------------------------------------------------------------

    def _content(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        body = text.rstrip()
        if body:
            self._out.content += self._held_ws + body
            self._held_ws = text[len(body) :]
        else:
            self._held_ws += text

    def _calls(self, calls: list[tuple[str, str]]) -> None:
        self._held_ws, self._after_call = "", True
        for name, arguments in calls:
            if self._parallel or self._num_calls == 0:
                self._out.calls.append(
                    ToolCall(self._num_calls, self.new_call_id(), name, arguments)
                )
            self._num_calls += 1

    def _region(self, end: int, value: Any) -> None:
        """The call region `self._buf[self._pos:end]` decoded to `value`: calls, or content when
        it is not of the call shape."""
        calls = _calls_in(value, self.needs_arguments)
        if calls is None:
            self._content(self._buf[self._pos : end])
        else:
            self._calls(calls)
        self._pos = end

    def _content_until_marker(self, final: bool) -> int | None:
        """Emit content up to the next marker and return its index; None when there is none
        (the content is then emitted up to any held tail)."""
        starts = [i for i in (self._buf.find(m, self._pos) for m in self.markers) if i >= 0]
        if starts:
            start = min(starts)
            self._content(self._buf[self._pos : start])
            self._pos = start
            return start
        end = len(self._buf) if final else _held_from(self._buf, self._pos, self.markers)
        self._content(self._buf[self._pos : end])
        self._pos = end
        return None

    def _decode(self, pos: int, final: bool) -> tuple[Any, int] | None:
        """The JSON value at `pos` and its end; None while it is incomplete or invalid. Retried
        only once a closing bracket arrived since the last try."""
        buf = self._buf
        if not final and self._tried_len >= 0 and not _CLOSING.search(buf, self._tried_len):
            return None
        try:
            value, end = _DECODER.raw_decode(buf, pos)
        except ValueError:
            self._tried_len = len(buf)
            return None
        self._tried_len = -1
        return value, end

    def _strip(self, text: str, final: bool) -> str:
        if not self._strip_texts:
            return text
        text = self._raw_tail + text
        for token in self._strip_texts:
            text = text.replace(token, "")
        keep = len(text) if final else _held_from(text, 0, self._strip_texts)
        self._raw_tail = text[keep:]
        return text[:keep]

    def _take(self) -> ParsedText:
        out, self._out = self._out, ParsedText()
        return out


class HermesParser(ToolCallParser):
    """`<tool_call>{json}</tool_call>` blocks anywhere in the output (Qwen2.5, Qwen3, Hermes)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    markers = (OPEN,)
    markup = required_markers = (OPEN, CLOSE)

    def _advance(self, final: bool) -> None:
        while self._content_until_marker(final) is not None:
            body = self._pos + len(self.OPEN)
            close = self._buf.find(self.CLOSE, body)
            if close < 0 and not final:
                return
            end = len(self._buf) if close < 0 else close + len(self.CLOSE)
            inner = self._buf[body : end if close < 0 else close].strip()
            try:
                value = _DECODER.decode(inner)
            except ValueError:
                value = None
            self._region(end, value)


class Llama3JsonParser(ToolCallParser):
    """Llama 3.x JSON calls: the output is `{"name", "parameters"}` objects joined by `;`
    (a JSON list of them is taken too), optionally after `<|python_tag|>`."""

    TAG = "<|python_tag|>"
    markup = markers = (TAG,)
    required_markers = ()
    needs_arguments = True

    def __init__(self, strip_texts: tuple[str, ...] = (), parallel_tool_calls: bool = True) -> None:
        super().__init__(strip_texts, parallel_tool_calls)
        self._state = "start"  # start → calls ⇄ separator → content

    def _advance(self, final: bool) -> None:
        if self._state == "start" and not self._start(final):
            return
        buf = self._buf
        while self._state in ("calls", "separator"):
            i = _skip_ws(buf, self._pos)
            if i == len(buf):
                return
            if self._state == "separator":
                if buf[i] != ";":
                    self._state = "content"
                    break
                self._pos, self._state = i + 1, "calls"
                continue
            decoded = self._decode(i, final) if buf[i] in "{[" else None
            if decoded is None and not final and buf[i] in "{[":
                return
            if decoded is None or _calls_in(decoded[0], needs_arguments=True) is None:
                self._state = "content"
                break
            self._pos = i
            self._region(decoded[1], decoded[0])
            self._state = "separator"
        if self._state == "content":
            self._content(buf[self._pos :])
            self._pos = len(buf)

    def _start(self, final: bool) -> bool:
        """Decide whether the output holds calls (it starts with JSON); False while unknown."""
        buf = self._buf
        i = _skip_ws(buf, 0)
        if buf.startswith(self.TAG, i):
            self._pos = i + len(self.TAG)  # the tag is markup, never content
            i = _skip_ws(buf, self._pos)
        elif not final and self.TAG.startswith(buf[i:]):
            return False  # nothing yet, or the start of the tag
        if i == len(buf) and not final:
            return False
        self._state = "calls" if i < len(buf) and buf[i] in "{[" else "content"
        return True


class MistralParser(ToolCallParser):
    """`[TOOL_CALLS][{json}, ...]` or `[TOOL_CALLS]name[ARGS]{json}` (Mistral, Mixtral)."""

    MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
    markers = required_markers = (MARKER,)
    markup = (MARKER, ARGS)
    _ID_CHARS = string.ascii_letters + string.digits

    def new_call_id(self) -> str:
        # Mistral's chat templates accept only 9 alphanumeric characters in the follow-up turn.
        return "".join(secrets.choice(self._ID_CHARS) for _ in range(9))

    def _advance(self, final: bool) -> None:
        while self._content_until_marker(final) is not None:
            i = _skip_ws(self._buf, self._pos + len(self.MARKER))
            if i == len(self._buf):
                if final:
                    self._content(self._buf[self._pos :])
                    self._pos = len(self._buf)
                return
            if not self._region_at(i, final):
                return

    def _region_at(self, i: int, final: bool) -> bool:
        """Consume the call region whose payload starts at `i`; False while it is incomplete."""
        buf = self._buf
        if buf[i] == "[":
            decoded = self._decode(i, final)
            if decoded is not None:
                self._region(decoded[1], decoded[0])
                return True
        else:
            name_end = _MISTRAL_NAME.match(buf, i).end()
            if buf.startswith(self.ARGS, name_end) and name_end > i:
                j = _skip_ws(buf, name_end + len(self.ARGS))
                decoded = self._decode(j, final) if j < len(buf) else None
                if decoded is not None:
                    value, end = decoded
                    self._region(end, {"name": buf[i:name_end], "arguments": value})
                    return True
            elif name_end < len(buf) and not self.ARGS.startswith(buf[name_end:]):
                final = True  # neither a name nor the [ARGS] that ends one: not a call
        if final:
            self._content(buf[self._pos :])
            self._pos = len(buf)
            return True
        return False


PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def detect_parser(chat_template: str | dict | None) -> str | None:
    """The family a chat template writes tool calls in; None when it shows none."""
    if isinstance(chat_template, dict):  # named templates (e.g. "default" and "tool_use")
        chat_template = "\n".join(str(t) for t in chat_template.values())
    text = chat_template or ""
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or '"parameters"' in text:
        return "llama3_json"
    return None


@dataclass(frozen=True)
class ToolParsing:
    """How one request's outputs are parsed: a parser class and its settings, a new parser per
    choice (`new`)."""

    parser_cls: type[ToolCallParser]
    parallel_tool_calls: bool = True
    # True when a marker is a special token the detokenizer would skip: the request then keeps
    # special tokens, and the parser drops the others (`strip_texts`: EOS text and the like).
    keeps_special_tokens: bool = False
    strip_texts: tuple[str, ...] = ()

    def new(self) -> ToolCallParser:
        return self.parser_cls(self.strip_texts, self.parallel_tool_calls)


def tool_parsing(
    setting: str, tokenizer: Any, *, parallel_tool_calls: bool, skip_special_tokens: bool
) -> ToolParsing | None:
    """The parsing `--tool-call-parser` asks for (`auto`: from the tokenizer's chat template)
    for a request with tools; None: outputs are not parsed."""
    name = (
        detect_parser(getattr(tokenizer, "chat_template", None)) if setting == "auto" else setting
    )
    if name not in PARSERS:
        return None
    parser_cls = PARSERS[name]
    special = set(getattr(tokenizer, "all_special_tokens", ()))
    if not (skip_special_tokens and special & set(parser_cls.required_markers)):
        return ToolParsing(parser_cls, parallel_tool_calls)
    strip = sorted(special - set(parser_cls.markup), key=len, reverse=True)
    return ToolParsing(parser_cls, parallel_tool_calls, True, tuple(strip))


# --- constrained decoding ---------------------------------------------------------------------


def tool_call_schema(
    tools: list[dict[str, Any]], tool_choice: str | dict[str, Any], parallel_tool_calls: bool
) -> dict[str, Any] | None:
    """The JSON schema a constrained output must match, or None when the choice constrains
    nothing (`auto`, `none`).

    `tools` and `tool_choice` are the request's wire values. For `required`: an array of one or
    more (exactly one without `parallel_tool_calls`) `{"name": <a listed name>, "arguments":
    <that tool's parameters schema>}` objects; for a named function: one such object for it.
    Output under this schema is plain JSON, not the family's markup: its calls come from
    `json.loads` of the whole output, not from the family's parser.
    """
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if isinstance(tool_choice, dict):
        return _call_schema(functions[tool_choice["function"]["name"]])
    if tool_choice != "required":
        return None
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": [_call_schema(f) for f in functions.values()]},
    }
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "const": function["name"]},
            "arguments": function.get("parameters") or {"type": "object", "properties": {}},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
