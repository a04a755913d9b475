"""The management API: repository index, load / unload / reload, traffic weights.

`create_management_app(control, token=...)` is its own app, run on its own listener. Every route
needs `Authorization: Bearer <token>` (the web console's static shell at `/ui` aside: it holds no
data and its calls carry the token; `qiao/api/console.py`). Routes:

    GET  /v1/repository                          {"models": [{name, version, state, reason}]}
    POST /v1/repository/models/{model}/load      (re)load from the repository
    POST /v1/repository/models/{model}/reload    the same: picks up replaced versions
    POST /v1/repository/models/{model}/unload
    PUT  /v1/repository/models/{model}/traffic   {"weights": {"1": 90, "2": 10}}
    POST /v1/load_lora_adapter                   {"lora_name", "lora_path", "model"?} (vLLM's;
    POST /v1/unload_lora_adapter                 {"lora_name", "model"?}   api/lora_adapters.py)
    POST /v2/repository/index                    KServe v2 repository extension (Triton's state
    POST /v2/repository/models/{model}/load      words; errors as {"error": "..."}), which
    POST /v2/repository/models/{model}/unload    tritonclient's repository calls speak

The main listener answers `/v2/repository/index` too (HTTP and gRPC), read-only and with the
same rows (`v2_index_rows`).

Model names are checked (`scan.check_model_name`) before the control sees them, and a path with
any percent-encoded byte is refused outright: valid names never need one, and decoding `%2F`
would otherwise change which route a request reaches. The control's errors map to status codes:
ModelNotFoundError 404, ConfigError 400, EngineUnavailableError 503, anything else a logged,
generic 500. Bodies are capped at 64 KiB (413). Error bodies carry the message only, absolute
paths masked: no traceback, no file path, no address.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from qiao.api.console import ConsoleShell
from qiao.api.errors import error_body
from qiao.api.lora_adapters import add_management_routes
from qiao.api.middleware import (
    ASGIApp,
    Message,
    Receive,
    Scope,
    Send,
    bearer_matches,
    decimal,
)
from qiao.errors import ConfigError, EngineUnavailableError, ModelNotFoundError
from qiao.repository.scan import NAME_RULE, check_model_name, check_version
from qiao.repository.types import ModelControl, VersionState, VersionStatus
from qiao.version import __version__

logger = logging.getLogger("qiao.management")

MAX_BODY_BYTES = 64 * 1024
# Triton's words for the repository index.
_V2_STATES = {
    VersionState.LOADING: "LOADING",
    VersionState.READY: "READY",
    VersionState.UNLOADING: "UNLOADING",
    VersionState.UNAVAILABLE: "UNAVAILABLE",
}
# An absolute file path in a message (after a space, quote, paren or at the start).
_ABSOLUTE_PATH = re.compile(r"(?:(?<=^)|(?<=[\s'\"(=]))/[^\s'\"),;]+")


def create_management_app(
    control: ModelControl, *, token: str, max_body_bytes: int = MAX_BODY_BYTES
) -> FastAPI:
    if not token or not (token.isascii() and token.isprintable()) or " " in token:
        raise ConfigError("management token must be non-empty printable ASCII without spaces")
    app = FastAPI(
        title="qiao management",
        version=__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.control = control
    _install_error_handlers(app)
    _add_v1_routes(app)
    add_management_routes(app, _parse, _as_http)
    _add_v2_routes(app)
    app.add_middleware(ManagementGuard, token=token, max_body_bytes=max_body_bytes)
    # Before the guard: the console's static shell at /ui (no data in it; its calls carry the token).
    app.add_middleware(ConsoleShell, listener="management", redirect_root=False)
    return app


class _Answered(HTTPException):
    """An HTTPException a route raised on purpose, whose message is already fit to show."""


# --- wire models -------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


BodyT = TypeVar("BodyT", bound=_Body)


class TrafficBody(_Body):
    weights: dict[str, float] = Field(min_length=1, max_length=1024)


class IndexBody(_Body):
    ready: bool = False


class LoadBody(_Body):
    parameters: dict[str, Any] = Field(default_factory=dict)


class UnloadParameters(_Body):
    unload_dependents: bool = False  # no model has dependents here; accepted and ignored


class UnloadBody(_Body):
    parameters: UnloadParameters = Field(default_factory=UnloadParameters)


# --- routes ------------------------------------------------------------------------------------


def _add_v1_routes(app: FastAPI) -> None:
    @app.get("/v1/repository")
    async def repository(request: Request) -> dict[str, Any]:
        return {"models": [_row(s, s.state.value) for s in _control(request).index()]}

    # A reload is a load: the control replaces versions whose files changed.
    @app.post("/v1/repository/models/{model}/load")
    @app.post("/v1/repository/models/{model}/reload")
    async def load(model: str, request: Request) -> dict[str, Any]:
        name = _checked_name(model)
        await _run(_control(request).load, name)
        return _model_rows(request, name)

    @app.post("/v1/repository/models/{model}/unload")
    async def unload(model: str, request: Request) -> dict[str, Any]:
        name = _checked_name(model)
        await _run(_control(request).unload, name)
        return _model_rows(request, name)

    @app.put("/v1/repository/models/{model}/traffic")
    async def traffic(model: str, request: Request) -> dict[str, Any]:
        name = _checked_name(model)
        body = await _parse(request, TrafficBody, required=True)
        weights = _checked_weights(body.weights)
        try:
            _control(request).set_traffic(name, weights)
        except Exception as exc:
            raise _as_http(exc) from None
        return {"name": name, "weights": weights}


def _add_v2_routes(app: FastAPI) -> None:
    @app.post("/v2/repository/index")
    async def index(request: Request) -> list[dict[str, str]]:
        return v2_index_rows(_control(request), ready=await parse_index_body(request))

    @app.post("/v2/repository/models/{model}/load")
    async def load(model: str, request: Request) -> Response:
        name = _checked_name(model)
        body = await _parse(request, LoadBody)
        if body.parameters:
            raise _Answered(
                400,
                "load parameters (config overrides, model files) are not accepted; change the "
                "model repository and load again",
            )
        await _run(_control(request).load, name)
        return Response(status_code=200)

    @app.post("/v2/repository/models/{model}/unload")
    async def unload(model: str, request: Request) -> Response:
        name = _checked_name(model)
        await _parse(request, UnloadBody)
        await _run(_control(request).unload, name)
        return Response(status_code=200)


async def parse_index_body(request: Request) -> bool:
    """The `ready` flag of a `/v2/repository/index` body (400 for a bad body)."""
    return (await _parse(request, IndexBody)).ready


def v2_index_rows(control: ModelControl, *, ready: bool = False) -> list[dict[str, str]]:
    """The repository index in Triton's words (only READY versions with `ready`); the main
    listener's KServe routes (HTTP and gRPC) answer the same rows."""
    rows = control.index()
    if ready:
        rows = [s for s in rows if s.state is VersionState.READY]
    return [_row(s, _V2_STATES[s.state]) for s in rows]


def _control(request: Request) -> ModelControl:
    return request.app.state.control


def _row(status: VersionStatus, state: str) -> dict[str, str]:
    row = {
        "name": status.model,
        "version": status.version,
        "state": state,
        "reason": _public(status.reason),
    }
    if status.circuit_breaker is not None:
        row["circuit_breaker"] = status.circuit_breaker
    return row


def _model_rows(request: Request, name: str) -> dict[str, Any]:
    rows = [_row(s, s.state.value) for s in _control(request).index() if s.model == name]
    return {"name": name, "versions": rows}


def _checked_name(model: str) -> str:
    """The name, or 400 without echoing it (it may be anything a client could send)."""
    try:
        return check_model_name(model)
    except ConfigError:
        raise _Answered(400, f"model name: use {NAME_RULE}") from None


def _checked_weights(weights: dict[str, float]) -> dict[str, float]:
    checked = {}
    for version, weight in weights.items():
        try:
            key = check_version(version)
        except ConfigError as exc:
            raise _Answered(400, f"weights: {exc}") from None
        if not (0 <= weight < float("inf")):
            raise _Answered(400, f"weights.{key}: must be >= 0 and finite")
        checked[key] = weight
    if len(checked) != len(weights):
        raise _Answered(400, "weights: a version is given twice")
    if not any(w > 0 for w in checked.values()):
        raise _Answered(400, "weights: at least one weight must be > 0")
    return checked


async def _run(action: Callable[[str], Awaitable[None]], name: str) -> None:
    try:
        await action(name)
    except Exception as exc:
        raise _as_http(exc) from None


def _as_http(exc: Exception) -> _Answered:
    if isinstance(exc, ModelNotFoundError):
        return _Answered(404, _public(str(exc)))
    if isinstance(exc, ConfigError):
        return _Answered(400, _public(str(exc)))
    if isinstance(exc, EngineUnavailableError):
        return _Answered(503, _public(str(exc)), headers={"Retry-After": "1"})
    logger.error("management request failed", exc_info=exc)
    return _Answered(500, "internal server error; the server log has the details")


async def _parse(request: Request, model: type[BodyT], *, required: bool = False) -> BodyT:
    raw = await request.body()
    if not raw.strip():
        if required:
            raise _Answered(400, "request body: a JSON object is required")
        return model()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise _Answered(400, "request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise _Answered(400, "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        key = ".".join(str(p) for p in first["loc"])
        message = "unknown key" if first["type"] == "extra_forbidden" else first["msg"]
        raise _Answered(400, f"{key}: {message}" if key else message) from None


def _public(message: str) -> str:
    """A message fit for a response: absolute paths masked, one line, bounded."""
    return " ".join(_ABSOLUTE_PATH.sub("<path>", message).split())[:1000]


# --- errors: the OpenAI-style envelope under /v1, KServe's {"error": "..."} under /v2 -----------


def _error(path: str, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    body = {"error": message} if _is_v2(path) else error_body(status, message)
    return JSONResponse(body, status_code=status, headers=headers)


def _is_v2(path: str) -> bool:
    return path == "/v2" or path.startswith("/v2/")


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404 and not isinstance(exc, _Answered):
            message = "no such route"  # the path is not echoed
        return _error(request.url.path, exc.status_code, message, exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        logger.error("management request failed", exc_info=exc)
        return _error(request.url.path, 500, "internal server error")


class ManagementGuard:
    """Pure ASGI: bearer token (constant-time), then no percent-encoded path, then body size."""

    def __init__(self, app: ASGIApp, token: str, max_body_bytes: int) -> None:
        self.app = app
        self.token = token.encode()
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if not self._authorized(scope):
            message = "missing or invalid token: send 'Authorization: Bearer <token>'"
            await _send(scope, send, _error(path, 401, message, {"WWW-Authenticate": "Bearer"}))
            return
        if b"%" in scope.get("raw_path", b"") or "\0" in path:
            message = (
                "percent-encoded characters are not allowed in the path; "
                f"a model name is {NAME_RULE}"
            )
            await _send(scope, send, _error(path, 400, message))
            return
        length = decimal(dict(scope["headers"]).get(b"content-length", b"0"))
        if length is None or length > self.max_body_bytes:
            message = f"request body is over the limit of {self.max_body_bytes} bytes"
            await _send(scope, send, _error(path, 413, message))
            return
        await self.app(scope, self._limited(receive), send)

    def _authorized(self, scope: Scope) -> bool:
        return bearer_matches(dict(scope["headers"]).get(b"authorization", b""), [self.token])

    def _limited(self, receive: Receive) -> Receive:
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:
                # The route's body read raises; the handler turns it into the 413 answer.
                raise _Answered(
                    413, f"request body is over the limit of {self.max_body_bytes} bytes"
                )
            return message

        return limited_receive


async def _send(scope: Scope, send: Send, response: Response) -> None:
    async def no_receive() -> Message:
        return {"type": "http.disconnect"}

    await response(scope, no_receive, send)
