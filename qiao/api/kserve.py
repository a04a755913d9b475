"""KServe v2 (Open Inference Protocol, Triton's HTTP API) under `/v2`: health, metadata, infer,
and Triton's extensions: model configuration (`/models/{m}[/versions/{v}]/config`), statistics
(`/models/stats`, `/models/{m}[/versions/{v}]/stats`; both built in `kserve_reports`, which the
gRPC service serializes too) and the repository index (`POST /repository/index`, the management
listener's rows, read-only: load and unload stay on that listener).

Routes are written against `request.app.state.router` (a `ModelRouter`) only. `infer` takes JSON
tensors and the binary tensor data extension (`Inference-Header-Content-Length`: the JSON header,
then each input's bytes in input order), and answers binary outputs the same way when asked
(`parameters.binary_data` per output, or `binary_data_output` for all), as tritonclient.http does
by default.

Errors use the protocol's shape, `{"error": "<message>"}`, not the OpenAI envelope of the other
routes: 400 for a bad request or tensor (the message names it), 404 for an unknown model or
version, 503 when overloaded or unavailable, 500 for anything unexpected (logged here; the body
says nothing more).

Readiness follows the protocol: 200 for ready, 4xx for not (400; 404 for an unknown model), since
tritonclient's `is_server_ready` / `is_model_ready` test for 200.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from qiao.api import response_cache
from qiao.api.errors import as_api_error
from qiao.api.keys import check_model_allowed, priority_for
from qiao.api.kserve_reports import model_config, model_statistics
from qiao.api.kserve_tensors import (
    EXTENSIONS,
    SERVER_NAME,
    TensorHeader,
    check_inputs,
    check_outputs,
    datatype_of,
    from_json,
    from_raw,
    is_model_ready,
    metadata_version,
    parse_header,
    parse_options,
    select_outputs,
    spec_json,
    to_json,
    to_raw,
)
from qiao.api.management import parse_index_body, v2_index_rows
from qiao.api.middleware import decimal
from qiao.errors import ConfigError, ModelNotFoundError
from qiao.repository.types import ModelControl, ModelRouter, ServedVersion
from qiao.version import __version__

HEADER_LENGTH = "Inference-Header-Content-Length"


def error_response(exc: Exception) -> JSONResponse:
    """`{"error": message}` with the status (and Retry-After) the exception maps to."""
    if isinstance(exc, StarletteHTTPException):  # e.g. 413 from the body-size limit
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        return JSONResponse({"error": message}, status_code=exc.status_code)
    error = as_api_error(exc)  # logs anything unexpected and answers a generic 500
    return JSONResponse(
        {"error": error.message}, status_code=error.status_code, headers=error.headers
    )


class _KServeRoute(APIRoute):
    """Answers every failure of a `/v2` route in the KServe error shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:
                return error_response(exc)

        return handle


router = APIRouter(prefix="/v2", route_class=_KServeRoute)


def _model_router(request: Request) -> ModelRouter:
    return request.app.state.router


def _control(request: Request) -> ModelControl:
    control = getattr(request.app.state, "control", None)
    if control is None:
        raise ModelNotFoundError("this server has no model repository")
    return control


# --- server -------------------------------------------------------------------------------------


@router.get("")
async def server_metadata() -> dict[str, Any]:
    return {"name": SERVER_NAME, "version": __version__, "extensions": list(EXTENSIONS)}


@router.get("/health/live")
async def server_live() -> dict[str, bool]:
    return {"live": True}


@router.get("/health/ready")
async def server_ready(request: Request) -> JSONResponse:
    """Every model that should serve is ready, and the server is not draining."""
    draining = getattr(request.app.state, "draining", False)
    is_ready = _model_router(request).is_ready() and not draining
    return JSONResponse({"ready": is_ready}, status_code=200 if is_ready else 400)


# --- repository, statistics (before /models/{model_name}, which would take "stats") ------------


@router.post("/repository/index")
async def repository_index(request: Request) -> list[dict[str, str]]:
    """The management listener's index, read-only: load and unload stay on that listener."""
    ready = await parse_index_body(request)
    return v2_index_rows(_control(request), ready=ready)


@router.get("/models/stats")
async def all_stats(request: Request) -> dict[str, Any]:
    return model_statistics(_model_router(request), None, None)


@router.get("/models/{model_name}/stats")
async def model_stats(request: Request, model_name: str) -> dict[str, Any]:
    return model_statistics(_model_router(request), model_name, None)


@router.get("/models/{model_name}/versions/{model_version}/stats")
async def version_stats(request: Request, model_name: str, model_version: str) -> dict[str, Any]:
    return model_statistics(_model_router(request), model_name, model_version)


# --- models -------------------------------------------------------------------------------------


@router.get("/models/{model_name}/config")
async def model_configuration(request: Request, model_name: str) -> dict[str, Any]:
    return model_config(_model_router(request), model_name, None)


@router.get("/models/{model_name}/versions/{model_version}/config")
async def version_configuration(
    request: Request, model_name: str, model_version: str
) -> dict[str, Any]:
    return model_config(_model_router(request), model_name, model_version)


@router.get("/models/{model_name}")
async def model_metadata(request: Request, model_name: str) -> dict[str, Any]:
    return _metadata(_model_router(request), model_name, None)


@router.get("/models/{model_name}/versions/{model_version}")
async def version_metadata(request: Request, model_name: str, model_version: str) -> dict[str, Any]:
    return _metadata(_model_router(request), model_name, model_version)


@router.get("/models/{model_name}/ready")
async def model_ready(request: Request, model_name: str) -> JSONResponse:
    return _ready(_model_router(request), model_name, None)


@router.get("/models/{model_name}/versions/{model_version}/ready")
async def version_ready(request: Request, model_name: str, model_version: str) -> JSONResponse:
    return _ready(_model_router(request), model_name, model_version)


@router.post("/models/{model_name}/infer")
async def model_infer(request: Request, model_name: str) -> Response:
    return await _infer(request, model_name, None)


@router.post("/models/{model_name}/versions/{model_version}/infer")
async def version_infer(request: Request, model_name: str, model_version: str) -> Response:
    return await _infer(request, model_name, model_version)


def _metadata(model_router: ModelRouter, model: str, version: str | None) -> dict[str, Any]:
    served, versions = metadata_version(model_router, model, version)
    return {
        "name": model,
        "versions": versions,
        "platform": served.platform,
        "inputs": [spec_json(spec) for spec in served.inputs],
        "outputs": [spec_json(spec) for spec in served.outputs],
    }


def _ready(model_router: ModelRouter, model: str, version: str | None) -> JSONResponse:
    is_ready = is_model_ready(model_router, model, version)  # unknown: raises, 404
    return JSONResponse({"name": model, "ready": is_ready}, status_code=200 if is_ready else 400)


# --- infer --------------------------------------------------------------------------------------


async def _infer(request: Request, model: str, version: str | None) -> Response:
    payload, binary = await _read_body(request)
    parameters = _object(payload.get("parameters"), "parameters")
    options = parse_options(parameters)
    check_model_allowed(request, model)
    served = _model_router(request).get(model, version, user=options.user)
    cache = await response_cache.lookup(
        request,
        served,
        "kserve.infer",
        lambda: response_cache.kserve_fields(payload, binary),
        skip=response_cache.kserve_skip_requested(payload),
    )
    if cache.hit is not None:
        return cache.hit_response()
    entries = payload.get("inputs")
    if not isinstance(entries, list) or not entries:
        raise ConfigError("'inputs' must be a non-empty list")
    headers = [_input_header(entry) for entry in entries]
    check_inputs(served, headers)
    default_binary = parameters.get("binary_data_output") is True
    binary_outputs = _requested_outputs(payload.get("outputs"), default_binary)
    requested = check_outputs(served, binary_outputs)
    inputs = _decode_inputs(entries, headers, binary)
    priority = priority_for(request, options.priority)
    results = await served.infer(inputs, priority=priority, timeout_us=options.timeout_us)
    selected = select_outputs(served, results, requested)
    binary_names = {n for n in (requested or results) if binary_outputs.get(n, default_binary)}
    return await cache.respond(_infer_response(served, payload.get("id"), selected, binary_names))


async def _read_body(request: Request) -> tuple[dict[str, Any], bytes]:
    """The JSON inference header and the binary data after it."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":
        raise StarletteHTTPException(
            415, f"Content-Encoding {encoding!r} is not supported; send the body uncompressed"
        )
    body = await request.body()
    header_length = request.headers.get(HEADER_LENGTH)
    if header_length is None:
        json_part, binary = body, b""
    else:
        json_length = decimal(header_length)
        if json_length is None or json_length > len(body):
            raise ConfigError(
                f"{HEADER_LENGTH} must be an integer no larger than the body ({len(body)} bytes)"
            )
        json_part, binary = body[:json_length], body[json_length:]
    try:
        payload = json.loads(json_part)
    except (ValueError, RecursionError):
        raise ConfigError("the inference request is not valid JSON") from None
    if not isinstance(payload, dict):
        raise ConfigError("the inference request must be a JSON object")
    request_id = payload.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise ConfigError("'id' must be a string")
    return payload, binary


def _object(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{what} must be a JSON object")
    return value


def _input_header(entry: Any) -> TensorHeader:
    if not isinstance(entry, dict):
        raise ConfigError("every entry of 'inputs' must be a JSON object")
    return parse_header(entry.get("name"), entry.get("datatype"), entry.get("shape"))


def _requested_outputs(entries: Any, default_binary: bool) -> dict[str, bool]:
    """Requested output name → whether to send it as binary data (in request order)."""
    if entries is None:
        return {}
    if not isinstance(entries, list):
        raise ConfigError("'outputs' must be a list")
    binary: dict[str, bool] = {}
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ConfigError("every entry of 'outputs' must be an object with a 'name'")
        name = entry["name"]
        parameters = _object(entry.get("parameters"), f"output {name!r} parameters")
        unsupported = [
            k for k in parameters if k == "classification" or k.startswith("shared_memory")
        ]
        if unsupported:
            raise ConfigError(f"output {name!r}: parameter {unsupported[0]!r} is not supported")
        value = parameters.get("binary_data", default_binary)
        if not isinstance(value, bool):
            raise ConfigError(f"output {name!r}: parameters.binary_data must be true or false")
        binary[name] = value
    return binary


def _decode_inputs(
    entries: list[dict[str, Any]], headers: list[TensorHeader], binary: bytes
) -> dict[str, np.ndarray]:
    """Each input from its `data`, or from the next `binary_data_size` bytes of binary data."""
    inputs: dict[str, np.ndarray] = {}
    offset = 0
    for entry, header in zip(entries, headers, strict=True):
        name = header.name
        parameters = _object(entry.get("parameters"), f"input {name!r} parameters")
        if any(key.startswith("shared_memory") for key in parameters):
            raise ConfigError(f"input {name!r}: shared memory is not supported; send the data")
        size = parameters.get("binary_data_size")
        if size is None:
            if "data" not in entry:
                raise ConfigError(f"input {name!r} has neither 'data' nor binary_data_size")
            inputs[name] = from_json(header, entry["data"])
            continue
        if "data" in entry:
            raise ConfigError(f"input {name!r} has both 'data' and binary_data_size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ConfigError(f"input {name!r}: binary_data_size must be an integer >= 0")
        if offset + size > len(binary):
            raise ConfigError(
                f"input {name!r}: binary_data_size {size} runs past the {len(binary)} bytes "
                "of binary data"
            )
        inputs[name] = from_raw(header, binary[offset : offset + size])
        offset += size
    if offset != len(binary):
        raise ConfigError(
            f"{len(binary)} bytes of binary data follow the JSON, but the inputs' "
            f"binary_data_size add up to {offset}"
        )
    return inputs


def _infer_response(
    served: ServedVersion,
    request_id: str | None,
    selected: list[tuple[str, np.ndarray]],
    binary_names: set[str],
) -> Response:
    header: dict[str, Any] = {"model_name": served.model, "model_version": served.version}
    if request_id:
        header["id"] = request_id
    outputs, chunks = [], []
    for name, array in selected:
        output: dict[str, Any] = {
            "name": name,
            "datatype": datatype_of(name, array),
            "shape": list(array.shape),
        }
        if name in binary_names:
            raw = to_raw(name, array)
            output["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            output["data"] = to_json(name, array)
        outputs.append(output)
    header["outputs"] = outputs
    header_bytes = json.dumps(header).encode()
    if not binary_names:
        return Response(header_bytes, media_type="application/json")
    return Response(
        header_bytes + b"".join(chunks),
        media_type="application/octet-stream",
        headers={HEADER_LENGTH: str(len(header_bytes))},
    )
