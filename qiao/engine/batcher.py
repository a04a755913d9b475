"""The dynamic batcher of non-generative models: one queue per model version that forms batches.

Triton's dynamic batching semantics. Requests wait in priority levels (1 = highest; FIFO within
a level). A batch takes whole requests in that order while their rows fit `max_batch_size`, and
runs as soon as:

- its rows reach the largest preferred batch size (with no preferred sizes, `max_batch_size`);
- it cannot grow: the next queued request does not fit;
- the oldest queued request has waited `max_queue_delay_us` (a delay of 0: at once), or the
  batcher is closing with `drain=True`. Then it runs the longest prefix whose rows are a
  preferred size, or, when no prefix is, everything that fits.

E.g. preferred sizes (4, 8), requests of 1 row: 8 arriving within the delay run as one batch of
8; 5 queued wait for the delay, then run 4, and the fifth right after (its delay has passed).

`run_batch` is blocking model code. It runs in one worker thread per batcher, so calls never
overlap and the event loop never waits on them; requests that arrive meanwhile queue for the next
batch. Everything else (queue, timers, futures) lives on the event loop thread: no locks, no
polling; the delay and the queue timeouts are `loop.call_at` timers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from qiao.engine.adaptive import BudgetController, LatencyWindow
from qiao.errors import ConfigError, EngineUnavailableError, QueueFullError, QueueTimeoutError

logger = logging.getLogger(__name__)

# Latencies the p99 window holds before adaptive batching acts on it (and after each move).
MIN_P99_SAMPLES = 20

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class BatcherConfig:
    """Batching and queue policy of one model version (Triton's `dynamic_batching`)."""

    max_batch_size: int = 64  # rows per batch, a hard cap
    preferred_batch_sizes: tuple[int, ...] = ()  # rows; stored sorted and deduplicated
    max_queue_delay_us: int = 0  # longest wait of the oldest request for a fuller batch
    priority_levels: int = 1  # levels 1 (highest) .. priority_levels
    # Level of requests that give none (or 0). 0 here = the middle level, rounded towards higher
    # priority: (priority_levels + 1) // 2, so 1 of 1, 1 of 2, 2 of 3, 2 of 4.
    default_priority_level: int = 0
    max_queue_size: int = 0  # requests waiting, all levels together; 0 = unbounded
    default_timeout_us: int = 0  # longest wait in the queue; 0 = none
    # Whether a request's own `timeout_us` replaces `default_timeout_us`. When not allowed, a
    # request's timeout is ignored (as Triton does), so clients may always send one.
    allow_timeout_override: bool = False
    # Adaptive batching (qiao/engine/adaptive.py): the queue delay moves within
    # [min_queue_delay_us, max_queue_delay_us] to hold the p99 of request latency (queue wait
    # + compute, over the last requests) at target_p99_ms * (1 ± target_p99_tolerance).
    # None: off (the delay is max_queue_delay_us).
    target_p99_ms: float | None = None
    target_p99_tolerance: float = 0.2
    min_queue_delay_us: int = 100

    def __post_init__(self) -> None:
        _check_int("max_batch_size", self.max_batch_size, minimum=1)
        _check_int("min_queue_delay_us", self.min_queue_delay_us, minimum=1)
        if self.target_p99_ms is not None:
            if self.target_p99_ms <= 0:
                raise ConfigError(f"target_p99_ms must be > 0, got {self.target_p99_ms!r}")
            if not 0 <= self.target_p99_tolerance < 1:
                raise ConfigError(
                    f"target_p99_tolerance must be in [0, 1), got {self.target_p99_tolerance!r}"
                )
            if self.max_queue_delay_us < self.min_queue_delay_us:
                raise ConfigError(
                    f"target_p99_ms needs max_queue_delay_us >= min_queue_delay_us "
                    f"({self.min_queue_delay_us}): the most the queue delay may grow to, got "
                    f"{self.max_queue_delay_us}"
                )
        _check_int("max_queue_delay_us", self.max_queue_delay_us, minimum=0)
        _check_int("priority_levels", self.priority_levels, minimum=1)
        _check_int("default_priority_level", self.default_priority_level, minimum=0)
        if self.default_priority_level > self.priority_levels:
            raise ConfigError(
                f"default_priority_level must be within 0..priority_levels "
                f"({self.priority_levels}), got {self.default_priority_level}"
            )
        _check_int("max_queue_size", self.max_queue_size, minimum=0)
        _check_int("default_timeout_us", self.default_timeout_us, minimum=0)
        sizes = tuple(self.preferred_batch_sizes)
        for size in sizes:
            _check_int("preferred_batch_sizes", size, minimum=1)
            if size > self.max_batch_size:
                raise ConfigError(
                    f"preferred_batch_sizes: {size} exceeds max_batch_size ({self.max_batch_size})"
                )
        object.__setattr__(self, "preferred_batch_sizes", tuple(sorted(set(sizes))))

    @property
    def default_priority(self) -> int:
        """The level a request without a priority (or with 0) queues at."""
        return self.default_priority_level or (self.priority_levels + 1) // 2


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class BatchStats:
    """What one executed batch looked like; passed to `on_batch` (for metrics) after each batch,
    successful or not."""

    rows: int  # rows of all requests in the batch
    requests: int
    queue_times_s: tuple[float, ...]  # per request, from submit to the start of the batch
    exec_time_s: float  # wall time of run_batch, seen from the event loop
    # Adaptive batching's queue delay after this batch and the p99 latency it holds (None: off).
    queue_delay_s: float | None = None
    p99_latency_s: float | None = None


@dataclass(eq=False)  # identity hash: requests are keys of the level dicts
class _Request(Generic[T, R]):
    item: T
    rows: int
    level: int
    enqueue_time: float  # loop.time()
    future: asyncio.Future[R]
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


class _PriorityQueue(Generic[T, R]):
    """Waiting requests by level; a dict per level is an ordered set with O(1) removal."""

    def __init__(self, priority_levels: int) -> None:
        self._levels: list[dict[_Request[T, R], None]] = [{} for _ in range(priority_levels)]
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[_Request[T, R]]:
        """Requests in batching order: level 1 first, FIFO within a level."""
        for level in self._levels:
            yield from level

    def push(self, request: _Request[T, R]) -> None:
        self._levels[request.level - 1][request] = None
        self._size += 1

    def remove(self, request: _Request[T, R]) -> bool:
        """Take `request` out; False if it is not queued (running, done or already removed)."""
        level = self._levels[request.level - 1]
        if request not in level:
            return False
        del level[request]
        self._size -= 1
        return True

    def oldest_enqueue_time(self) -> float:
        # Each level is FIFO, so its first request is its oldest.
        return min(next(iter(level)).enqueue_time for level in self._levels if level)


class DynamicBatcher(Generic[T, R]):
    """Queues `submit`ted items and runs them in batches through `run_batch(items) -> results`.

    `run_batch` gets the items of one batch in queue order and must return one result per item;
    each request gets exactly its own result. If it raises (or returns the wrong count), every
    request of that batch fails with that exception and the batcher goes on.
    """

    def __init__(
        self,
        run_batch: Callable[[list[T]], Sequence[R]],
        config: BatcherConfig,
        *,
        name: str = "",
        on_batch: Callable[[BatchStats], None] | None = None,
        record_batch: Callable[[BatchStats], None] | None = None,
    ) -> None:
        self.config = config
        self.name = name
        self._run_batch = run_batch
        self.on_batch = on_batch  # the metrics' observer (the app may set it later)
        self._record_batch = record_batch  # the version's own statistics
        self._queue: _PriorityQueue[T, R] = _PriorityQueue(config.priority_levels)
        self._num_in_flight = 0
        self._is_closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        # The longest wait for a fuller batch: adaptive batching's choice when a target is set.
        self.queue_delay_us = float(config.max_queue_delay_us)
        self.delay_controller: BudgetController | None = None
        self.latencies = LatencyWindow(size=100, horizon_s=5.0)
        if config.target_p99_ms is not None:
            self.delay_controller = BudgetController(
                config.target_p99_ms,
                config.target_p99_tolerance,
                lo=config.min_queue_delay_us,
                hi=config.max_queue_delay_us,
                start=config.max_queue_delay_us,
                integer=False,
                interval=1,  # the window's MIN_P99_SAMPLES spaces the moves
                name=f"queue delay (us) of {name!r}",
            )

    @property
    def queue_size(self) -> int:
        """Requests waiting for a batch."""
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        """Requests in the batch that is executing now."""
        return self._num_in_flight

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the scheduling task and the worker thread; call from the running event loop
        that will submit. Idempotent; `submit` calls it when it has not been called."""
        if self._task is not None:
            return
        if self._is_closed:
            raise EngineUnavailableError(f"batcher {self.name!r} is closed")
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"qiao-batcher-{self.name}")
        self._task = self._loop.create_task(self._schedule(), name=f"qiao-batcher-{self.name}")

    async def close(self, *, drain: bool = True) -> None:
        """Stop accepting requests (`submit` raises EngineUnavailableError from now on). With
        `drain`, run every queued request first, without waiting for fuller batches; without,
        fail the queued ones with EngineUnavailableError. The executing batch always finishes.
        Returns once the worker is idle."""
        self._is_closed = True
        if not drain:
            error = EngineUnavailableError(f"batcher {self.name!r} closed before this request ran")
            for request in list(self._queue):
                self._drop(request, error)
        if self._task is None:
            return
        assert self._wakeup is not None and self._executor is not None
        self._wakeup.set()
        # Shielded: cancelling a caller of close() must not cancel the in-flight batch.
        await asyncio.shield(self._task)
        self._executor.shutdown(wait=False)

    # --- requests -------------------------------------------------------------------------------

    async def submit(
        self,
        item: T,
        *,
        rows: int = 1,
        priority: int | None = None,
        timeout_us: int | None = None,
    ) -> R:
        """Queue `item` (`rows` rows of the batch) and return its result.

        Raises at once: ConfigError for bad rows / priority / timeout, QueueFullError when
        `max_queue_size` requests wait, EngineUnavailableError after `close`. Later:
        QueueTimeoutError when the queue timeout passes before the item runs, or whatever
        `run_batch` raised. Cancelling the call takes a queued item out of the queue.
        """
        if self._is_closed:
            raise EngineUnavailableError(f"batcher {self.name!r} is closed; retry")
        request = self._make_request(item, rows, priority, timeout_us)
        try:
            return await request.future
        except asyncio.CancelledError:
            if self._queue.remove(request):
                self._after_removal(request)
            raise

    def _make_request(
        self, item: T, rows: int, priority: int | None, timeout_us: int | None
    ) -> _Request[T, R]:
        config = self.config
        _check_int("rows", rows, minimum=1)
        if rows > config.max_batch_size:
            raise ConfigError(
                f"rows: {rows} exceeds the max_batch_size of model {self.name!r} "
                f"({config.max_batch_size}); split the request"
            )
        level = priority or config.default_priority
        if not 1 <= level <= config.priority_levels:
            raise ConfigError(
                f"priority must be within 1..{config.priority_levels} (or 0 for the default), "
                f"got {priority}"
            )
        if timeout_us is not None and timeout_us < 0:
            raise ConfigError(f"timeout_us must be >= 0, got {timeout_us}")
        if config.max_queue_size and len(self._queue) >= config.max_queue_size:
            raise QueueFullError(
                f"the queue of model {self.name!r} is full ({config.max_queue_size} requests); "
                "retry later"
            )
        self.start()
        assert self._loop is not None and self._wakeup is not None
        now = self._loop.time()
        request: _Request[T, R] = _Request(item, rows, level, now, self._loop.create_future())
        if config.allow_timeout_override and timeout_us is not None:
            timeout_us_used = timeout_us
        else:
            timeout_us_used = config.default_timeout_us
        if timeout_us_used:
            request.timer = self._loop.call_at(now + timeout_us_used / 1e6, self._expire, request)
        self._queue.push(request)
        self._wakeup.set()
        return request

    def _expire(self, request: _Request[T, R]) -> None:
        assert self._loop is not None
        waited_ms = (self._loop.time() - request.enqueue_time) * 1e3
        error = QueueTimeoutError(
            f"the request waited {waited_ms:.1f} ms in the queue of model {self.name!r}, past "
            "its queue timeout, and was not run"
        )
        self._drop(request, error)

    def _drop(self, request: _Request[T, R], error: BaseException) -> None:
        """Take a queued request out and fail it with `error`."""
        if not self._queue.remove(request):
            return
        self._after_removal(request)
        if not request.future.done():
            request.future.set_exception(error)

    def _after_removal(self, request: _Request[T, R]) -> None:
        if request.timer is not None:
            request.timer.cancel()
        # A removal can complete a preferred size (rows 3, [2 removed], 1 -> 4): re-plan.
        if self._wakeup is not None:
            self._wakeup.set()

    # --- scheduling -----------------------------------------------------------------------------

    async def _schedule(self) -> None:
        """The batcher's loop: wait for a batch, run it, repeat; ends when closed and empty."""
        try:
            while (batch := await self._next_batch()) is not None:
                await self._execute(batch)
        except Exception as exc:  # a bug here must not leave requests waiting forever
            logger.exception("batcher %r failed; failing its queued requests", self.name)
            self._is_closed = True
            error = EngineUnavailableError(f"batcher {self.name!r} failed ({type(exc).__name__})")
            for request in list(self._queue):
                self._drop(request, error)

    async def _next_batch(self) -> list[_Request[T, R]] | None:
        assert self._loop is not None and self._wakeup is not None
        while True:
            self._wakeup.clear()
            batch, wake_at = self._plan(self._loop.time())
            if batch:
                return batch
            if self._is_closed and not self._queue:
                return None
            timer = self._loop.call_at(wake_at, self._wakeup.set) if wake_at is not None else None
            try:
                await self._wakeup.wait()
            finally:
                if timer is not None:
                    timer.cancel()

    def _plan(self, now: float) -> tuple[list[_Request[T, R]], float | None]:
        """The batch to run now, else ([], when the oldest request's delay ends or None when
        nothing waits). The batch is a prefix of the queue in batching order."""
        config = self.config
        # The size worth waiting for: the largest preferred size, else a full batch.
        target = max(config.preferred_batch_sizes, default=config.max_batch_size)
        batch: list[_Request[T, R]] = []
        rows = 0
        preferred_cut = 0  # length of the longest prefix whose rows are a preferred size
        is_full = False
        for request in self._queue:
            if rows + request.rows > config.max_batch_size:
                is_full = True
                break
            batch.append(request)
            rows += request.rows
            if rows in config.preferred_batch_sizes:
                preferred_cut = len(batch)
            if rows == target:
                return batch, None
        if not batch:
            return [], None
        wake_at = self._queue.oldest_enqueue_time() + self.queue_delay_us / 1e6
        if is_full or rows == config.max_batch_size or self._is_closed or now >= wake_at:
            # Cannot grow, or waited long enough: the largest preferred size there is, else all.
            return batch[: preferred_cut or len(batch)], None
        return [], wake_at

    async def _execute(self, batch: list[_Request[T, R]]) -> None:
        assert self._loop is not None
        start = self._loop.time()
        for request in batch:
            self._queue.remove(request)
            if request.timer is not None:
                request.timer.cancel()
        self._num_in_flight = len(batch)
        items = [request.item for request in batch]
        try:
            results = await self._loop.run_in_executor(self._executor, self._call, items)
        except Exception as exc:
            logger.warning("batch of model %r failed: %r", self.name, exc)
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(exc)
        else:
            for request, result in zip(batch, results, strict=True):
                if not request.future.done():  # a cancelled caller's result is dropped
                    request.future.set_result(result)
        finally:
            self._num_in_flight = 0
        stats = BatchStats(
            rows=sum(request.rows for request in batch),
            requests=len(batch),
            queue_times_s=tuple(start - request.enqueue_time for request in batch),
            exec_time_s=self._loop.time() - start,
        )
        self._report(self.adapt(stats))

    def adapt(self, stats: BatchStats) -> BatchStats:
        """Feed a batch's request latencies (queue wait + compute) to the delay controller:
        the p99 over the recent requests moves the queue delay (a p99 above target shortens it,
        one below lets batches fill longer). Returns `stats` with the choice (unchanged when
        no target is set)."""
        controller = self.delay_controller
        if controller is None:
            return stats
        for waited in stats.queue_times_s:
            self.latencies.add(waited + stats.exec_time_s)
        p99 = self.latencies.quantile(0.99)
        assert p99 is not None
        if len(self.latencies) >= MIN_P99_SAMPLES:
            new = controller.observe(p99 * 1000.0)
            if new is not None:
                # The window restarts: its latencies were of the old delay.
                self.queue_delay_us = new
                self.latencies.clear()
        return dataclasses.replace(
            stats, queue_delay_s=self.queue_delay_us / 1e6, p99_latency_s=p99
        )

    def _call(self, items: list[T]) -> list[R]:
        """In the worker thread: run the batch and check it answered every item."""
        results = list(self._run_batch(items))
        if len(results) != len(items):
            raise RuntimeError(
                f"run_batch of model {self.name!r} returned {len(results)} results for "
                f"{len(items)} requests"
            )
        return results

    def _report(self, stats: BatchStats) -> None:
        for observe in (self._record_batch, self.on_batch):
            if observe is None:
                continue
            try:
                observe(stats)
            except Exception:  # metrics must not stop the batcher
                logger.exception("batch observer of model %r failed", self.name)
