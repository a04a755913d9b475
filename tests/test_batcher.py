"""The dynamic batcher: batch forming (preferred sizes, delay, priorities), queue policy (full
queue, timeouts, cancellation), closing, failures, and that each request gets its own rows back.

A fake model stands in for `run_batch`: it records every batch and can hold the worker inside a
batch on a threading.Event, so "while the worker is busy" is a state, not a race.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np
import pytest

from qiao.engine.batcher import BatcherConfig, BatchStats, DynamicBatcher
from qiao.errors import ConfigError, EngineUnavailableError, QueueFullError, QueueTimeoutError

pytestmark = pytest.mark.timeout(60)

X = TypeVar("X")

HOLD = "hold"  # the item on which the fake model holds the worker until released
DELAY_US = 10_000
# As issue 5's acceptance: preferred sizes (4, 8), a 10 ms delay; rows cap well above 8.
ACCEPTANCE = BatcherConfig(preferred_batch_sizes=(4, 8), max_queue_delay_us=DELAY_US)


def answer(item: Any) -> Any:
    return f"<{item}>"


class FakeModel:
    """`run_batch` for the tests: answers `answer(item)` per item and records each batch; a batch
    holding HOLD blocks in the worker thread until `release` is set."""

    def __init__(self, fn: Callable[[list[Any]], list[Any]] | None = None) -> None:
        self.fn = fn or (lambda items: [answer(item) for item in items])
        self.batches: list[list[Any]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.threads: set[str] = set()
        self.running = 0
        self.max_running = 0
        self._lock = threading.Lock()

    def __call__(self, items: list[Any]) -> list[Any]:
        with self._lock:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        try:
            self.threads.add(threading.current_thread().name)
            self.batches.append(list(items))
            if any(isinstance(item, str) and item == HOLD for item in items):
                self.entered.set()
                assert self.release.wait(10), "the test never released the worker"
            return self.fn(items)
        finally:
            with self._lock:
                self.running -= 1

    def seen(self) -> list[Any]:
        return [item for batch in self.batches for item in batch]


def run(scenario: Callable[[], Awaitable[X]]) -> X:
    return asyncio.run(asyncio.wait_for(scenario(), 30))


async def hold_worker(batcher: DynamicBatcher, model: FakeModel) -> asyncio.Task:
    """Submit HOLD and return once the worker is inside that batch."""
    held = asyncio.create_task(batcher.submit(HOLD))
    assert await asyncio.to_thread(model.entered.wait, 10)
    return held


async def wait_queued(batcher: DynamicBatcher, count: int) -> None:
    """Let submitted tasks reach the queue (they enqueue on their first step)."""
    for _ in range(100):
        if batcher.queue_size == count:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"queue_size is {batcher.queue_size}, expected {count}")


# --- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_batch_size": 8, "preferred_batch_sizes": (4, 16)}, "preferred_batch_sizes"),
        ({"preferred_batch_sizes": (0,)}, "preferred_batch_sizes"),
        ({"max_queue_delay_us": -1}, "max_queue_delay_us"),
        ({"priority_levels": 0}, "priority_levels"),
        ({"priority_levels": 2, "default_priority_level": 3}, "default_priority_level"),
        ({"default_priority_level": -1}, "default_priority_level"),
        ({"max_queue_size": -5}, "max_queue_size"),
        ({"default_timeout_us": -1}, "default_timeout_us"),
        ({"max_batch_size": 2.5}, "max_batch_size"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        BatcherConfig(**kwargs)


def test_config_normalises_preferred_sizes_and_default_priority() -> None:
    config = BatcherConfig(max_batch_size=16, preferred_batch_sizes=[8, 4, 8])  # type: ignore[arg-type]
    assert config.preferred_batch_sizes == (4, 8)
    assert hash(config) == hash(BatcherConfig(max_batch_size=16, preferred_batch_sizes=(4, 8)))
    expected = {1: 1, 2: 1, 3: 2, 4: 2, 5: 3}
    assert {n: BatcherConfig(priority_levels=n).default_priority for n in expected} == expected
    assert BatcherConfig(priority_levels=4, default_priority_level=4).default_priority == 4


def test_submit_rejects_bad_rows_and_priority() -> None:
    async def scenario() -> None:
        model = FakeModel()
        batcher = DynamicBatcher(model, BatcherConfig(max_batch_size=4, priority_levels=2))
        try:
            with pytest.raises(ConfigError, match="rows"):
                await batcher.submit("a", rows=5)
            with pytest.raises(ConfigError, match="rows"):
                await batcher.submit("a", rows=0)
            for priority in (3, -1):
                with pytest.raises(ConfigError, match="priority"):
                    await batcher.submit("a", priority=priority)
            with pytest.raises(ConfigError, match="timeout_us"):
                await batcher.submit("a", timeout_us=-1)
            assert batcher.queue_size == 0
            assert await batcher.submit("ok", rows=4, priority=0) == answer("ok")
        finally:
            await batcher.close()
        assert model.seen() == ["ok"]

    run(scenario)


# --- batch forming --------------------------------------------------------------------------


def test_eight_concurrent_requests_run_as_one_batch_of_eight() -> None:
    async def scenario() -> None:
        stats: list[BatchStats] = []
        model = FakeModel()
        batcher = DynamicBatcher(model, ACCEPTANCE, name="enc", on_batch=stats.append)
        batcher.start()
        try:
            results = await asyncio.gather(*(batcher.submit(i) for i in range(8)))
        finally:
            await batcher.close()
        assert results == [answer(i) for i in range(8)]
        assert [(s.rows, s.requests) for s in stats] == [(8, 8)]
        # A preferred size was reached: nobody waited for the delay.
        assert max(stats[0].queue_times_s) < DELAY_US / 1e6
        assert model.batches == [list(range(8))]

    run(scenario)


def test_largest_reachable_preferred_size_runs_first_rest_after_the_delay() -> None:
    async def scenario() -> None:
        stats: list[BatchStats] = []
        model = FakeModel()
        config = BatcherConfig(
            max_batch_size=16, preferred_batch_sizes=(4, 8), max_queue_delay_us=DELAY_US
        )
        batcher = DynamicBatcher(model, config, on_batch=stats.append)
        batcher.start()
        try:
            # 11 rows: prefixes reach 4 and 8 -> 8 now; 3 rows reach no preferred size -> delay.
            results = await asyncio.gather(*(batcher.submit(i) for i in range(11)))
            assert results == [answer(i) for i in range(11)]
            # Multi-row requests: 3 + 3 skips 4, reaches no preferred size -> waits the delay;
            # 3 + 3 + 2 reaches 8 -> at once.
            await asyncio.gather(batcher.submit("a", rows=3), batcher.submit("b", rows=3))
            await asyncio.gather(
                *(batcher.submit(c, rows=r) for c, r in zip("cde", (3, 3, 2), strict=True))
            )
        finally:
            await batcher.close()
        assert [s.rows for s in stats] == [8, 3, 6, 8]
        assert max(stats[0].queue_times_s) < DELAY_US / 1e6
        assert min(stats[1].queue_times_s) >= DELAY_US / 1e6 * 0.95
        assert min(stats[2].queue_times_s) >= DELAY_US / 1e6 * 0.95
        assert max(stats[3].queue_times_s) < DELAY_US / 1e6
        assert model.batches[:2] == [list(range(8)), [8, 9, 10]]

    run(scenario)


def test_a_smaller_preferred_size_waits_the_delay_then_runs_first() -> None:
    async def scenario() -> None:
        stats: list[BatchStats] = []
        model = FakeModel()
        batcher = DynamicBatcher(model, ACCEPTANCE, on_batch=stats.append)
        batcher.start()
        try:
            # 5 rows reach 4 but not 8: wait for the delay (more may come), then run 4, then 1.
            results = await asyncio.gather(*(batcher.submit(i) for i in range(5)))
        finally:
            await batcher.close()
        assert results == [answer(i) for i in range(5)]
        assert model.batches == [[0, 1, 2, 3], [4]]
        assert min(stats[0].queue_times_s) >= DELAY_US / 1e6 * 0.95

    run(scenario)


def test_lone_request_waits_the_delay_and_no_longer() -> None:
    async def scenario() -> None:
        stats: list[BatchStats] = []
        execute_s = 0.005

        def slow(items: list[Any]) -> list[Any]:
            time.sleep(execute_s)  # stands in for model execution
            return [answer(item) for item in items]

        batcher = DynamicBatcher(FakeModel(slow), ACCEPTANCE, on_batch=stats.append)
        batcher.start()
        try:
            for item in range(3):
                begin = time.perf_counter()
                assert await batcher.submit(item) == answer(item)
                elapsed = time.perf_counter() - begin
                delay_s = DELAY_US / 1e6
                assert delay_s + execute_s <= elapsed < delay_s + execute_s + 0.05, elapsed
        finally:
            await batcher.close()
        assert [(s.rows, s.requests) for s in stats] == [(1, 1)] * 3
        for s in stats:
            assert DELAY_US / 1e6 <= s.queue_times_s[0] < DELAY_US / 1e6 + 0.05
            assert execute_s <= s.exec_time_s < execute_s + 0.05

    run(scenario)


def test_a_batch_that_cannot_grow_runs_without_waiting() -> None:
    async def scenario() -> None:
        stats: list[BatchStats] = []
        model = FakeModel()
        # No preferred sizes, a 10 s delay: only a full batch (or one the next request does not
        # fit) may run within the test's time.
        config = BatcherConfig(max_batch_size=8, max_queue_delay_us=10**7)
        batcher = DynamicBatcher(model, config, on_batch=stats.append)
        batcher.start()
        try:
            requests = [
                batcher.submit(name, rows=rows) for name, rows in [("a", 5), ("b", 4), ("c", 4)]
            ]
            results = await asyncio.wait_for(asyncio.gather(*requests), 5)
        finally:
            await batcher.close()
        assert results == [answer("a"), answer("b"), answer("c")]
        # 5 rows, then 4 does not fit -> run 5; 4 + 4 = max_batch_size -> run.
        assert model.batches == [["a"], ["b", "c"]]
        assert [s.rows for s in stats] == [5, 8]

    run(scenario)


def test_zero_delay_runs_what_is_queued_at_once() -> None:
    async def scenario() -> None:
        stats: list[BatchStats] = []
        model = FakeModel()
        config = BatcherConfig(max_batch_size=8, preferred_batch_sizes=(4, 8))
        batcher = DynamicBatcher(model, config, on_batch=stats.append)
        try:
            held = await hold_worker(batcher, model)
            waiting = [asyncio.create_task(batcher.submit(i)) for i in range(3)]
            await wait_queued(batcher, 3)
            assert batcher.in_flight == 1
            model.release.set()
            assert await held == answer(HOLD)
            assert await asyncio.gather(*waiting) == [answer(i) for i in range(3)]
        finally:
            model.release.set()
            await batcher.close()
        assert [s.rows for s in stats] == [1, 3]  # 3 reaches no preferred size; runs anyway

    run(scenario)


def test_each_request_gets_exactly_its_own_rows() -> None:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((5, 3))

    def embed(items: list[np.ndarray]) -> list[np.ndarray]:
        # Like an encoder: all rows in one matrix, one matmul, split back per request.
        out = np.concatenate(items) @ weight
        bounds = np.cumsum([len(item) for item in items])[:-1]
        return np.split(out, bounds)

    async def scenario() -> None:
        stats: list[BatchStats] = []
        model = FakeModel(embed)
        config = BatcherConfig(
            max_batch_size=8, preferred_batch_sizes=(4, 8), max_queue_delay_us=DELAY_US
        )
        batcher = DynamicBatcher(model, config, on_batch=stats.append)
        batcher.start()
        row_counts = [int(n) for n in rng.integers(1, 6, size=60)]
        payloads = [rng.standard_normal((n, 5)) for n in row_counts]
        try:
            results = await asyncio.gather(
                *(batcher.submit(p, rows=n) for p, n in zip(payloads, row_counts, strict=True))
            )
        finally:
            await batcher.close()
        for payload, result in zip(payloads, results, strict=True):
            np.testing.assert_allclose(result, payload @ weight, rtol=1e-12)
        # Every request ran once, in submission order, in batches of at most 8 rows.
        assert [id(item) for item in model.seen()] == [id(p) for p in payloads]
        assert all(1 <= s.rows <= 8 for s in stats)
        assert sum(s.rows for s in stats) == sum(row_counts)
        assert sum(s.requests for s in stats) == len(payloads)
        assert len(model.threads) == 1 and model.max_running == 1
        assert threading.current_thread().name not in model.threads

    run(scenario)


def test_higher_priority_overtakes_lower() -> None:
    async def scenario() -> None:
        model = FakeModel()
        config = BatcherConfig(max_batch_size=4, priority_levels=2, max_queue_delay_us=DELAY_US)
        batcher = DynamicBatcher(model, config)
        try:
            held = await hold_worker(batcher, model)
            low = [asyncio.create_task(batcher.submit(f"low{i}", priority=2)) for i in range(3)]
            await wait_queued(batcher, 3)
            high = [asyncio.create_task(batcher.submit(f"high{i}", priority=1)) for i in range(4)]
            await wait_queued(batcher, 7)
            model.release.set()
            await held
            assert await asyncio.gather(*low, *high) == [
                *(answer(f"low{i}") for i in range(3)),
                *(answer(f"high{i}") for i in range(4)),
            ]
        finally:
            model.release.set()
            await batcher.close()
        assert model.batches == [
            [HOLD],
            [f"high{i}" for i in range(4)],
            [f"low{i}" for i in range(3)],
        ]

    run(scenario)


def test_default_priority_is_the_middle_level() -> None:
    async def scenario() -> None:
        model = FakeModel()
        config = BatcherConfig(max_batch_size=1, priority_levels=3)
        batcher = DynamicBatcher(model, config)
        try:
            held = await hold_worker(batcher, model)
            tasks = [
                asyncio.create_task(batcher.submit(name, priority=priority))
                for name, priority in [("p3", 3), ("none", None), ("zero", 0), ("p1", 1)]
            ]
            await wait_queued(batcher, 4)
            model.release.set()
            await asyncio.gather(held, *tasks)
        finally:
            model.release.set()
            await batcher.close()
        assert model.seen() == [HOLD, "p1", "none", "zero", "p3"]

    run(scenario)


# --- queue policy ---------------------------------------------------------------------------


def test_full_queue_rejects_at_once() -> None:
    async def scenario() -> None:
        model = FakeModel()
        config = BatcherConfig(max_batch_size=8, max_queue_size=2, max_queue_delay_us=DELAY_US)
        batcher = DynamicBatcher(model, config, name="enc")
        try:
            held = await hold_worker(batcher, model)
            queued = [asyncio.create_task(batcher.submit(i)) for i in range(2)]
            await wait_queued(batcher, 2)
            begin = time.perf_counter()
            with pytest.raises(QueueFullError, match="enc"):
                await batcher.submit("rejected")
            assert time.perf_counter() - begin < DELAY_US / 1e6 / 2
            # "At once" structurally: the refusal comes on the coroutine's first step, before
            # it could suspend and wait for anything.
            submit = batcher.submit("rejected")
            with pytest.raises(QueueFullError):
                submit.send(None)
            assert not model.release.is_set() and batcher.queue_size == 2
            model.release.set()
            await held
            assert await asyncio.gather(*queued) == [answer(0), answer(1)]
            # Room again once the queue drained.
            assert await batcher.submit("later") == answer("later")
        finally:
            model.release.set()
            await batcher.close()
        assert "rejected" not in model.seen()

    run(scenario)


async def _time_out_while_held(config: BatcherConfig, timeout_us: int | None) -> float:
    """Hold the worker, queue one request, return how long it took to fail with
    QueueTimeoutError (before the worker is released); checks it never ran."""
    model = FakeModel()
    batcher = DynamicBatcher(model, config)
    try:
        held = await hold_worker(batcher, model)
        begin = time.perf_counter()
        with pytest.raises(QueueTimeoutError):
            await batcher.submit("late", timeout_us=timeout_us)
        elapsed = time.perf_counter() - begin
        assert not model.release.is_set()
        assert batcher.queue_size == 0
        model.release.set()
        await held
        assert await batcher.submit("next") == answer("next")
    finally:
        model.release.set()
        await batcher.close()
    assert "late" not in model.seen()
    return elapsed


def test_queue_timeout_rejects_while_the_worker_is_busy() -> None:
    config = BatcherConfig(default_timeout_us=20_000)
    elapsed = run(lambda: _time_out_while_held(config, None))
    assert 0.02 <= elapsed < 0.2


def test_timeout_override_is_honoured_only_when_allowed() -> None:
    allowed = BatcherConfig(default_timeout_us=0, allow_timeout_override=True)
    assert 0.02 <= run(lambda: _time_out_while_held(allowed, 20_000)) < 0.2
    # Not allowed: the request's 1 ms is ignored; the default of 40 ms applies.
    ignored = BatcherConfig(default_timeout_us=40_000, allow_timeout_override=False)
    assert 0.04 <= run(lambda: _time_out_while_held(ignored, 1_000)) < 0.25


def test_cancelled_submit_leaves_the_queue_and_never_runs() -> None:
    async def scenario() -> None:
        model = FakeModel()
        batcher = DynamicBatcher(model, BatcherConfig(max_batch_size=8))
        try:
            held = await hold_worker(batcher, model)
            gone = asyncio.create_task(batcher.submit("gone"))
            kept = asyncio.create_task(batcher.submit("kept"))
            await wait_queued(batcher, 2)
            gone.cancel()
            with pytest.raises(asyncio.CancelledError):
                await gone
            assert batcher.queue_size == 1
            model.release.set()
            await held
            assert await kept == answer("kept")
        finally:
            model.release.set()
            await batcher.close()
        assert model.batches == [[HOLD], ["kept"]]

    run(scenario)


def test_removal_that_completes_a_preferred_size_runs_the_batch() -> None:
    async def scenario() -> None:
        model = FakeModel()
        config = BatcherConfig(
            max_batch_size=8, preferred_batch_sizes=(4,), max_queue_delay_us=10**7
        )
        batcher = DynamicBatcher(model, config)
        try:
            a = asyncio.create_task(batcher.submit("a", rows=3))
            b = asyncio.create_task(batcher.submit("b", rows=2))
            c = asyncio.create_task(batcher.submit("c", rows=1))
            await wait_queued(batcher, 3)  # rows 3, 5, 6: no preferred size, a 10 s delay
            b.cancel()
            # Rows 3, 4 now: the batch runs without waiting for the delay.
            assert await asyncio.wait_for(asyncio.gather(a, c), 5) == [answer("a"), answer("c")]
        finally:
            await batcher.close()
        assert model.batches == [["a", "c"]]

    run(scenario)


# --- closing and failures -------------------------------------------------------------------


def test_close_with_drain_runs_everything_queued() -> None:
    async def scenario() -> None:
        model = FakeModel()
        # A 10 s delay and an unreachable preferred size: only draining runs these promptly.
        config = BatcherConfig(
            max_batch_size=8, preferred_batch_sizes=(8,), max_queue_delay_us=10**7
        )
        batcher = DynamicBatcher(model, config)
        try:
            held = asyncio.create_task(batcher.submit(HOLD, rows=8))
            assert await asyncio.to_thread(model.entered.wait, 10)
            queued = [asyncio.create_task(batcher.submit(i)) for i in range(3)]
            await wait_queued(batcher, 3)
            closing = asyncio.create_task(batcher.close(drain=True))
            await asyncio.sleep(0)
            with pytest.raises(EngineUnavailableError):
                await batcher.submit("after close")
            assert not closing.done()
            model.release.set()
            await asyncio.wait_for(closing, 5)
            assert all(task.done() for task in queued)
            assert [task.result() for task in queued] == [answer(i) for i in range(3)]
            assert await held == answer(HOLD)
        finally:
            model.release.set()
            await batcher.close()
        assert model.batches == [[HOLD], [0, 1, 2]]

    run(scenario)


def test_close_without_drain_fails_the_queue_and_finishes_the_running_batch() -> None:
    async def scenario() -> None:
        model = FakeModel()
        batcher = DynamicBatcher(
            model, BatcherConfig(max_batch_size=8, max_queue_delay_us=DELAY_US)
        )
        try:
            held = await hold_worker(batcher, model)
            queued = [asyncio.create_task(batcher.submit(i)) for i in range(3)]
            await wait_queued(batcher, 3)
            closing = asyncio.create_task(batcher.close(drain=False))
            # The queued requests fail at once, while the worker is still held.
            for task in queued:
                with pytest.raises(EngineUnavailableError):
                    await task
            assert not model.release.is_set() and not closing.done()
            with pytest.raises(EngineUnavailableError):
                await batcher.submit("after close")
            model.release.set()
            await asyncio.wait_for(closing, 5)
            assert await held == answer(HOLD)
        finally:
            model.release.set()
            await batcher.close()
        assert model.batches == [[HOLD]]

    run(scenario)


def test_a_failing_batch_fails_only_its_own_requests() -> None:
    def fragile(items: list[Any]) -> list[Any]:
        if "boom" in items:
            raise ValueError("model exploded")
        if "short" in items:
            return [answer(items[0])]  # one result too few
        return [answer(item) for item in items]

    async def scenario() -> None:
        stats: list[BatchStats] = []
        model = FakeModel(fragile)
        batcher = DynamicBatcher(model, BatcherConfig(max_batch_size=2), on_batch=stats.append)
        try:
            held = await hold_worker(batcher, model)
            names = ["boom", "x", "y", "z", "short", "w", "v"]
            tasks = [asyncio.create_task(batcher.submit(name)) for name in names]
            await wait_queued(batcher, len(names))
            model.release.set()
            outcomes = await asyncio.gather(held, *tasks, return_exceptions=True)
        finally:
            model.release.set()
            await batcher.close()
        assert model.batches == [[HOLD], ["boom", "x"], ["y", "z"], ["short", "w"], ["v"]]
        assert outcomes[0] == answer(HOLD)
        for failed in (outcomes[1], outcomes[2]):
            assert isinstance(failed, ValueError) and str(failed) == "model exploded"
        assert outcomes[3:5] == [answer("y"), answer("z")]
        for failed in (outcomes[5], outcomes[6]):
            assert isinstance(failed, RuntimeError) and "1 results for 2 requests" in str(failed)
        assert outcomes[7] == answer("v")
        assert [s.requests for s in stats] == [1, 2, 2, 2, 1]

    run(scenario)


def test_a_failing_on_batch_does_not_stop_the_batcher() -> None:
    async def scenario() -> None:
        calls: list[int] = []

        def broken_metrics(stats: BatchStats) -> None:
            calls.append(stats.rows)
            raise RuntimeError("metrics down")

        batcher = DynamicBatcher(FakeModel(), BatcherConfig(), on_batch=broken_metrics)
        try:
            assert await batcher.submit("a") == answer("a")
            assert await batcher.submit("b", rows=3) == answer("b")
        finally:
            await batcher.close()
        assert calls == [1, 3]

    run(scenario)


def test_the_versions_statistics_see_every_batch_beside_the_metrics() -> None:
    """`record_batch` (the version's Triton statistics) is called for each batch whatever the
    app set as `on_batch`; InferStatistics sums queue and compute per request and per size."""
    from qiao.repository.statistics import InferStatistics

    async def scenario() -> None:
        statistics = InferStatistics()
        seen: list[int] = []
        batcher = DynamicBatcher(FakeModel(), BatcherConfig(), record_batch=statistics.record_batch)
        batcher.on_batch = lambda stats: seen.append(stats.rows)  # set later, as the app does
        try:
            for item, rows in (("a", 1), ("b", 3), ("c", 1)):
                with statistics.request(rows):
                    assert await batcher.submit(item, rows=rows) == answer(item)
            with pytest.raises(ConfigError), statistics.request(1):
                await batcher.submit("d", rows=0)
        finally:
            await batcher.close()
        assert seen == [1, 3, 1]
        assert (statistics.inference_count, statistics.execution_count) == (5, 3)
        assert (statistics.success.count, statistics.fail.count) == (3, 1)
        assert statistics.queue.count == statistics.compute_infer.count == 3
        sizes = {size: b.compute_infer.count for size, b in statistics.batches.items()}
        assert sizes == {1: 2, 3: 1}
        assert statistics.compute_infer.ns == sum(
            b.compute_infer.ns for b in statistics.batches.values()
        )
        assert statistics.last_inference_ms > 0

    run(scenario)
