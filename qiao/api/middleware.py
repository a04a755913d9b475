"""ASGI middleware: request ids and the access log, API-key auth, request-size limit, HTTP
status counting.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnect detection pass through
untouched.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.exceptions import HTTPException

from qiao.api.errors import error_body
from qiao.api.keys import KeyLimiter, KeyRing, limit_message
from qiao.logs import end_request, start_request

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Liveness and readiness stay open so orchestrators can probe without credentials.
PUBLIC_PATHS = frozenset(
    {"/health", "/ping", "/health/live", "/health/ready", "/v2/health/live", "/v2/health/ready"}
)


async def send_error(
    send: Send,
    status: int,
    message: str,
    headers: dict[str, str] | None = None,
    *,
    path: str = "",
) -> None:
    # KServe v2 routes answer in their protocol's error shape, the rest in OpenAI's envelope.
    shape = {"error": message} if path.startswith("/v2") else error_body(status, message)
    body = json.dumps(shape).encode()
    raw_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """Every route but the health probes needs `Authorization: Bearer <key>` when keys are set.

    The matched key (`keys.ApiKey`) is put in the request's state (`request.state.api_key`);
    a key with limits has its POST requests counted (`keys.KeyLimiter`): past a limit, 429 with
    Retry-After and the x-ratelimit-* headers, which also go on its other answers."""

    def __init__(
        self,
        app: ASGIApp,
        keyring: KeyRing,
        limiter: KeyLimiter | None = None,
        on_outcome: Callable[[str, str], None] | None = None,
    ) -> None:
        self.app = app
        self.keyring = keyring
        self.limiter = limiter
        self.on_outcome = on_outcome or (lambda name, outcome: None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        key = self.keyring.match(bearer_token(dict(scope["headers"]).get(b"authorization", b"")))
        if key is None:
            await send_error(
                send,
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                {"WWW-Authenticate": "Bearer"},
                path=scope["path"],
            )
            return
        scope.setdefault("state", {})["api_key"] = key
        if self.limiter is None or not key.is_limited or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        exceeded, headers = self.limiter.admit(key)
        if exceeded is not None:
            self.on_outcome(key.name, f"limited_{exceeded}")
            await send_error(send, 429, limit_message(exceeded), headers, path=scope["path"])
            return
        self.on_outcome(key.name, "admitted")
        extra = [(k.lower().encode(), v.encode()) for k, v in headers.items()]

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            self.limiter.release(key)


def bearer_token(header: bytes) -> bytes:
    """The token of an `Authorization: Bearer <token>` value (empty for any other scheme)."""
    scheme, _, token = header.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


def decimal(value: bytes | str | None, max_digits: int = 18) -> int | None:
    """A header's non-negative decimal value; None when absent, not a number, or longer than
    `max_digits` (Python refuses to convert strings over 4,300 digits to int)."""
    if value is None or not value.isdigit() or not value.isascii():
        return None
    digits = value.lstrip(b"0" if isinstance(value, bytes) else "0")
    return int(digits or 0) if len(digits) <= max_digits else None


def bearer_matches(header: bytes, keys: list[bytes]) -> bool:
    """Whether an `Authorization` value is `Bearer <one of keys>`. Every key is compared, in
    constant time each, so timing reveals nothing (HTTP, management and gRPC all use this)."""
    token = bearer_token(header)
    # An empty token never authenticates, even beside an empty key that slipped through.
    matches = [hmac.compare_digest(token, key) for key in keys]
    return bool(token) and any(matches)


class BodyLimitMiddleware:
    """Refuse bodies over `max_bytes` with 413, by Content-Length or while reading. POSTs to a
    path of `upload_limits` (uploads) have that path's limit instead."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, upload_limits: dict[str, int] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.upload_limits = upload_limits or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        if scope["method"] == "POST":
            limit = self.upload_limits.get(scope["path"], limit)
        length = decimal(dict(scope["headers"]).get(b"content-length"))
        if length is not None and length > limit:
            await send_error(
                send,
                413,
                f"request body is {length} bytes; the limit is {limit}",
                path=scope["path"],
            )
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # The app's error handler turns this into the 413 envelope.
                    raise HTTPException(413, f"request body exceeds the limit of {limit} bytes")
            return message

        await self.app(scope, limited_receive, send)


MAX_REQUEST_ID_LENGTH = 128
access_logger = logging.getLogger("qiao.access")


class RequestIdMiddleware:
    """Every HTTP response carries `X-Request-Id`: the request's own (1-128 printable ASCII
    characters, no spaces) or a fresh one, also in `scope["state"]["request_id"]`. With `log`,
    one line per request names it (client, method, path, route, status, milliseconds, tokens,
    key name; as JSON fields with `--log-format json`); health probes and metric scrapes are
    logged at debug level. Every other log line written while it is served carries its id
    (`qiao/logs.py`)."""

    def __init__(self, app: ASGIApp, log: bool = True) -> None:
        self.app = app
        self.log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _valid_request_id(dict(scope["headers"]).get(b"x-request-id"))
        request_id = request_id or uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        header = (b"x-request-id", request_id.encode())
        status = 0
        started = time.perf_counter()
        # Every log line written while this request is served carries its id.
        notes, token = start_request(request_id)

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            end_request(token)
            if self.log:
                self._log(scope, state, status, time.perf_counter() - started, notes)

    @staticmethod
    def _log(
        scope: Scope, state: dict[str, Any], status: int, seconds: float, notes: dict[str, Any]
    ) -> None:
        path = scope["path"]
        level = logging.DEBUG if path in PUBLIC_PATHS or path == "/metrics" else logging.INFO
        if not access_logger.isEnabledFor(level):
            return  # probes and scrapes, every few seconds: no line, so nothing to build
        client = scope.get("client")
        route = getattr(scope.get("route"), "path", None)
        key = state.get("api_key")
        fields: dict[str, Any] = {
            "client": f"{client[0]}:{client[1]}" if client else None,
            "method": scope["method"],
            "path": path,
            "route": route,
            "status": status or None,
            "latency_ms": round(seconds * 1000, 1),
            "tokens": notes.get("tokens"),
            "key": getattr(key, "name", None),
        }
        extra = "".join(
            f" {name}={fields[name]}" for name in ("route", "tokens", "key") if fields[name]
        )
        access_logger.log(
            level,
            '%s "%s %s" %s %.1f ms%s request_id=%s',
            fields["client"] or "-",
            scope["method"],
            path,
            status or "-",
            seconds * 1000,
            extra,
            notes["request_id"],
            extra={"fields": fields, "request_id": notes["request_id"]},
        )


def _valid_request_id(value: bytes | None) -> str | None:
    if not value or len(value) > MAX_REQUEST_ID_LENGTH:
        return None
    if not all(0x21 <= byte <= 0x7E for byte in value):
        return None
    return value.decode("ascii")


class StatusCountMiddleware:
    """Counts responses by route template and status code."""

    def __init__(self, app: ASGIApp, count: Callable[[str, int], None]) -> None:
        self.app = app
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                route = scope.get("route")
                path = getattr(route, "path", None) or "unmatched"
                self.count(path, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)
