"""Structured output as the OpenAI API and vLLM ask for it, to `SamplingParams.structured_outputs`.

OpenAI's `response_format` (`text`, `json_object`, `json_schema` with `strict`), vLLM's
`structured_outputs` object (`json`, `json_object`, `regex`, `choice`, `grammar`) and its older
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` fields: at most one of them per
request. The constraint is compiled here, so a bad schema, regex or grammar is a 400 naming the
field and the problem before anything is queued.
"""

from __future__ import annotations

from typing import Any

from qiao.api.errors import APIError, as_api_error
from qiao.errors import ConfigError
from qiao.runner.grammar import KINDS, check_structured_outputs


def structured_outputs_of(req: Any) -> dict[str, Any] | None:
    """The request's one output constraint (None for free text); 400 for a bad or second one."""
    given: list[tuple[str, dict[str, Any]]] = []
    if req.response_format is not None:
        constraint = _response_format(req.response_format)
        if constraint is not None:
            given.append(("response_format", constraint))
    if req.structured_outputs is not None:
        given.append(("structured_outputs", _structured_object(req.structured_outputs)))
    for field in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        value = getattr(req, field)
        if value is not None:
            given.append((field, {field.removeprefix("guided_"): value}))
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise APIError(400, f"{names}: give one output constraint, not several", param=given[1][0])
    param, constraint = given[0]
    try:
        check_structured_outputs(constraint, param)
    except ConfigError as exc:
        raise as_api_error(exc) from None
    return constraint


def _response_format(value: dict[str, Any]) -> dict[str, Any] | None:
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | bool):
            raise APIError(
                400,
                "response_format.json_schema: must be an object with the JSON schema in "
                "'schema' (and a 'name')",
                param="response_format",
            )
        # No schema: any JSON object, as OpenAI reads it. `strict` or not, qiao enforces it.
        return {"json": spec.get("schema", {"type": "object"})}
    raise APIError(
        400,
        f"response_format.type: must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        param="response_format",
    )


def _structured_object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise APIError(400, "structured_outputs: must be an object", param="structured_outputs")
    present = {k: v for k, v in value.items() if k in KINDS and v not in (None, False)}
    if len(present) != 1:
        raise APIError(
            400,
            f"structured_outputs: give exactly one of {', '.join(KINDS)}",
            param="structured_outputs",
        )
    kind, spec = next(iter(present.items()))
    if kind == "json_object":
        return {"json_object": True}
    if kind == "choice" and not (
        isinstance(spec, list) and spec and all(isinstance(c, str) for c in spec)
    ):
        raise APIError(
            400, "structured_outputs.choice: must be a list of strings", param="structured_outputs"
        )
    if kind in ("regex", "grammar") and not isinstance(spec, str):
        raise APIError(
            400, f"structured_outputs.{kind}: must be a string", param="structured_outputs"
        )
    return {kind: spec}
