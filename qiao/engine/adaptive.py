"""Adaptive batching: a feedback controller that holds a latency target by moving a batch limit.

One class serves both sides of the platform:

- generation: the measurement is the time of each step that holds a decode (about the
  inter-token latency of the running requests), the controlled value the step's token budget
  (chunked-prefill tokens are what inflate a decode step; the budget caps them);
- encoders: the measurement is the p99 of request latency (queue wait + compute) over a sliding
  window (`LatencyWindow`), the controlled value the batcher's queue delay.

`BudgetController.observe` smooths the measurement (EWMA, restarted after each change), holds the value while it is within
`target * (1 ± tolerance)` (the dead band), and otherwise moves it multiplicatively towards the
target: down by the overshoot (at most halving), up by `growth` (at most 25 % a move), both at
most once every `interval` observations and always within [lo, hi]. The value grows only while
raising it could help (`can_grow`: e.g. the budget was used up in the step; an idle engine
says nothing about a larger one).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable

logger = logging.getLogger(__name__)

# Smallest relative change worth logging (a smaller one is logged once a second at most).
LOG_CHANGE = 0.10
LOG_INTERVAL_S = 1.0


class BudgetController:
    """Holds a smoothed measurement near `target` by moving a value in [lo, hi].

    The measurement is assumed to grow with the value (a larger step budget, a longer queue
    delay: a slower step, a longer wait). `integer=True` rounds the value (a token budget)."""

    def __init__(
        self,
        target: float,
        tolerance: float,
        lo: float,
        hi: float,
        start: float | None = None,
        *,
        smoothing: float = 0.3,
        growth: float = 0.1,
        interval: int = 2,
        integer: bool = True,
        name: str = "budget",
    ) -> None:
        if target <= 0:
            raise ValueError(f"target must be > 0, got {target}")
        if not 0 <= tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
        if not 0 < lo <= hi:
            raise ValueError(f"need 0 < lo <= hi, got lo={lo}, hi={hi}")
        self.target = target
        self.tolerance = tolerance
        self.lo, self.hi = lo, hi
        self.smoothing = smoothing
        self.growth = growth
        self.interval = max(1, interval)
        self.integer = integer
        self.name = name
        self.value = self._clamp(hi if start is None else start)
        self.smoothed: float | None = None  # EWMA of the measurements (None: none yet)
        self.num_changes = 0
        self._since_change = 0
        # After a change the smoothed figure restarts: older measurements are of the old value.
        self._fresh = False
        self._logged_value = self.value
        self._logged_at = -math.inf

    def _clamp(self, value: float) -> float:
        value = min(self.hi, max(self.lo, value))
        return float(round(value)) if self.integer else value

    def observe(self, measurement: float, *, can_grow: bool = True) -> float | None:
        """Feed one measurement; return the new value when it changed, else None."""
        if self.smoothed is None or self._fresh:
            self.smoothed = measurement
            self._fresh = False
        else:
            self.smoothed += self.smoothing * (measurement - self.smoothed)
        self._since_change += 1
        if self._since_change < self.interval:
            return None
        high = self.target * (1 + self.tolerance)
        low = self.target * (1 - self.tolerance)
        if self.smoothed > high:
            # Shrink in proportion to the overshoot (a step's time is roughly linear in its
            # tokens past a fixed cost), at most halving per move.
            new = self.value * max(0.5, self.target / self.smoothed)
        elif self.smoothed < low and can_grow:
            new = self.value * (1 + min(0.25, self.growth * self.target / max(self.smoothed, 1e-9)))
        else:
            return None
        new = self._clamp(new)
        if self.integer and new == self.value and self.smoothed > high and self.value > self.lo:
            new = self.value - 1  # rounding would hold a small budget in place
        if self.integer and new == self.value and self.smoothed < low and self.value < self.hi:
            new = self.value + 1
        if new == self.value:
            return None
        self.value = new
        self.num_changes += 1
        self._since_change = 0
        self._fresh = True
        self._log()
        return new

    def _log(self) -> None:
        now = time.monotonic()
        changed = abs(self.value - self._logged_value) >= LOG_CHANGE * self._logged_value
        if changed or now - self._logged_at >= LOG_INTERVAL_S:
            logger.info(
                "adaptive %s: %s -> %s (smoothed measurement %.4g, target %.4g ± %d%%)",
                self.name,
                _fmt(self._logged_value),
                _fmt(self.value),
                self.smoothed,
                self.target,
                round(100 * self.tolerance),
            )
            self._logged_value, self._logged_at = self.value, now


def _fmt(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{value:.4g}"


class LatencyWindow:
    """The p99 (or any quantile) of the latencies of the last `size` requests, or of those
    within `horizon_s` seconds (the older ones drop out)."""

    def __init__(
        self,
        size: int = 200,
        horizon_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.horizon_s = horizon_s
        self.clock = clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=size)

    def __len__(self) -> int:
        return len(self._samples)

    def clear(self) -> None:
        self._samples.clear()

    def add(self, latency_s: float) -> None:
        self._samples.append((self.clock(), latency_s))

    def quantile(self, q: float = 0.99) -> float | None:
        cutoff = self.clock() - self.horizon_s
        while self._samples and self._samples[0][0] < cutoff:
            self._samples.popleft()
        if not self._samples:
            return None
        values = sorted(v for _, v in self._samples)
        # Nearest rank: E.g. 100 samples, q=0.99 -> index 98 (the 99th smallest).
        return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]
