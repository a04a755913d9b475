"""The OpenAPI document at `/openapi.json`, describing the responses the server really gives.

FastAPI documents a 200 and its own 422 for every route; qiao never sends 422 (a body that fails
validation is a 400 in the error envelope) and does send other statuses from its middleware,
its limits and its engines. Here each operation gets the statuses it can answer with, each with
its body schema and media type: the OpenAI envelope on `/v1` and the health routes, the KServe
shape (`{"error": "..."}`) on `/v2`, Prometheus text on `/metrics`, SSE for streams. Schema-driven
clients and fuzzers (schemathesis) then agree with the server.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from qiao.api.middleware import PUBLIC_PATHS

_ENVELOPE = {"$ref": "#/components/schemas/ErrorResponse"}
_KSERVE_ERROR = {"$ref": "#/components/schemas/KServeError"}

_SCHEMAS: dict[str, Any] = {
    "ErrorResponse": {
        "title": "ErrorResponse",
        "description": "OpenAI's error envelope: what failed and which request field to fix.",
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    },
    "KServeError": {
        "title": "KServeError",
        "description": "The KServe v2 (Triton) error shape.",
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"type": "string"}},
    },
    "KServeReady": {
        "title": "KServeReady",
        "description": "A KServe v2 readiness answer (200 when ready, 400 when not).",
        "type": "object",
        "required": ["ready"],
        "properties": {"name": {"type": "string"}, "ready": {"type": "boolean"}},
    },
    "InferenceRequest": {
        "title": "InferenceRequest",
        "description": "A KServe v2 inference request with JSON tensors (binary tensors follow "
        "the JSON header when Inference-Header-Content-Length is set).",
        "type": "object",
        "required": ["inputs"],
        "properties": {
            "id": {"type": "string"},
            "parameters": {"type": "object"},
            "inputs": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["name", "shape", "datatype"],
                    "properties": {
                        "name": {"type": "string"},
                        "shape": {"type": "array", "items": {"type": "integer"}},
                        "datatype": {"type": "string"},
                        "parameters": {"type": "object"},
                        "data": {},
                    },
                },
            },
            "outputs": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {"name": {"type": "string"}, "parameters": {"type": "object"}},
                },
            },
        },
    },
}

# Why each status is sent, as the response's description.
_WHY = {
    400: "Bad request: a field, tensor or header is invalid (the message names it)",
    401: "Missing or invalid API key",
    404: "Unknown model, version, file or batch",
    409: "The batch's state does not allow this (e.g. cancelling a finished batch)",
    408: "The request passed its `timeout`",
    403: "This API key may not use the model",
    413: "Request body over --max-request-bytes",
    415: "Unsupported Content-Encoding",
    429: "A rate limit of this API key: retry after Retry-After",
    431: "Request headers too large",
    500: "Internal error (details in the server log only)",
    503: "Overloaded, draining, or the model is not ready: retry after Retry-After",
}

# Statuses beyond the ones every route may answer, by (method, path).
_ROUTE_STATUSES: dict[tuple[str, str], set[int]] = {
    ("post", "/v1/completions"): {404, 408, 503},
    ("post", "/v1/chat/completions"): {404, 408, 503},
    ("post", "/v1/embeddings"): {404, 503},
    ("get", "/v2/models/{model_name}"): {404, 503},
    ("get", "/v2/models/{model_name}/versions/{model_version}"): {404, 503},
    ("get", "/v2/models/{model_name}/ready"): {404},
    ("get", "/v2/models/{model_name}/versions/{model_version}/ready"): {404},
    ("get", "/v2/models/{model_name}/config"): {404, 503},
    ("get", "/v2/models/{model_name}/versions/{model_version}/config"): {404, 503},
    ("get", "/v2/models/stats"): {503},
    ("get", "/v2/models/{model_name}/stats"): {404, 503},
    ("get", "/v2/models/{model_name}/versions/{model_version}/stats"): {404, 503},
    ("post", "/v2/models/{model_name}/infer"): {404, 415, 503},
    ("post", "/v2/models/{model_name}/versions/{model_version}/infer"): {404, 415, 503},
    ("get", "/health/ready"): {503},
    ("get", "/health"): {503},
    ("get", "/ping"): {503},
    ("get", "/v1/models/{model_id}"): {404},
    ("get", "/v1/files/{file_id}"): {404},
    ("get", "/v1/files/{file_id}/content"): {404},
    ("delete", "/v1/files/{file_id}"): {404},
    ("post", "/v1/batches"): {404},
    ("get", "/v1/batches/{batch_id}"): {404},
    ("post", "/v1/batches/{batch_id}/cancel"): {404, 409},
}


def install_openapi(app: FastAPI, *, api_keys: bool) -> None:
    """Serve this document as `app.openapi()` (401s are listed when API keys are required)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            describe_responses(doc, api_keys=api_keys)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def describe_responses(doc: dict[str, Any], *, api_keys: bool) -> None:
    """Rewrite every operation's responses in `doc` to what the server sends."""
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    schemas.update(_SCHEMAS)
    for path, operations in doc.get("paths", {}).items():
        for method, operation in operations.items():
            _describe(path, method, operation, api_keys=api_keys)


def _describe(path: str, method: str, operation: dict[str, Any], *, api_keys: bool) -> None:
    kserve = path.startswith("/v2")
    error = _KSERVE_ERROR if kserve else _ENVELOPE
    statuses = {400, 431, 500} | _ROUTE_STATUSES.get((method, path), set())
    if api_keys and path not in PUBLIC_PATHS:
        statuses.add(401)
        if method == "post":
            statuses.add(429)  # a named key's rate limits
        if (method, path) in _ROUTE_STATUSES and 404 in _ROUTE_STATUSES[(method, path)]:
            statuses.add(403)  # a named key's model list
    if method == "post":
        statuses.add(413)
    responses: dict[str, Any] = {"200": _success(path, method, operation)}
    for status in sorted(statuses):
        responses[str(status)] = _error_response(status, error)
    if kserve and path.endswith("/ready"):
        ready_or_error = {"oneOf": [{"$ref": "#/components/schemas/KServeReady"}, error]}
        responses["400"] = {
            "description": "Not ready, or a bad request",
            "content": {"application/json": {"schema": ready_or_error}},
        }
    if kserve and path.endswith("/infer"):
        operation["requestBody"] = {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/InferenceRequest"}}
            },
        }
    operation["responses"] = responses


def _success(path: str, method: str, operation: dict[str, Any]) -> dict[str, Any]:
    response = operation.get("responses", {}).get("200", {"description": "Successful Response"})
    content = response.setdefault("content", {})
    if path == "/metrics":
        response["content"] = {"text/plain": {"schema": {"type": "string"}}}
        response["description"] = "Prometheus text exposition format"
    elif path in ("/v1/completions", "/v1/chat/completions"):
        # Server-sent events, the schema describing each event: its data is one JSON chunk (or
        # an error envelope), and the last one the literal [DONE].
        content["text/event-stream"] = {
            "schema": {
                "type": "object",
                "required": ["data"],
                "properties": {"data": {"type": "string"}},
            }
        }
        response["description"] = "The response, or an SSE stream of chunks when `stream` is true"
    elif path == "/v1/files/{file_id}/content":
        response["content"] = {"application/octet-stream": {"schema": {"type": "string"}}}
        response["description"] = "The file's content"
    elif path.endswith("/infer"):
        content["application/octet-stream"] = {"schema": {"type": "string", "format": "binary"}}
        response["description"] = (
            "The outputs as JSON, or a JSON header and binary tensors (Inference-Header-Content-"
            "Length says where the JSON ends) when binary outputs are asked for"
        )
    return response


def _error_response(status: int, schema: dict[str, Any]) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": _WHY[status],
        "content": {"application/json": {"schema": schema}},
    }
    if status in (429, 503):
        response["headers"] = {
            "Retry-After": {"description": "Seconds to wait", "schema": {"type": "string"}}
        }
    return response
