"""The circuit breaker's states on a fake clock."""

from __future__ import annotations

import numpy as np
import pytest

from qiao.engine.breaker import BreakerConfig, BreakerState, CircuitBreaker
from qiao.errors import CircuitOpenError, ConfigError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(failures: int = 3, window: float = 10.0, cooldown: float = 5.0) -> tuple:
    clock = Clock()
    return CircuitBreaker(BreakerConfig(failures, window, cooldown), "m@1", clock), clock


def test_opens_after_n_failures_in_the_window_and_refuses_at_once() -> None:
    breaker, clock = make()
    breaker.record_failure()
    breaker.record_failure()
    breaker.allow()  # two of three: still closed
    breaker.record_failure()
    assert breaker.state == BreakerState.OPEN and breaker.num_opened == 1
    clock.now += 1.2
    with pytest.raises(CircuitOpenError) as caught:
        breaker.allow()
    assert caught.value.retry_after == 4  # the rest of the cool-down, rounded up


def test_failures_outside_the_window_do_not_count() -> None:
    breaker, clock = make()
    breaker.record_failure()
    breaker.record_failure()
    clock.now += 11
    breaker.record_failure()
    assert breaker.state == BreakerState.CLOSED


def test_half_open_lets_one_probe_through_and_its_outcome_decides() -> None:
    breaker, clock = make()
    for _ in range(3):
        breaker.record_failure()
    clock.now += 5
    assert breaker.state == BreakerState.HALF_OPEN
    breaker.allow()  # the probe
    with pytest.raises(CircuitOpenError):
        breaker.allow()  # everyone else still waits
    breaker.record_failure()  # the probe failed: open again, a new cool-down
    assert breaker.state == BreakerState.OPEN and breaker.num_opened == 2
    clock.now += 5
    breaker.allow()
    breaker.record_success()
    assert breaker.state == BreakerState.CLOSED
    breaker.allow()
    breaker.allow()


def test_a_probe_that_never_reports_frees_the_way_after_a_cool_down() -> None:
    breaker, clock = make()
    for _ in range(3):
        breaker.record_failure()
    clock.now += 5
    breaker.allow()  # a probe whose client went away
    with pytest.raises(CircuitOpenError):
        breaker.allow()
    clock.now += 5
    breaker.allow()  # a new probe


def test_zero_failures_turns_it_off_and_bad_settings_are_refused() -> None:
    breaker, _ = make(failures=0)
    for _ in range(100):
        breaker.record_failure()
    breaker.allow()
    assert breaker.state == BreakerState.CLOSED
    with pytest.raises(ConfigError):
        BreakerConfig(failures=-1)
    with pytest.raises(ConfigError):
        BreakerConfig(cooldown=0)


class _FlakyEncoder:
    """An encoder that fails while `broken` is set."""

    dim = 4
    max_length = 16

    def __init__(self) -> None:
        self.broken = True

    def embed(self, rows: list[list[int]]) -> np.ndarray:
        if self.broken:
            raise RuntimeError("injected encoder fault")
        return np.ones((len(rows), self.dim), dtype=np.float32)

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [[1, 2] for _ in texts]


def test_an_encoder_version_breaker_opens_on_failing_batches_and_a_probe_closes_it() -> None:
    import asyncio

    from qiao.engine.batcher import BatcherConfig
    from qiao.repository.served import EncoderVersion

    encoder = _FlakyEncoder()
    served = EncoderVersion(
        "e",
        "1",
        encoder,  # type: ignore[arg-type]
        BatcherConfig(),
        backend="embedding",
        breaker=BreakerConfig(failures=2, window=60, cooldown=0.2),
    )

    async def scenario() -> None:
        served.start()
        try:
            for _ in range(2):
                with pytest.raises(RuntimeError):
                    await served.embed(["x"])
            with pytest.raises(CircuitOpenError):
                await served.embed(["x"])  # refused before the batcher
            assert served.breaker.state == BreakerState.OPEN
            encoder.broken = False
            await asyncio.sleep(0.25)
            assert served.breaker.state == BreakerState.HALF_OPEN
            assert (await served.embed(["x"])).shape == (1, 4)  # the probe
            assert served.breaker.state == BreakerState.CLOSED
        finally:
            await served.stop()

    asyncio.run(scenario())
