"""One error envelope for every failure: `{"error": {"message", "type", "param", "code"}}`.

Messages say what to fix (the field, the limit). No handler ever returns a traceback, a file path
or an address; unexpected exceptions are logged server-side and answered with a generic 500.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from qiao.errors import (
    CircuitOpenError,
    ConfigError,
    EngineRestartedError,
    EngineUnavailableError,
    ModelNotFoundError,
    QueueFullError,
    QueueTimeoutError,
    RequestFailedError,
)

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(
    status_code: int, message: str, param: str | None = None, code: str | None = None
) -> dict:
    error_type = _TYPES.get(
        status_code, "invalid_request_error" if status_code < 500 else "server_error"
    )
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(error.status_code, error.message, error.param, error.code),
        status_code=error.status_code,
        headers=error.headers,
    )


def as_api_error(exc: Exception) -> APIError:
    """Map engine-side exceptions to HTTP errors."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(
            503, str(exc), code="queue_full", headers={"Retry-After": str(exc.retry_after)}
        )
    if isinstance(exc, QueueTimeoutError):
        return APIError(503, str(exc), code="queue_timeout", headers={"Retry-After": "1"})
    if isinstance(exc, ModelNotFoundError):
        return APIError(404, str(exc), code="model_not_found")
    if isinstance(exc, CircuitOpenError):
        return APIError(
            503, str(exc), code="circuit_open", headers={"Retry-After": str(exc.retry_after)}
        )
    if isinstance(exc, RequestFailedError):
        return APIError(500, str(exc), code="request_failed")
    if isinstance(exc, EngineRestartedError):
        return APIError(503, str(exc), code="engine_restarted", headers={"Retry-After": "1"})
    if isinstance(exc, EngineUnavailableError):
        return APIError(503, str(exc), code="unavailable", headers={"Retry-After": "1"})
    if isinstance(exc, ConfigError):
        # SamplingParams errors read "SamplingParams.top_p must ..."; the client knows it as top_p.
        message = str(exc).removeprefix("SamplingParams.")
        return APIError(400, message, param=exc.param or _field_of(message))
    logger.error("unexpected error", exc_info=exc)
    return APIError(
        500, "internal server error; the server log has the details", code="internal_error"
    )


def _field_of(message: str) -> str | None:
    head = message.split(" ", 1)[0]
    return head if head.isidentifier() else None


def validation_message(exc: RequestValidationError | ValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    return (f"{param}: {message}" if param else message), param


def _is_kserve(path: str) -> bool:
    return path == "/v2" or path.startswith("/v2/")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = f"no route {request.url.path}"
        if _is_kserve(request.url.path):  # KServe's shape under /v2, unknown routes included
            return JSONResponse({"error": message}, exc.status_code, headers=exc.headers)
        return error_response(APIError(exc.status_code, message, headers=exc.headers))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return error_response(as_api_error(exc))
