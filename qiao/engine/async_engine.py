"""The engine for online serving: `LLMEngine.step()` in a background thread, asyncio in front.

The API layer sees only `EngineClient`: `generate_all` / `generate` (async iterators of
outputs), `abort`, `health` and `stats`. Behind it one thread owns the `LLMEngine` (nothing else touches it): it
takes queued commands (add, abort), ends requests whose deadline passed, runs a step, and fans the
step's outputs into per-request asyncio queues. torch releases the GIL while computing, so the
event loop stays responsive during steps.

Admission is bounded: a request is refused at once (`QueueFullError` -> 503) when the sequences or
prompt tokens waiting to start would pass their limit; nothing queues without bound. The engine
requests of one API request (its prompts, each with n samples) are admitted together or not at
all, and a group larger than the limits themselves is refused as invalid (`ConfigError` -> 400):
no retry could ever admit it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from qiao.engine.breaker import BreakerConfig, CircuitBreaker
from qiao.engine.llm_engine import LLMEngine
from qiao.errors import ConfigError, EngineUnavailableError, QiaoError, QueueFullError
from qiao.outputs import RequestOutput
from qiao.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Longest single idle wait of the engine thread when a deadline is pending; it re-checks after.
_MAX_WAIT_S = 3600.0


@dataclass(frozen=True)
class EngineHealth:
    is_ready: bool
    reason: str = "ok"


@dataclass(frozen=True)
class AdmissionLimits:
    """Bounds on work that has not started yet (waiting in the scheduler or about to)."""

    max_waiting_seqs: int = 256
    max_waiting_tokens: int = 262144
    # Readiness fails when work is queued but no step completed for this long.
    stall_timeout: float = 30.0
    # Seconds between throughput / KV-usage log lines (0 = never).
    log_interval: float = 10.0
    # When repeated engine failures stop admission for a while (see `breaker`).
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    # The most memory one engine may hold (weights + KV cache), bytes; None: no bound.
    max_engine_memory: int | None = None


def check_engine_memory(memory: dict[str, int], limit: int | None) -> None:
    """Refuse an engine holding more than `limit` bytes, naming what to lower."""
    total = sum(memory.values())
    if limit is None or total <= limit:
        return
    gib = 2**30
    parts = ", ".join(
        f"{name.replace('_', ' ')} {size / gib:.2f} GiB" for name, size in memory.items()
    )
    raise ConfigError(
        f"max_engine_memory: the engine needs {total / gib:.2f} GiB ({parts}) but at most "
        f"{limit / gib:.2f} GiB is allowed: lower kv_cache_memory / num_kv_blocks, use a "
        "narrower dtype or quantization, or raise max_engine_memory"
    )


@dataclass
class GenerateRequest:
    """One engine request: a prompt and its sampling (n sequences), as the API admits it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    deadline: float | None = None  # time.monotonic() after which it ends with "timeout"
    arrival_time: float = field(default_factory=time.monotonic)
    # The LoRA adapter to run under (a name the engine has loaded); None: the base model.
    lora_name: str | None = None


class EngineClient(ABC):
    """The API layer's only door to an engine: a thread of this process (`AsyncEngine`) or a
    supervised engine process (`engine_process.ProcessEngine`)."""

    # Set by the server on SIGTERM: new requests are refused, readiness fails.
    draining: bool = False
    # Stops admission while the engine keeps failing (see breaker.py).
    breaker: CircuitBreaker

    @abstractmethod
    def start(self) -> None:
        """Start serving; call from the event loop that consumes the outputs."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop (blocking; call from a worker thread in async code)."""

    @abstractmethod
    def add_output_listener(self, listener: Callable[[list[RequestOutput]], None]) -> None:
        """Call `listener(outputs)` on the event loop with every step's outputs (for metrics)."""

    @abstractmethod
    def num_unfinished(self) -> int:
        """Requests admitted and not yet answered."""

    @abstractmethod
    def abort_all(self, reason: str = "abort") -> None:
        """End every request in flight."""

    @abstractmethod
    def generate_all(self, requests: Sequence[GenerateRequest]) -> list[RequestStream]:
        """Admit every request at once or none (raising), then stream each one's delta outputs
        until one has `finished`.

        Each stream has `aclose()`; closing it before the last output aborts its request.
        """

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        deadline: float | None = None,
    ) -> RequestStream:
        """`generate_all` for one request."""
        request = GenerateRequest(request_id, prompt_token_ids, params, priority, deadline)
        return self.generate_all([request])[0]

    @abstractmethod
    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End a request wherever it is (never blocks); an open stream gets its final output."""

    @property
    @abstractmethod
    def tokenizer(self) -> Any: ...

    @property
    @abstractmethod
    def max_model_len(self) -> int: ...

    @property
    @abstractmethod
    def max_sequence_tokens(self) -> int:
        """The most tokens (prompt + output) one sequence can hold: the context, or the KV
        cache when it is smaller."""

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @abstractmethod
    def health(self) -> EngineHealth: ...

    def lora_adapters(self) -> dict[str, str]:
        """The LoRA adapters requests can name: name -> folder (none unless the engine was
        started with enable_lora)."""
        return {}

    async def load_lora(self, name: str, path: str) -> None:
        """Load (or replace) a LoRA adapter at runtime; ConfigError when it cannot be."""
        raise ConfigError("this engine serves no LoRA adapters (start it with --enable-lora)")

    async def unload_lora(self, name: str) -> None:
        """Forget a LoRA adapter; ModelNotFoundError when it is not loaded."""
        raise ConfigError("this engine serves no LoRA adapters (start it with --enable-lora)")

    @abstractmethod
    def stats(self) -> dict[str, Any]: ...


def engine_failed_message(exc: Exception) -> str:
    # The type only: the message may carry internals; the log has the traceback.
    return f"the engine failed while serving this request ({type(exc).__name__}); retry"


def _engine_failed(exc: Exception) -> EngineUnavailableError:
    return EngineUnavailableError(engine_failed_message(exc))


@dataclass
class _Abort:
    request_id: str
    reason: str


@dataclass
class _LoRACommand:
    """Load (path given) or unload an adapter on the engine thread; `done` gets the outcome."""

    name: str
    path: str | None
    done: concurrent.futures.Future


def apply_lora_command(engine: Any, name: str, path: str | None) -> None:
    """Load an adapter under `name` from `path` (replacing one of that name), or unload it."""
    if path is None:
        engine.remove_lora(name)
    else:
        engine.load_lora(name, path)


def check_group(requests: Sequence[GenerateRequest], limits: AdmissionLimits) -> tuple[int, int]:
    """(sequences, prompt tokens) of one group of requests admitted together. Raises
    ConfigError (-> 400) when the group alone passes the waiting limits: no retry could admit it.
    """
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        raise QiaoError("request ids of one group must differ")
    num_seqs = sum(r.params.n for r in requests)
    num_tokens = sum(len(r.prompt_token_ids) * r.params.n for r in requests)
    if num_seqs > limits.max_waiting_seqs:
        field_name = "n" if len(requests) == 1 else "prompt"
        raise ConfigError(
            f"{field_name}: the request holds {num_seqs} sequences (prompts x n) but at most "
            f"{limits.max_waiting_seqs} may wait to start (max_waiting_requests); send fewer "
            "prompts or a smaller n",
            param=field_name,
        )
    if num_tokens > limits.max_waiting_tokens:
        raise ConfigError(
            f"prompt: the request holds {num_tokens} prompt tokens (prompts x n) but at most "
            f"{limits.max_waiting_tokens} may wait to start (max_waiting_tokens); send "
            "shorter or fewer prompts, or a smaller n",
            param="prompt",
        )
    return num_seqs, num_tokens


def check_room(limits: AdmissionLimits, queued: tuple[int, int], group: tuple[int, int]) -> None:
    """Raise QueueFullError (-> 503, retry) when a group of (sequences, prompt tokens) does not
    fit beside what already waits to start."""
    if queued[0] + group[0] > limits.max_waiting_seqs:
        raise QueueFullError(
            f"waiting queue is full ({queued[0]} of {limits.max_waiting_seqs} sequences); "
            "retry later"
        )
    if queued[1] + group[1] > limits.max_waiting_tokens:
        raise QueueFullError(
            f"waiting queue is full ({queued[1]} of {limits.max_waiting_tokens} prompt tokens); "
            "retry later"
        )


def completed_normally(output: RequestOutput) -> bool:
    """A finished output whose samples all ended by a stop condition or their length."""
    return output.finished and all(c.finish_reason in ("stop", "length") for c in output.outputs)


class RequestStream:
    """Delta outputs of one request; closing it before the last output aborts the request."""

    def __init__(
        self,
        engine: AsyncEngine,
        request_id: str,
        queue: asyncio.Queue[RequestOutput | BaseException],
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self._queue = queue
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        self.finished = isinstance(item, BaseException) or item.finished
        if self.finished:
            self.engine._queues.pop(self.request_id, None)
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self, reason: str = "abort") -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id, reason)
        self.engine._queues.pop(self.request_id, None)


class AsyncEngine(EngineClient):
    def __init__(
        self,
        engine: LLMEngine,
        limits: AdmissionLimits | None = None,
    ) -> None:
        self.engine = engine
        self.limits = limits or AdmissionLimits()
        self._listeners: list[Callable[[list[RequestOutput]], None]] = []
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._commands: list[GenerateRequest | _Abort | _LoRACommand] = []
        # Work not yet started: commands in flight plus the scheduler's waiting queue.
        self._queued_seqs = 0
        self._queued_tokens = 0
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._deadlines: list[tuple[float, str]] = []
        self._progress_time = time.monotonic()
        self._stats: dict[str, Any] = engine.stats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Set when the engine was built on its own thread (`build`): that thread waits for it.
        self._go: threading.Event | None = None
        self._stopping = False
        self.draining = False
        self.error: BaseException | None = None
        self.breaker = CircuitBreaker(self.limits.breaker, "this model version")

    # --- lifecycle -------------------------------------------------------------------------

    @classmethod
    def build(
        cls, factory: Callable[[], LLMEngine], limits: AdmissionLimits | None = None
    ) -> AsyncEngine:
        """Build the `LLMEngine` on the thread that will then run its steps, and return once it
        is built (raising what building raised).

        One thread for loading and stepping means one OpenMP thread team: torch's CPU kernels
        keep a team of workers per calling thread, and libgomp cuts its workers' spin-waiting
        short once a process has more of them than cores, so a second team (left by loading on
        the main thread) made every step's parallel regions wait for sleeping workers to wake:
        64-token serving steps took 190 ms instead of 130 ms on 2 cores.
        """
        built: list[AsyncEngine] = []
        failed: list[BaseException] = []
        ready, go = threading.Event(), threading.Event()

        def main() -> None:
            try:
                engine = factory()
                check_engine_memory(
                    engine.memory_bytes(), (limits or AdmissionLimits()).max_engine_memory
                )
                built.append(cls(engine, limits))
            except BaseException as exc:  # handed to the caller, re-raised there
                failed.append(exc)
            ready.set()
            if built:
                go.wait()
                built[0]._run()

        thread = threading.Thread(target=main, name="qiao-engine", daemon=True)
        thread.start()
        ready.wait()
        if failed:
            raise failed[0]
        engine = built[0]
        engine._thread, engine._go = thread, go
        return engine

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume outputs."""
        self._loop = asyncio.get_running_loop()
        if self._go is not None:  # built on its thread, which waits for this
            self._go.set()
            return
        self._thread = threading.Thread(target=self._run, name="qiao-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._go is not None:
            self._go.set()  # a built engine that never started: let its thread end
        if self._thread is not None:
            self._thread.join(timeout=30)

    def add_output_listener(self, listener: Callable[[list[RequestOutput]], None]) -> None:
        """Call `listener(outputs)` on the event loop with every step's outputs (for metrics)."""
        self._listeners.append(listener)

    def num_unfinished(self) -> int:
        return len(self._queues)

    def abort_all(self, reason: str = "abort") -> None:
        with self._lock:
            self._commands.extend(_Abort(rid, reason) for rid in self._queues)
        self._wakeup.set()

    # --- EngineClient --------------------------------------------------------------------------

    def generate_all(self, requests: Sequence[GenerateRequest]) -> list[RequestStream]:
        """Admit all now or none (raising ConfigError / QueueFullError / EngineUnavailableError
        at once), and stream each."""
        queues = self._admit(requests)
        return [RequestStream(self, r.request_id, q) for r, q in zip(requests, queues, strict=True)]

    def abort(self, request_id: str, reason: str = "abort") -> None:
        with self._lock:
            self._commands.append(_Abort(request_id, reason))
        self._wakeup.set()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_sequence_tokens(self) -> int:
        return self.engine.max_sequence_tokens

    @property
    def vocab_size(self) -> int:
        return self.engine.arch.vocab_size

    def health(self) -> EngineHealth:
        if self._thread is None or not self._thread.is_alive():
            return EngineHealth(False, "engine loop is not running")
        if self.draining:
            return EngineHealth(False, "draining")
        with self._lock:
            has_work = bool(self._queues) or bool(self._commands)
            idle_for = time.monotonic() - self._progress_time
        if has_work and idle_for > self.limits.stall_timeout:
            return EngineHealth(False, f"engine stalled: no step completed for {idle_for:.1f} s")
        return EngineHealth(True)

    def lora_adapters(self) -> dict[str, str]:
        return {r.lora_name: r.lora_path for r in self.engine.list_loras()}

    async def load_lora(self, name: str, path: str) -> None:
        await self._lora_command(name, path)

    async def unload_lora(self, name: str) -> None:
        await self._lora_command(name, None)

    async def _lora_command(self, name: str, path: str | None) -> None:
        """Run on the engine thread between steps (its slots are never written mid-step)."""
        if self._thread is None or not self._thread.is_alive():
            raise EngineUnavailableError("the engine loop is not running")
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._commands.append(_LoRACommand(name, path, done))
        self._wakeup.set()
        await asyncio.wrap_future(done)

    def stats(self) -> dict[str, Any]:
        alive = self._thread is not None and self._thread.is_alive()
        return {
            **self._stats,
            "engine_up": int(alive),
            "engine_restarts": 0,
            "breaker_state": int(self.breaker.state),
            "breaker_opened": self.breaker.num_opened,
        }

    # --- admission (event-loop side) ------------------------------------------------------------

    def _admit(
        self, requests: Sequence[GenerateRequest]
    ) -> list[asyncio.Queue[RequestOutput | BaseException]]:
        """Queue every request of one group, or none: the limits are checked for the whole."""
        if self.draining or self._stopping:
            raise EngineUnavailableError("the server is shutting down; retry on another replica")
        self.breaker.allow()
        ids = [r.request_id for r in requests]
        num_seqs, num_tokens = check_group(requests, self.limits)
        limits = self.limits
        queues: list[asyncio.Queue[RequestOutput | BaseException]] = [
            asyncio.Queue() for _ in requests
        ]
        with self._lock:
            in_flight = next((rid for rid in ids if rid in self._queues), None)
            if in_flight is not None:
                raise QiaoError(f"request id {in_flight!r} is already in flight")
            check_room(limits, (self._queued_seqs, self._queued_tokens), (num_seqs, num_tokens))
            if not self._queues and not self._commands:
                self._progress_time = time.monotonic()  # idle until now is not a stall
            self._queued_seqs += num_seqs
            self._queued_tokens += num_tokens
            for request, queue in zip(requests, queues, strict=True):
                self._queues[request.request_id] = queue
            self._commands.extend(requests)
        self._wakeup.set()
        return queues

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if completed_normally(output):
                self.breaker.record_success()
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)
        for listener in self._listeners:
            listener(outputs)

    def _fail(self, request_id: str, error: BaseException) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(error)

    # --- engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        last_log = time.monotonic()
        last_counts = (0, 0)
        while not self._stopping:
            try:
                self._iterate()
            except Exception as exc:  # a bug anywhere in an iteration must not kill the loop
                logger.exception("engine iteration failed; failing the requests in flight")
                self._post(self._deliver, self._fail_all(exc))
            now = time.monotonic()
            if self.limits.log_interval and now - last_log >= self.limits.log_interval:
                last_counts = log_throughput(self._stats, now - last_log, last_counts)
                last_log = now
            if not self.engine.has_unfinished_requests():
                self._wait_for_work()

    def _iterate(self) -> None:
        """One turn of the loop: commands, deadlines, a step, then hand the outputs off."""
        outputs = self._apply_commands() + self._expire_deadlines()
        if self.engine.has_unfinished_requests():
            outputs += self.engine.step()
            # Requests a failing step ended alone: their errors go ahead of their last output.
            for request_id, error in self.engine.take_failed_requests():
                self.breaker.record_failure()
                self._post(self._fail, request_id, error)
        with self._lock:
            self._progress_time = time.monotonic()
            self._publish_stats()
        if outputs:
            self._post(self._deliver, outputs)

    def _wait_for_work(self) -> None:
        timeout = self.limits.log_interval or None
        if self._deadlines:
            # Capped: a far deadline (a client may send `timeout: 1e308`) would overflow the wait.
            until_deadline = min(max(self._deadlines[0][0] - time.monotonic(), 0.0), _MAX_WAIT_S)
            timeout = until_deadline if timeout is None else min(timeout, until_deadline)
        self._wakeup.wait(timeout)
        self._wakeup.clear()

    def _apply_commands(self) -> list[RequestOutput]:
        with self._lock:
            commands, self._commands = self._commands, []
        outputs: list[RequestOutput] = []
        for command in commands:
            if isinstance(command, _Abort):
                outputs += self.engine.abort_request([command.request_id], reason=command.reason)
                continue
            if isinstance(command, _LoRACommand):
                try:
                    apply_lora_command(self.engine, command.name, command.path)
                except Exception as exc:
                    command.done.set_exception(exc)
                else:
                    command.done.set_result(None)
                continue
            try:
                self.engine.add_request(
                    command.request_id,
                    command.prompt_token_ids,
                    command.params,
                    priority=command.priority,
                    stream=True,
                    arrival_time=command.arrival_time,
                    lora_request=command.lora_name,
                )
            except QiaoError as exc:
                self._post(self._fail, command.request_id, exc)
                continue
            except Exception as exc:  # a bug: this request fails, the loop goes on
                logger.exception("adding request %s failed", command.request_id)
                self._post(self._fail, command.request_id, _engine_failed(exc))
                continue
            if command.deadline is not None:
                heapq.heappush(self._deadlines, (command.deadline, command.request_id))
        return outputs

    def _expire_deadlines(self) -> list[RequestOutput]:
        now = time.monotonic()
        live = self.engine.output_processor.states
        if len(self._deadlines) > 2 * len(live) + 64:
            # Requests that finished before their deadline leave entries behind; a far deadline
            # (`timeout: 1e308`) would keep them forever.
            self._deadlines = [entry for entry in self._deadlines if entry[1] in live]
            heapq.heapify(self._deadlines)
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            expired.append(heapq.heappop(self._deadlines)[1])
        if not expired:
            return []
        return self.engine.abort_request(expired, reason="timeout")

    def _fail_all(self, exc: Exception) -> list[RequestOutput]:
        """Fail every request in flight: those in the engine and those still in the API."""
        request_ids = list(self.engine.output_processor.states)
        self.breaker.record_failure()
        with self._lock:
            waiting = set(self._queues) | set(request_ids)
            # Adds not applied yet are failed too: drop them so they never run unwatched.
            self._commands = [c for c in self._commands if not isinstance(c, GenerateRequest)]
        error = _engine_failed(exc)
        for request_id in waiting:
            self._post(self._fail, request_id, error)
        try:
            self.engine.abort_request(request_ids)
        except Exception:
            logger.exception("could not abort the failed requests")
        with self._lock:
            self._publish_stats()
        return []

    def _publish_stats(self) -> None:
        """Called under the lock: exact queue accounting and a stats snapshot for readers."""
        stats = self.engine.stats()
        pending = [c for c in self._commands if isinstance(c, GenerateRequest)]
        self._queued_seqs = stats["num_waiting"] + sum(c.params.n for c in pending)
        self._queued_tokens = stats["num_waiting_tokens"] + sum(
            len(c.prompt_token_ids) * c.params.n for c in pending
        )
        self._stats = stats

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)


def log_throughput(stats: dict[str, Any], elapsed: float, last: tuple[int, int]) -> tuple[int, int]:
    """Log one throughput line from an engine's stats (computed and generated tokens since
    `last`, over `elapsed` s); an idle engine stays quiet. Returns the new counts."""
    computed = stats["num_computed_tokens_total"]
    generated = stats["num_generated_tokens_total"]
    idle = stats["num_running"] == 0 and stats["num_waiting"] == 0
    if idle and (computed, generated) == last:
        return last
    logger.info(
        "throughput: %.1f computed tok/s, %.1f generated tok/s | running %d, waiting %d | "
        "KV cache %.1f%% | prefix-cache hit rate %.1f%%",
        (computed - last[0]) / elapsed,
        (generated - last[1]) / elapsed,
        stats["num_running"],
        stats["num_waiting"],
        100 * stats["kv_cache_usage"],
        100 * stats["prefix_cache_hit_tokens"] / max(stats["prefix_cache_queried_tokens"], 1),
    )
    return computed, generated
