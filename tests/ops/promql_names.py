"""The metric names a PromQL expression reads, for checking shipped rules and dashboards against
what qiao exports.

A small tokenizer, not a parser: it walks the expression once and keeps the identifiers that
stand where a series name can stand. Skipped: function and aggregation names (an identifier
followed by `(`, or by `by`/`without`), label matchers (`{...}`; a `__name__="x"` matcher inside one is kept), range
and subquery brackets (`[5m]`, `[1h:5m]`), the label lists of `by`/`without`/`on`/`ignoring`/
`group_left`/`group_right`, keywords and set operators, strings, numbers, durations (`offset
5m`) and Grafana's `$variables`.

E.g. `sum by (le) (rate(qiao:ttft_bucket{model_name=~"$m"}[5m])) / on(le) x offset 1h`
-> {"qiao:ttft_bucket", "x"}.
"""

from __future__ import annotations

import re

# One alternative per token kind, tried in this order at each position.
_TOKEN = re.compile(
    r"""
    (?P<space>\s+|\#[^\n]*)
    | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
    | (?P<variable>\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*)
    | (?P<duration>(?:\d+(?:ms|[smhdwy]))+(?![A-Za-z0-9_:]))
    | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
    | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
    | (?P<open>[({\[])
    | (?P<close>[)}\]])
    | (?P<other>.)
    """,
    re.VERBOSE | re.DOTALL,
)

# Words that are never series names where they stand (PromQL keywords are case-insensitive).
KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "inf", "nan", "start", "end"}
    | {"by", "without", "on", "ignoring", "group_left", "group_right"}
)
# Keywords followed by a parenthesised list of label names, not of expressions.
_LABEL_LIST_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})


def tokenize(expr: str) -> list[tuple[str, str]]:
    """`expr` as (kind, text) pairs, whitespace and comments dropped."""
    tokens = []
    for match in _TOKEN.finditer(expr):
        kind = match.lastgroup or "other"
        if kind != "space":
            tokens.append((kind, match.group()))
    return tokens


def metric_names(expr: str) -> set[str]:
    """The series names `expr` selects."""
    return {name for name, _ in selectors(expr)}


Matcher = tuple[str, str, str]  # (label, operator, value): ("status", "=~", "5..")


def selectors(expr: str) -> list[tuple[str, list[Matcher]]]:
    """Each series selector of `expr`: its name and its label matchers, in order.
    E.g. `rate(x{a="1"}[5m]) / y` -> [("x", [("a", "=", "1")]), ("y", [])]."""
    tokens = tokenize(expr)
    found: list[tuple[str, list[Matcher]]] = []
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        if kind == "open" and text == "{":  # no name before it: `{__name__="x", ...}`
            end = _closing(tokens, i)
            matchers = _matchers(tokens[i + 1 : end])
            others = [m for m in matchers if m[0] != "__name__"]
            found += [(m[2], others) for m in matchers if m[:2] == ("__name__", "=")]
            i = end + 1
            continue
        if kind == "open" and text == "[":
            i = _closing(tokens, i) + 1
            continue
        if kind == "ident":
            word = text.lower()
            following = tokens[i + 1] if i + 1 < len(tokens) else ("", "")
            if word in _LABEL_LIST_KEYWORDS and following == ("open", "("):
                i = _closing(tokens, i + 1) + 1
                continue
            # A name followed by `(`, or by `by (`/`without (`, is a function or aggregation.
            is_call = following == ("open", "(") or (
                following[0] == "ident" and following[1].lower() in ("by", "without")
            )
            if not is_call and word not in KEYWORDS:
                matchers: list[Matcher] = []
                if following == ("open", "{"):
                    end = _closing(tokens, i + 1)
                    matchers = _matchers(tokens[i + 2 : end])
                    i = end
                found.append((text, matchers))
        i += 1
    return found


def _matchers(tokens: list[tuple[str, str]]) -> list[Matcher]:
    """The tokens between a selector's braces -> (label, operator, value) triples."""
    matchers = []
    label, operator = "", ""
    for kind, text in tokens:
        if kind == "ident" and not label:
            label = text
        elif kind == "string":
            matchers.append((label, operator, text[1:-1]))
            label, operator = "", ""
        elif kind == "other" and text != ",":
            operator += text
    return matchers


def _closing(tokens: list[tuple[str, str]], start: int) -> int:
    """The index of the bracket closing the one at `start` (the last token if unclosed)."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(tokens)):
        kind, text = tokens[i]
        if kind == "open":
            stack.append(pairs[text])
        elif kind == "close" and stack and text == stack[-1]:
            stack.pop()
            if not stack:
                return i
    return len(tokens) - 1
