"""A circuit breaker per served model version: stop sending work to a version that keeps failing.

Closed (normal) -> open after `failures` engine failures within `window` seconds: every request
is refused at once (503 `circuit_open` with Retry-After), nothing queues -> half-open once
`cooldown` seconds passed: one request goes through as a probe, the others are still refused ->
closed when the probe succeeds, open again (a new cool-down) when it fails. A probe that never
reports (its client left) frees the way for another after a cool-down.

Failures are the engine's, not the client's: an engine that died or stalled (one failure per
death, however many requests it held), a step that failed, a request the engine could not run.
A refused, invalid, timed-out or aborted request counts neither way.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from qiao.errors import CircuitOpenError, ConfigError


class BreakerState(enum.IntEnum):
    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")


@dataclass(frozen=True)
class BreakerConfig:
    failures: int = 5  # engine failures within `window` that open the breaker; 0: never opens
    window: float = 30.0  # seconds
    cooldown: float = 10.0  # seconds open before a probe is let through

    def __post_init__(self) -> None:
        if self.failures < 0:
            raise ConfigError("breaker_failures must be >= 0 (0 turns the breaker off)")
        if self.window <= 0 or self.cooldown <= 0:
            raise ConfigError("breaker_window and breaker_cooldown must be > 0 seconds")


class CircuitBreaker:
    def __init__(
        self,
        config: BreakerConfig,
        name: str = "engine",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.name = name
        self._clock = clock
        self._lock = threading.Lock()
        self._failures: deque[float] = deque()
        self._state = BreakerState.CLOSED
        self._opened_at = 0.0
        self._probe_at: float | None = None  # when the half-open probe was let through
        self.num_opened = 0

    @property
    def state(self) -> BreakerState:
        with self._lock:
            self._advance()
            return self._state

    def allow(self) -> None:
        """Let a request through or raise CircuitOpenError (503, Retry-After) at once."""
        if self.config.failures == 0:
            return
        with self._lock:
            self._advance()
            now = self._clock()
            if self._state == BreakerState.CLOSED:
                return
            if self._state == BreakerState.HALF_OPEN and self._probe_at is None:
                self._probe_at = now  # this request is the probe
                return
            wait = self._opened_at + self.config.cooldown - now
            if self._state == BreakerState.HALF_OPEN:
                wait = self._probe_at + self.config.cooldown - now  # type: ignore[operator]
            raise CircuitOpenError(
                f"{self.name} is failing repeatedly and its circuit breaker is "
                f"{self._state.label}; retry later",
                retry_after=max(1, math.ceil(wait)),
            )

    def record_success(self) -> None:
        with self._lock:
            if self._state == BreakerState.HALF_OPEN:
                self._state = BreakerState.CLOSED
                self._failures.clear()
                self._probe_at = None

    def record_failure(self) -> None:
        if self.config.failures == 0:
            return
        with self._lock:
            now = self._clock()
            if self._state == BreakerState.HALF_OPEN:
                self._open(now)
                return
            if self._state == BreakerState.OPEN:
                return
            self._failures.append(now)
            while self._failures and self._failures[0] < now - self.config.window:
                self._failures.popleft()
            if len(self._failures) >= self.config.failures:
                self._open(now)

    def _open(self, now: float) -> None:
        self._state = BreakerState.OPEN
        self._opened_at = now
        self._probe_at = None
        self._failures.clear()
        self.num_opened += 1

    def _advance(self) -> None:
        """Called under the lock: open -> half-open after the cool-down; a probe that never
        reported frees the way for another after one."""
        now = self._clock()
        if self._state == BreakerState.OPEN and now >= self._opened_at + self.config.cooldown:
            self._state = BreakerState.HALF_OPEN
            self._probe_at = None
        elif (
            self._state == BreakerState.HALF_OPEN
            and self._probe_at is not None
            and now >= self._probe_at + self.config.cooldown
        ):
            self._probe_at = None
