"""API keys with names, model lists, rate limits, concurrency caps and a priority ceiling.

`--keys-file keys.yaml` (reloaded when it changes):

    keys:
      - name: team-a                    # shown in metrics and logs; the key itself never is
        key_sha256: 9f86d0...           # sha256 hex digest of the key, or
        key_env: TEAM_A_KEY             #   the key read from this environment variable
        models: [demo_model]            # models it may use (default: all)
        requests_per_minute: 60         # each limit optional
        tokens_per_minute: 20000        # prompt + completion tokens
        max_concurrent: 4               # requests in flight at once
        max_priority: 0                 # the most urgent priority it may ask (smaller is more
                                        #   urgent); a request asking more urgent gets this one

A request past a limit gets 429 with `Retry-After` and OpenAI's `x-ratelimit-limit-requests`,
`x-ratelimit-remaining-requests`, `x-ratelimit-reset-requests` and the `-tokens` trio (sent on
every answer to a limited key). Counting uses the `limits` library: moving windows in memory by
default, in Redis (`--rate-limit-storage redis://host:6379`) to share them between replicas.
Requests count when admitted past auth; tokens are charged when known (prompt and completion
after the answer), so a key may overshoot its token budget by one request's worth.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from qiao.errors import ConfigError

logger = logging.getLogger("qiao.keys")

RELOAD_CHECK_S = 1.0  # how often the keys file's modification time is looked at


class KeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    key_sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$")
    key_env: str | None = Field(None, min_length=1)
    models: list[str] | None = None
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    max_concurrent: int | None = Field(None, ge=1)
    max_priority: int | None = None

    @model_validator(mode="after")
    def _one_key_source(self) -> KeyEntry:
        if (self.key_sha256 is None) == (self.key_env is None):
            raise ValueError("give exactly one of key_sha256 and key_env")
        return self


class KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    keys: list[KeyEntry] = Field(default_factory=list)


@dataclass(frozen=True)
class ApiKey:
    """One accepted key, by the digest of its secret."""

    name: str
    digest: bytes
    models: frozenset[str] | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    max_priority: int | None = None

    @property
    def is_limited(self) -> bool:
        return bool(self.requests_per_minute or self.tokens_per_minute or self.max_concurrent)

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


def digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()


def load_keys_file(path: Path, environ: dict[str, str] | None = None) -> list[ApiKey]:
    """The keys in `path`; ConfigError naming the file and the entry for anything wrong."""
    import yaml

    from qiao.api.settings import check_secret

    environ = os.environ if environ is None else environ  # type: ignore[assignment]
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"keys_file {path} cannot be read ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"keys_file {path} is not valid YAML: {exc}") from exc
    try:
        parsed = KeysFile.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"keys_file {path}: {where}: {first['msg']}") from None
    keys: list[ApiKey] = []
    names: set[str] = set()
    for entry in parsed.keys:
        if entry.name in names:
            raise ConfigError(f"keys_file {path}: the name {entry.name!r} is used twice")
        names.add(entry.name)
        if entry.key_env is not None:
            secret = environ.get(entry.key_env)
            if secret is None:
                raise ConfigError(
                    f"keys_file {path}: key {entry.name!r} reads ${entry.key_env}, which is unset"
                )
            check_secret(secret, f"keys_file {path}: key {entry.name!r}")
            key_digest = digest(secret.encode())
        else:
            key_digest = bytes.fromhex(entry.key_sha256)  # type: ignore[arg-type]
        keys.append(
            ApiKey(
                name=entry.name,
                digest=key_digest,
                models=frozenset(entry.models) if entry.models is not None else None,
                requests_per_minute=entry.requests_per_minute,
                tokens_per_minute=entry.tokens_per_minute,
                max_concurrent=entry.max_concurrent,
                max_priority=entry.max_priority,
            )
        )
    return keys


class KeyRing:
    """The accepted keys: plain `--api-key` ones (no name, no limits) and the keys file's,
    reloaded when the file changes (a bad new file is logged and the old keys kept)."""

    def __init__(self, plain_keys: list[str], keys_file: Path | None) -> None:
        self._plain = [ApiKey(f"key-{i + 1}", digest(k.encode())) for i, k in enumerate(plain_keys)]
        self._path = keys_file
        self._lock = threading.Lock()
        self._mtime: float | None = None
        self._checked = 0.0
        self._file_keys: list[ApiKey] = []
        if keys_file is not None:
            self._file_keys = load_keys_file(keys_file)
            self._mtime = keys_file.stat().st_mtime

    @property
    def enabled(self) -> bool:
        return bool(self._plain) or self._path is not None

    def match(self, token: bytes) -> ApiKey | None:
        """The key whose secret is `token`; every digest is compared in constant time."""
        if not token:
            return None
        self._maybe_reload()
        wanted = digest(token)
        found = None
        for key in [*self._plain, *self._file_keys]:
            if hmac.compare_digest(wanted, key.digest):
                found = key
        return found

    def _maybe_reload(self) -> None:
        if self._path is None:
            return
        now = time.monotonic()
        if now - self._checked < RELOAD_CHECK_S:
            return
        with self._lock:
            self._checked = now
            try:
                mtime = self._path.stat().st_mtime
            except OSError:
                return
            if mtime == self._mtime:
                return
            self._mtime = mtime
            try:
                self._file_keys = load_keys_file(self._path)
            except ConfigError as exc:
                import logging

                logging.getLogger("qiao.keys").error("keys file not reloaded: %s", exc)
                return
            import logging

            logging.getLogger("qiao.keys").info("keys file reloaded: %d keys", len(self._file_keys))


class KeyLimiter:
    """Requests and tokens per minute (moving windows, `limits`) and requests in flight."""

    def __init__(self, storage_uri: str = "memory://") -> None:
        from limits import storage, strategies

        self._storage = storage.storage_from_string(storage_uri)
        self._limiter = strategies.MovingWindowRateLimiter(self._storage)
        self._in_flight: dict[str, int] = {}
        self._lock = threading.Lock()

    def _items(self, key: ApiKey) -> tuple[Any, Any]:
        from limits import RateLimitItemPerMinute

        rpm = RateLimitItemPerMinute(key.requests_per_minute) if key.requests_per_minute else None
        tpm = RateLimitItemPerMinute(key.tokens_per_minute) if key.tokens_per_minute else None
        return rpm, tpm

    def admit(self, key: ApiKey) -> tuple[str | None, dict[str, str]]:
        """Count one request of `key`: (None, headers) when admitted, or (what was exceeded,
        headers with Retry-After) when not."""
        rpm, tpm = self._items(key)
        if tpm is not None and not self._limiter.test(tpm, key.name):
            return "tokens", self.headers(key, retry=True)
        with self._lock:
            if key.max_concurrent and self._in_flight.get(key.name, 0) >= key.max_concurrent:
                return "concurrency", {**self.headers(key), "Retry-After": "1"}
            if rpm is not None and not self._limiter.hit(rpm, key.name):
                return "requests", self.headers(key, retry=True)
            self._in_flight[key.name] = self._in_flight.get(key.name, 0) + 1
        return None, self.headers(key)

    def release(self, key: ApiKey) -> None:
        with self._lock:
            self._in_flight[key.name] = max(self._in_flight.get(key.name, 1) - 1, 0)

    def charge_tokens(self, key: ApiKey, num_tokens: int) -> None:
        _, tpm = self._items(key)
        if tpm is None or num_tokens <= 0:
            return
        # A hit past the budget would be refused and count nothing: fill the window instead
        # (the rest is the one request's overshoot), so the next request is refused.
        remaining = self._limiter.get_window_stats(tpm, key.name).remaining
        cost = min(num_tokens, remaining)
        if cost > 0:
            self._limiter.hit(tpm, key.name, cost=cost)

    def headers(self, key: ApiKey, retry: bool = False) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the key's limits (and Retry-After if `retry`)."""
        rpm, tpm = self._items(key)
        headers: dict[str, str] = {}
        waits = []
        for kind, item, limit in (
            ("requests", rpm, key.requests_per_minute),
            ("tokens", tpm, key.tokens_per_minute),
        ):
            if item is None:
                continue
            stats = self._limiter.get_window_stats(item, key.name)
            reset = max(stats.reset_time - time.time(), 0.0)
            headers[f"x-ratelimit-limit-{kind}"] = str(limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(max(stats.remaining, 0))
            headers[f"x-ratelimit-reset-{kind}"] = _duration(reset)
            if stats.remaining <= 0:
                waits.append(reset)
        if retry:
            headers["Retry-After"] = str(max(1, math.ceil(max(waits, default=1.0))))
        return headers


_LIMIT_NAMES = {
    "requests": "requests per minute",
    "tokens": "tokens per minute",
    "concurrency": "requests in flight at once",
}


def limit_message(exceeded: str) -> str:
    """What a refused caller reads: which limit of its key it reached."""
    return (
        f"rate limit reached for this API key: {_LIMIT_NAMES[exceeded]}; retry after the "
        "Retry-After seconds"
    )


def _duration(seconds: float) -> str:
    """OpenAI's reset format: "1s", "6m0s", "0.5s"."""
    if seconds < 60:
        return f"{round(seconds, 3):g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{round(rest):d}s"


# --- in the routes ------------------------------------------------------------------------------


def key_of(request: Any) -> ApiKey | None:
    """The API key that authenticated `request` (None without keys)."""
    return getattr(request.state, "api_key", None)


def check_model_allowed(request: Any, model: str) -> None:
    """403 when the request's key may not use `model`."""
    from qiao.api.errors import APIError
    from qiao.repository.scan import quoted

    key = key_of(request)
    if key is not None and not key.may_use(model):
        request.app.state.metrics.key_requests.labels(key.name, "model_not_allowed").inc()
        raise APIError(
            403,
            f"model: this API key may not use model {quoted(model)}",
            param="model",
            code="model_not_allowed",
        )


def priority_for(request: Any, asked: int) -> int:
    """The priority a request runs at: what it asked, no more urgent than its key's ceiling."""
    key = key_of(request)
    if key is None or key.max_priority is None:
        return asked
    return max(asked, key.max_priority)


def token_charger(request: Any) -> Callable[[int], None] | None:
    """A function that charges tokens to the request's key (metrics and tokens per minute)."""
    key = key_of(request)
    if key is None:
        return None
    state = request.app.state
    limiter: KeyLimiter | None = state.key_limiter
    counter = state.metrics.key_tokens.labels(key.name)

    def charge(num_tokens: int) -> None:
        counter.inc(num_tokens)
        if limiter is not None:
            limiter.charge_tokens(key, num_tokens)

    return charge
