"""Batch notifications as Standard Webhooks (https://www.standardwebhooks.com): when a batch
completes, fails, expires or is cancelled, its event is POSTed to the server-wide
`--webhook-url` and to the batch's own `metadata.webhook_url`, if it has one.

The body is OpenAI's webhook event, `{"object": "event", "id": "evt_…", "type":
"batch.completed", "created_at": …, "data": {"id": "batch_…"}}`; the headers are
`webhook-id` (the event id, the same on every retry), `webhook-timestamp` (seconds) and
`webhook-signature` (`v1,` + base64 HMAC-SHA256 of `{id}.{timestamp}.{body}` keyed with the
base64-decoded part of `--webhook-secret whsec_…`). A delivery that does not answer 2xx is
retried with exponential backoff (`--webhook-retry-base` seconds, doubled each time) up to
`--webhook-max-attempts`; every attempt is recorded on the batch (`webhook_deliveries`).

A batch's own URL must name a host in `--webhook-allowed-hosts` (`host` or `host:port`); one
that does not is refused when the batch is created, so user input never makes the server call
an arbitrary host.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import secrets
import time
from typing import Any
from urllib.parse import urlsplit

import httpx

from qiao.errors import ConfigError

logger = logging.getLogger("qiao.webhooks")

EVENT_TYPES = {
    "completed": "batch.completed",
    "failed": "batch.failed",
    "expired": "batch.expired",
    "cancelled": "batch.cancelled",
}
SECRET_PREFIX = "whsec_"
DELIVERY_TIMEOUT_S = 10.0


def secret_key(secret: str) -> bytes:
    """The signing key of a `whsec_<base64>` secret."""
    if not secret.startswith(SECRET_PREFIX):
        raise ConfigError("webhook-secret: must be 'whsec_' followed by base64 bytes")
    try:
        key = base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)
    except ValueError:
        raise ConfigError("webhook-secret: the part after 'whsec_' is not base64") from None
    if len(key) < 16:
        raise ConfigError("webhook-secret: at least 16 bytes (24 base64 characters)")
    return key


def sign(key: bytes, message_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header value."""
    signed = f"{message_id}.{timestamp}.".encode() + body
    digest = hmac.new(key, signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def check_target(url: str, allowed_hosts: list[str]) -> None:
    """Refuse a per-batch URL whose host is not allowed (400 naming the field)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"metadata.webhook_url: {url!r} must be an http(s) URL", param="metadata")
    host = parts.hostname
    with_port = f"{host}:{parts.port}" if parts.port else host
    if host not in allowed_hosts and with_port not in allowed_hosts:
        raise ConfigError(
            f"metadata.webhook_url: host {with_port!r} is not in this server's "
            "--webhook-allowed-hosts",
            param="metadata",
        )


def new_event(batch_id: str, status: str) -> dict[str, Any]:
    return {
        "object": "event",
        "id": f"evt_{secrets.token_hex(12)}",
        "type": EVENT_TYPES[status],
        "created_at": int(time.time()),
        "data": {"id": batch_id},
    }


class Notifier:
    """Delivers events with retries; `record(attempt)` is called after every attempt."""

    def __init__(self, secret: str | None, *, max_attempts: int, retry_base_s: float) -> None:
        self.key = secret_key(secret) if secret else None
        self.max_attempts = max_attempts
        self.retry_base_s = retry_base_s

    async def deliver(
        self, url: str, event: dict[str, Any], first_attempt: int, record: Any
    ) -> bool:
        """POST `event` to `url` until it answers 2xx or the attempts run out, starting at
        attempt `first_attempt` (1-based: a resumed delivery goes on counting)."""
        body = json.dumps(event, separators=(",", ":")).encode()
        async with httpx.AsyncClient(timeout=DELIVERY_TIMEOUT_S) as client:
            for attempt in range(first_attempt, self.max_attempts + 1):
                if attempt > 1:
                    await asyncio.sleep(self.retry_base_s * 2 ** (attempt - 2))
                timestamp = int(time.time())
                headers = {
                    "content-type": "application/json",
                    "webhook-id": event["id"],
                    "webhook-timestamp": str(timestamp),
                }
                if self.key is not None:
                    headers["webhook-signature"] = sign(self.key, event["id"], timestamp, body)
                status, error = None, None
                try:
                    answer = await client.post(url, content=body, headers=headers)
                    status = answer.status_code
                except httpx.HTTPError as exc:
                    error = f"{type(exc).__name__}: {exc}"[:200]
                ok = status is not None and 200 <= status < 300
                record(
                    {
                        "url": url,
                        "event_id": event["id"],
                        "attempt": attempt,
                        "at": timestamp,
                        "status_code": status,
                        "error": error,
                        "delivered": ok,
                    }
                )
                if ok:
                    return True
                logger.warning(
                    "webhook %s to %s: attempt %d failed (%s)",
                    event["type"],
                    url,
                    attempt,
                    error or f"HTTP {status}",
                )
        return False
