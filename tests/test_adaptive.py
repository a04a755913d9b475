"""Adaptive batching: the controller alone, an LLM engine under a fake step clock whose steps
take time in proportion to their tokens, and the encoder batcher under a fake compute time."""

from __future__ import annotations

import itertools
import logging
import statistics

import pytest

from qiao.config import EngineConfig
from qiao.engine.adaptive import BudgetController, LatencyWindow
from qiao.engine.batcher import BatcherConfig, BatchStats, DynamicBatcher
from qiao.engine.llm_engine import LLMEngine
from qiao.errors import ConfigError
from qiao.sampling_params import SamplingParams

# --- the controller -----------------------------------------------------------------------


def _drive(controller: BudgetController, plant, steps: int) -> list[float]:
    """Feed `plant(value)` back for `steps` observations; the values seen, in order."""
    values = []
    for _ in range(steps):
        controller.observe(plant(controller.value))
        values.append(controller.value)
    return values


def test_above_target_shrinks_below_grows_dead_band_holds() -> None:
    c = BudgetController(10.0, 0.2, lo=8, hi=1024, start=512, interval=1, smoothing=1.0)
    assert c.observe(20.0) == 256  # twice the target: halves
    assert c.observe(11.5) is None  # 11.5 within 10 ± 20 %
    assert c.value == 256
    grown = c.observe(2.0)
    assert grown is not None and grown > 256
    assert c.observe(9.0) is None


def test_bounds_hold_in_both_directions() -> None:
    c = BudgetController(10.0, 0.1, lo=16, hi=128, start=64, interval=1)
    assert max(_drive(c, lambda v: 1000.0, 50)) <= 64
    assert c.value == 16
    assert c.observe(1000.0) is None  # at the floor: nothing left to give
    values = _drive(c, lambda v: 0.1, 50)
    assert c.value == 128 and max(values) == 128
    assert c.observe(0.1) is None


def test_grows_only_when_allowed() -> None:
    c = BudgetController(10.0, 0.2, lo=8, hi=256, start=32, interval=1, smoothing=1.0)
    assert c.observe(1.0, can_grow=False) is None
    assert c.observe(1.0, can_grow=True) == 40


def test_settles_within_tolerance_on_a_linear_plant() -> None:
    # A step costs 2 ms plus 0.05 ms per token: the target 10 ms is ~160 tokens.
    c = BudgetController(10.0, 0.15, lo=8, hi=4096, start=4096)
    values = _drive(c, lambda v: 2.0 + 0.05 * v, 200)
    tail = [2.0 + 0.05 * v for v in values[-100:]]
    assert all(8.5 <= t <= 11.5 for t in tail)
    # Then the plant gets cheaper (lighter steps): the budget grows back to its bound.
    _drive(c, lambda v: 0.5 + 0.001 * v, 200)
    assert c.value == 4096


def test_rate_limited_to_one_move_per_interval() -> None:
    c = BudgetController(10.0, 0.1, lo=1, hi=1000, start=1000, interval=4)
    moves = [c.observe(100.0) for _ in range(12)]
    assert [m is not None for m in moves] == [False, False, False, True] * 3


def test_change_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    c = BudgetController(10.0, 0.1, lo=1, hi=1000, start=1000, interval=1, name="token budget")
    with caplog.at_level(logging.INFO, logger="qiao.engine.adaptive"):
        c.observe(40.0)
    assert "adaptive token budget: 1000 -> 500" in caplog.text


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="lo <= hi"):
        BudgetController(10.0, 0.1, lo=100, hi=10)
    with pytest.raises(ValueError, match="target"):
        BudgetController(0.0, 0.1, lo=1, hi=10)


def test_latency_window_quantile_and_horizon() -> None:
    now = [0.0]
    window = LatencyWindow(size=1000, horizon_s=5.0, clock=lambda: now[0])
    for i in range(100):
        window.add(float(i + 1))
    assert window.quantile(0.99) == 99.0
    assert window.quantile(0.5) == 50.0
    now[0] = 10.0
    assert window.quantile() is None


def test_engine_config_checks_the_target() -> None:
    with pytest.raises(ConfigError, match="target_itl_ms"):
        EngineConfig.create("/nonexistent", target_itl_ms=-1.0)


# --- the scheduler's side: a budget below the running sequences never starves decodes ----


def test_scheduler_adaptive_budget_caps_prefill_not_decodes() -> None:
    from test_scheduler import make_request, make_scheduler, step

    scheduler, _ = make_scheduler(num_blocks=128, max_num_seqs=8, budget=64)
    for _ in range(4):
        scheduler.add_request(make_request(range(1, 5), max_tokens=20))
    step(scheduler)  # four 4-token prompts in one step
    scheduler.set_token_budget(2)  # below the 4 running sequences
    long = make_request(range(100, 140), max_tokens=4)
    scheduler.add_request(long)
    out = step(scheduler)
    assert out.num_scheduled_tokens == 4  # the four decodes, no prefill beside them
    scheduler.set_token_budget(12)
    out = step(scheduler)
    assert out.num_scheduled_tokens == 12  # four decodes and an 8-token chunk of the prompt
    assert long.num_computed_tokens == 8
    scheduler.set_token_budget(None)
    out = step(scheduler)
    assert out.num_scheduled_tokens == 4 + 32


# --- the LLM engine under a fake step clock ----------------------------------------------

TARGET_MS, TOLERANCE = 5.0, 0.2
FIXED_MS, PER_TOKEN_MS = 1.0, 0.1  # the target is held near 40 tokens a step


class FakeStepClock:
    """The engine's step clock: a step's execute advances it by FIXED_MS + PER_TOKEN_MS per
    scheduled token, so the measured step time is exact and no test sleeps."""

    def __init__(self, engine: LLMEngine) -> None:
        self.now = 0.0
        self.step_ms: list[tuple[float, int, int]] = []  # (ms, tokens, budget) per step
        execute = engine.runner.execute

        def slowed(scheduler_output):
            ms = FIXED_MS + PER_TOKEN_MS * scheduler_output.num_scheduled_tokens
            self.now += ms / 1000.0
            self.step_ms.append(
                (ms, scheduler_output.num_scheduled_tokens, engine.stats()["adaptive_token_budget"])
            )
            return execute(scheduler_output)

        engine.runner.execute = slowed
        engine.step_clock = lambda: self.now


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str) -> list[int]:
    """Run `prompts` to completion; the token budget the engine exported after each step."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}{i}", prompt, params)
    budgets = []
    while engine.has_unfinished_requests():
        engine.step()
        budgets.append(engine.stats()["adaptive_token_budget"])
    return budgets


@pytest.fixture(scope="module")
def adaptive_engine(tiny_checkpoint) -> LLMEngine:
    config = EngineConfig.create(
        str(tiny_checkpoint("llama")),
        device="cpu",
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        enable_prefix_caching=False,
        target_itl_ms=TARGET_MS,
        target_itl_tolerance=TOLERANCE,
        adaptive_min_batched_tokens=8,
    )
    return LLMEngine(config)


def test_budget_follows_a_light_heavy_light_load(adaptive_engine: LLMEngine) -> None:
    engine = adaptive_engine
    clock = FakeStepClock(engine)
    assert engine.stats()["adaptive_token_budget"] == 256
    # Light: two short requests decoding; steps are far below the target: budget stays at max.
    light = _run(engine, [[5, 6, 7, 8], [9, 10, 11]], 12, "a")
    assert set(light) == {256}
    # Heavy: long prompts keep arriving behind running decodes; full-budget steps take 26.6 ms.
    first_heavy = len(clock.step_ms)
    prompts = [[(7 * i + j) % 200 + 3 for j in range(200)] for i in range(24)]
    heavy = _run(engine, prompts, 8, "b")
    assert min(heavy) < 100
    # After settling (the first 30 steps), steps that used their budget up and held a decode
    # take target ± tolerance.
    settled = clock.step_ms[first_heavy + 30 :]
    full = [ms for ms, tokens, budget in settled if tokens >= budget and tokens > 8]
    assert len(full) > 20
    low, high = TARGET_MS * (1 - TOLERANCE), TARGET_MS * (1 + TOLERANCE)
    inside = [low - PER_TOKEN_MS <= ms <= high + PER_TOKEN_MS for ms in full]
    assert sum(inside) >= 0.9 * len(inside), full
    assert low <= statistics.median(full) <= high
    smoothed_ms = engine.stats()["adaptive_step_time_seconds"] * 1000
    assert smoothed_ms > 0
    # Light again: the budget grows back to the configured maximum.
    again = _run(engine, [[5, 6, 7, 8], [9, 10, 11]], 40, "c")
    assert again[-1] == 256
    assert engine.stats()["adaptive_budget_changes"] >= 2


def test_engine_without_a_target_exports_no_budget(tiny_checkpoint) -> None:
    engine = LLMEngine(
        EngineConfig.create(str(tiny_checkpoint("llama")), device="cpu", max_model_len=64)
    )
    assert engine.budget_controller is None
    assert "adaptive_token_budget" not in engine.stats()


# --- the encoder batcher under a fake compute time ---------------------------------------

P99_TARGET_MS = 10.0


def _batches(batcher, compute_ms: float, count: int, rows: int = 4) -> list[float]:
    """`count` batches whose requests each waited the batcher's queue delay and computed for
    `compute_ms` (the fake clock): each request's latency; the delay after each batch."""
    delays = []
    for _ in range(count):
        waited = batcher.queue_delay_us / 1e6
        stats = BatchStats(
            rows=rows, requests=rows, queue_times_s=(waited,) * rows, exec_time_s=compute_ms / 1e3
        )
        out = batcher.adapt(stats)
        if batcher.delay_controller is not None:
            assert out.queue_delay_s == batcher.queue_delay_us / 1e6
        delays.append(batcher.queue_delay_us)
    return delays


def test_batcher_queue_delay_holds_the_p99_target() -> None:
    config = BatcherConfig(
        max_batch_size=8,
        max_queue_delay_us=20_000,
        target_p99_ms=P99_TARGET_MS,
        target_p99_tolerance=TOLERANCE,
        min_queue_delay_us=100,
    )
    batcher = DynamicBatcher(lambda items: items, config, name="embed")
    assert batcher.queue_delay_us == 20_000
    low, high = P99_TARGET_MS * (1 - TOLERANCE), P99_TARGET_MS * (1 + TOLERANCE)
    # Light: 2 ms compute, a 20 ms delay overshoots; it settles near 8 ms.
    light = _batches(batcher, 2.0, 300)
    assert low <= light[-1] / 1e3 + 2.0 <= high
    # Heavy: 7 ms compute; the delay shrinks (both latencies in the band after settling).
    heavy = _batches(batcher, 7.0, 300)
    assert heavy[-1] < light[-1]
    assert all(low <= d / 1e3 + 7.0 <= high for d in heavy[-100:])
    # Light again: it grows back.
    again = _batches(batcher, 2.0, 300)
    assert again[-1] > heavy[-1]
    assert all(low <= d / 1e3 + 2.0 <= high for d in again[-100:])
    # Compute alone over the target: the delay goes to its floor and stays within bounds.
    floor = _batches(batcher, 30.0, 300)
    assert floor[-1] == 100 and min(floor) >= 100


def test_batcher_without_a_target_keeps_its_delay() -> None:
    batcher = DynamicBatcher(lambda items: items, BatcherConfig(max_queue_delay_us=500))
    assert batcher.delay_controller is None
    assert _batches(batcher, 50.0, 30) == [500.0] * 30


def test_batcher_target_needs_a_maximum_delay() -> None:
    with pytest.raises(ConfigError, match="max_queue_delay_us"):
        BatcherConfig(target_p99_ms=10.0)


def test_repository_config_key_reaches_the_batcher(tmp_path) -> None:
    from qiao.repository.config import read_model_config

    path = tmp_path / "config.yaml"
    path.write_text(
        "backend: embedding\nmax_batch_size: 8\ndynamic_batching:\n"
        "  max_queue_delay_microseconds: 5000\n  target_p99_ms: 20\n"
    )
    config = BatcherConfig(**read_model_config(path).batcher_values())
    assert config.target_p99_ms == 20 and config.min_queue_delay_us == 100


def test_bench_serve_bursty_arrivals_keep_the_rate() -> None:
    from qiao.bench.serve import ServeConfig, make_jobs

    cfg = ServeConfig(base_url="http://unused", num_prompts=4000, burstiness=0.25)
    arrivals = [job.arrival for job in make_jobs(cfg, 10.0, seed=1)]
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    mean = statistics.fmean(gaps)
    assert 0.09 <= mean <= 0.11
    # Gamma of shape 0.25: coefficient of variation 2 (a Poisson process's is 1).
    assert statistics.pstdev(gaps) / mean > 1.6


def test_serve_settings_reach_the_engine_config(tiny_checkpoint) -> None:
    from qiao.api.server import engine_config
    from qiao.api.settings import ServeSettings

    settings = ServeSettings(
        model=str(tiny_checkpoint("llama")),
        target_itl_ms=20.0,
        target_itl_tolerance=0.1,
        adaptive_min_batched_tokens=64,
        embedding_target_p99_ms=30.0,
    )
    scheduler = engine_config(settings)[0].scheduler
    assert (scheduler.target_itl_ms, scheduler.target_itl_tolerance) == (20.0, 0.1)
    assert scheduler.adaptive_min_batched_tokens == 64


def test_metrics_export_the_choices() -> None:
    from types import SimpleNamespace

    from qiao.api.metrics import ServerMetrics

    class Engine:
        def stats(self):
            return {**_IDLE_STATS, "adaptive_token_budget": 96, "adaptive_step_time_seconds": 0.02}

    llm = SimpleNamespace(model="gen", version="1", engine=Engine())
    metrics = ServerMetrics(lambda: [llm])
    batcher = DynamicBatcher(
        lambda items: items,
        BatcherConfig(max_queue_delay_us=4000, target_p99_ms=5.0),
        name="embed",
        on_batch=metrics.batch_observer("embed", "1"),
    )
    batcher.on_batch.watch_engine(lambda: {})
    batcher._report(batcher.adapt(BatchStats(1, 1, (0.001,), 0.002)))
    text = metrics.render().decode()
    assert 'qiao:adaptive_token_budget{model_name="gen",version="1"} 96.0' in text
    assert 'qiao:adaptive_step_time_seconds{model_name="gen",version="1"} 0.02' in text
    assert 'qiao:adaptive_queue_delay_seconds{model_name="embed",version="1"} 0.004' in text
    assert 'qiao:adaptive_p99_latency_seconds{model_name="embed",version="1"} 0.003' in text


_IDLE_STATS = {
    "num_running": 0,
    "num_waiting": 0,
    "kv_cache_usage": 0.0,
    "num_preemptions": 0,
    "prefix_cache_queried_tokens": 0,
    "prefix_cache_hit_tokens": 0,
    "num_steps": 0,
}
