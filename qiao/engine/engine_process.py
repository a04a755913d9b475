"""An engine in its own process, supervised: the `EngineClient` `qiao serve` uses for an LLM.

The API process keeps HTTP, validation, tokenization, detokenization (text, stop strings and
logprob token texts, `DeltaDetokenizer`), admission and the per-request queues; the engine
process (`engine_worker`) schedules and runs the model and sends token ids. They talk in msgpack frames over a
socket pair (`wire`): one `add` frame per API request (its prompts admitted together), one `step`
frame back per engine step with every output of that step.

Supervision: when the engine process exits for any reason (an exception that escapes, SIGKILL,
SIGSEGV in a kernel, the OOM killer), every request it held is answered at once (503,
`code: "engine_restarted"`, Retry-After; a stream ends with `finish_reason: "error"` and an
error event), readiness fails, the log names the exit code or signal, and a new engine process
starts after a delay that doubles with each failure in a row (1 s, 2 s, ... 30 s; back to 1 s
once one has run for a minute). An engine that holds work but finishes no step for the stall
timeout is killed and restarted the same way.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from qiao import errors
from qiao.config import EngineConfig
from qiao.engine import wire
from qiao.engine.async_engine import (
    AdmissionLimits,
    EngineClient,
    EngineHealth,
    GenerateRequest,
    RequestStream,
    check_engine_memory,
    check_group,
    check_room,
    completed_normally,
)
from qiao.engine.breaker import CircuitBreaker
from qiao.engine.output_processor import DeltaDetokenizer
from qiao.errors import (
    ConfigError,
    EngineRestartedError,
    EngineUnavailableError,
    ModelLoadError,
    QiaoError,
)
from qiao.outputs import RequestOutput
from qiao.tokenizer import load_tokenizer

logger = logging.getLogger("qiao.engine.supervisor")

FIRST_RESTART_DELAY_S = 1.0
MAX_RESTART_DELAY_S = 30.0
# An engine process that ran this long resets the restart delay to its first value.
HEALTHY_RUN_S = 60.0
STOP_TIMEOUT_S = 10.0


class _Child:
    """One engine process and the API process's end of its socket."""

    def __init__(self, settings: dict[str, Any]) -> None:
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "qiao.engine.engine_worker", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        self.sock = ours
        self.sock.sendall(wire.pack(settings))
        self.started = time.monotonic()
        self.ready: dict[str, Any] = {}

    def wait_ready(self) -> dict[str, Any]:
        """Block until the engine is built; raise what stopped it otherwise."""
        frame = wire.recv_frame(self.sock)
        if frame is not None and frame["t"] == "ready":
            self.ready = frame
            return frame
        self.sock.close()
        code = self.proc.wait()
        if frame is not None and frame["t"] == "failed":
            raise ModelLoadError(f"the engine process failed to start: {frame['error']}")
        raise ModelLoadError(f"the engine process exited while starting ({describe_exit(code)})")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class ProcessEngine(EngineClient):
    def __init__(
        self,
        settings: dict[str, Any],
        child: _Child,
        tokenizer: Any,
        limits: AdmissionLimits,
    ) -> None:
        self._settings = settings
        self._child: _Child | None = child
        self._tokenizer = tokenizer
        self.limits = limits
        ready = child.ready
        self._max_model_len = ready["max_model_len"]
        self._vocab_size = ready["vocab_size"]
        self._max_sequence_tokens = ready["max_sequence_tokens"]
        self._stats: dict[str, Any] = ready["stats"]
        self._listeners: list[Callable[[list[RequestOutput]], None]] = []
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._prompts: dict[str, list[int]] = {}
        self._detokenizers: dict[str, DeltaDetokenizer] = {}
        self._pending: deque[tuple[int, int, int]] = deque()  # (seq, sequences, tokens)
        self._seq = 0
        self._writer: asyncio.StreamWriter | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._progress_time = time.monotonic()
        self._up = False
        self._down_reason = "not started"
        self._stopping = False
        self._stopped = threading.Event()
        self.breaker = CircuitBreaker(limits.breaker, "this model version")
        self._kill_reason: str | None = None  # why the supervisor killed the engine, if it did
        self.restarts = 0
        self.draining = False
        # LoRA loads / unloads in flight: command seq -> the future its reply frame resolves.
        self._lora_waiters: dict[int, asyncio.Future[None]] = {}

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        limits: AdmissionLimits | None = None,
        *,
        num_threads: int | None = None,
        log_level: str = "INFO",
        cpus: list[int] | None = None,
    ) -> ProcessEngine:
        """Start the engine process and return once its engine is built (raising what stopped
        it); the tokenizer loads here meanwhile. `cpus`: the cores the engine process (and each
        restart of it) is pinned to, its torch thread count by default."""
        limits = limits or AdmissionLimits()
        settings = {
            "config": config.to_dict(),
            "num_threads": num_threads,
            "cpus": cpus,
            "log_level": log_level,
            "log_interval": limits.log_interval,
            "detokenize": False,  # the API process does: DeltaDetokenizer
        }
        child = _Child(settings)
        try:
            mc = config.model
            tokenizer = None if mc.skip_tokenizer_init else load_tokenizer(mc.tokenizer or mc.path)
            ready = child.wait_ready()
            check_engine_memory(ready["memory"], limits.max_engine_memory)
        except BaseException:
            child.kill()
            raise
        logger.info("engine process %d is ready", child.proc.pid)
        return cls(settings, child, tokenizer, limits)

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Attach to the engine process; call from the event loop that consumes outputs."""
        self._loop = asyncio.get_running_loop()
        self._tasks = [
            self._loop.create_task(self._supervise()),
            self._loop.create_task(self._watch_for_stalls()),
        ]

    def shutdown(self) -> None:
        """Stop the engine process (from any thread); wait for it, killing it if it lingers."""
        self._stopping = True
        child = self._child
        if child is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._write, {"t": "stop"})
        else:
            child.sock.sendall(wire.pack({"t": "stop"}))
        try:
            child.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("engine process %d did not stop; killing it", child.proc.pid)
            child.kill()
            child.proc.wait()

    def add_output_listener(self, listener: Callable[[list[RequestOutput]], None]) -> None:
        self._listeners.append(listener)

    def num_unfinished(self) -> int:
        return len(self._queues)

    def abort_all(self, reason: str = "abort") -> None:
        if self._queues:
            self._write({"t": "abort", "ids": list(self._queues), "reason": reason})

    # --- EngineClient --------------------------------------------------------------------------

    def generate_all(self, requests: Sequence[GenerateRequest]) -> list[RequestStream]:
        if self.draining or self._stopping:
            raise EngineUnavailableError("the server is shutting down; retry on another replica")
        self.breaker.allow()
        if not self._up:
            raise EngineRestartedError(f"the engine is restarting ({self._down_reason}); retry")
        num_seqs, num_tokens = check_group(requests, self.limits)
        check_room(self.limits, self._queued(), (num_seqs, num_tokens))
        in_flight = next((r.request_id for r in requests if r.request_id in self._queues), None)
        if in_flight is not None:
            raise QiaoError(f"request id {in_flight!r} is already in flight")
        if not self._queues:
            self._progress_time = time.monotonic()  # idle until now is not a stall
        self._seq += 1
        self._pending.append((self._seq, num_seqs, num_tokens))
        streams = []
        for r in requests:
            queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
            self._queues[r.request_id] = queue
            self._prompts[r.request_id] = r.prompt_token_ids
            if self._tokenizer is not None:
                self._detokenizers[r.request_id] = DeltaDetokenizer(
                    self._tokenizer, r.prompt_token_ids, r.params
                )
            streams.append(RequestStream(self, r.request_id, queue))  # type: ignore[arg-type]
        self._write(
            {
                "t": "add",
                "seq": self._seq,
                "requests": [
                    [
                        r.request_id,
                        r.prompt_token_ids,
                        wire.params_to_wire(r.params),
                        r.priority,
                        r.deadline,
                        r.arrival_time,
                        r.lora_name,
                    ]
                    for r in requests
                ],
            }
        )
        return streams

    def abort(self, request_id: str, reason: str = "abort") -> None:
        if request_id in self._queues:
            self._write({"t": "abort", "ids": [request_id], "reason": reason})

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def max_sequence_tokens(self) -> int:
        return self._max_sequence_tokens

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def health(self) -> EngineHealth:
        if not self._up:
            return EngineHealth(False, f"engine restarting ({self._down_reason})")
        if self.draining:
            return EngineHealth(False, "draining")
        idle_for = time.monotonic() - self._progress_time
        if self._queues and idle_for > self.limits.stall_timeout:
            return EngineHealth(False, f"engine stalled: no step completed for {idle_for:.1f} s")
        return EngineHealth(True)

    def stats(self) -> dict[str, Any]:
        return {
            **self._stats,
            "engine_up": int(self._up),
            "engine_restarts": self.restarts,
            "breaker_state": int(self.breaker.state),
            "breaker_opened": self.breaker.num_opened,
        }

    # --- frames --------------------------------------------------------------------------------

    def _write(self, message: dict[str, Any]) -> None:
        if self._writer is not None and self._up:
            self._writer.write(wire.pack(message))

    def _queued(self) -> tuple[int, int]:
        seqs = self._stats["num_waiting"] + sum(p[1] for p in self._pending)
        tokens = self._stats["num_waiting_tokens"] + sum(p[2] for p in self._pending)
        return seqs, tokens

    def lora_adapters(self) -> dict[str, str]:
        lora = self._settings["config"].get("lora")
        return dict(lora["lora_modules"]) if lora else {}

    async def load_lora(self, name: str, path: str) -> None:
        await self._lora_command(name, path)

    async def unload_lora(self, name: str) -> None:
        await self._lora_command(name, None)

    async def _lora_command(self, name: str, path: str | None) -> None:
        """Apply a load / unload in the engine process and wait for its answer. The adapter
        set is kept in the settings a restarted engine process starts from."""
        lora = self._settings["config"].get("lora")
        if not lora:
            raise ConfigError("this engine serves no LoRA adapters (start it with --enable-lora)")
        if not self._up or self._loop is None:
            raise EngineRestartedError(f"the engine is restarting ({self._down_reason}); retry")
        self._seq += 1
        seq = self._seq
        done = self._loop.create_future()
        self._lora_waiters[seq] = done
        self._write({"t": "lora", "seq": seq, "name": name, "path": path})
        try:
            await done
        finally:
            self._lora_waiters.pop(seq, None)
        modules = [[n, p] for n, p in lora["lora_modules"] if n != name]
        lora["lora_modules"] = modules + ([[name, path]] if path is not None else [])

    def _on_lora_frame(self, frame: dict[str, Any]) -> None:
        done = self._lora_waiters.get(frame["seq"])
        if done is None or done.done():
            return
        if frame["error"] is None:
            done.set_result(None)
        else:
            kind, message = frame["error"]
            done.set_exception(getattr(errors, kind, ConfigError)(message))

    def _on_frame(self, frame: dict[str, Any]) -> None:
        if frame["t"] == "lora":
            self._on_lora_frame(frame)
        if frame["t"] != "step":
            return
        self._progress_time = time.monotonic()
        self._stats = frame["stats"]
        while self._pending and self._pending[0][0] <= frame["applied"]:
            self._pending.popleft()
        step_failed = False
        for rid, kind, message in frame["failed"]:
            if kind == "RequestFailedError" and rid in self._queues:
                self.breaker.record_failure()
            step_failed |= kind == "EngineUnavailableError"
            self._fail(rid, getattr(errors, kind, EngineUnavailableError)(message))
        if step_failed:
            self.breaker.record_failure()  # one failed step, however many requests it held
        outputs = []
        stopped: list[list[Any]] = []
        for values in frame["outputs"]:
            rid = values[0]
            prompt = self._prompts.get(rid)
            if prompt is None:
                continue  # answered already (a stop string, or the engine restarted meanwhile)
            output = wire.output_from_wire(values, None, prompt)
            detokenizer = self._detokenizers.get(rid)
            if detokenizer is not None:
                output, newly_stopped = detokenizer.process(output)
                stopped += [[rid, index] for index in newly_stopped]
            outputs.append(output)
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait(output)
            if output.finished:
                self._prompts.pop(rid, None)
                self._detokenizers.pop(rid, None)
                if completed_normally(output):
                    self.breaker.record_success()
        if stopped:
            self._write({"t": "stop_samples", "samples": stopped})
        for listener in self._listeners:
            listener(outputs)

    def _fail(self, request_id: str, error: BaseException) -> None:
        self._prompts.pop(request_id, None)
        self._detokenizers.pop(request_id, None)
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(error)

    # --- supervision ---------------------------------------------------------------------------

    async def _supervise(self) -> None:
        delay = FIRST_RESTART_DELAY_S
        while not self._stopping:
            child = self._child
            if child is None:
                try:
                    child = await asyncio.to_thread(self._start_child)
                except Exception as exc:
                    logger.error("engine restart failed (%s); next try in %.0f s", exc, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, MAX_RESTART_DELAY_S)
                    continue
                if self._stopping:  # the server began to stop while this one started
                    child.kill()
                    break
                logger.info(
                    "engine process %d is ready (restart %d)", child.proc.pid, self.restarts
                )
            await self._pump(child)
            if self._stopping:
                break
            code = await asyncio.to_thread(child.proc.wait)
            cause = self._kill_reason or describe_exit(code)
            self._kill_reason = None
            if time.monotonic() - child.started >= HEALTHY_RUN_S:
                delay = FIRST_RESTART_DELAY_S
            self._on_engine_lost(child, cause, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_RESTART_DELAY_S)

    def _start_child(self) -> _Child:
        child = _Child(self._settings)
        try:
            child.wait_ready()
        except BaseException:
            child.kill()
            raise
        return child

    async def _pump(self, child: _Child) -> None:
        """Read the engine's frames until its end of the socket closes."""
        child.sock.setblocking(False)
        reader, writer = await asyncio.open_unix_connection(sock=child.sock)
        self._child, self._writer = child, writer
        self._stats = child.ready.get("stats", self._stats)
        self._progress_time = time.monotonic()
        self._up = True
        frames = wire.FrameReader()
        try:
            while True:
                data = await reader.read(1 << 20)
                if not data:
                    break
                for frame in frames.feed(data):
                    self._on_frame(frame)
        except (ConnectionError, ValueError) as exc:
            logger.error("engine process %d: broken channel (%s)", child.proc.pid, exc)
            child.kill()
        finally:
            self._up = False
            self._writer = None
            writer.close()

    def _on_engine_lost(self, child: _Child, cause: str, delay: float) -> None:
        self.restarts += 1
        self.breaker.record_failure()  # one death, however many requests it held
        self._down_reason = f"the last one {cause}"
        held = list(self._queues)
        logger.error(
            "engine process %d %s; answering the %d requests it held and restarting in %.0f s",
            child.proc.pid,
            cause,
            len(held),
            delay,
        )
        error = EngineRestartedError(f"the engine restarted ({cause}); retry")
        for request_id in held:
            self._fail(request_id, error)
        for done in self._lora_waiters.values():
            if not done.done():
                done.set_exception(error)
        self._prompts.clear()
        self._detokenizers.clear()
        self._pending.clear()
        self._child = None
        self._stats = {**self._stats, "num_running": 0, "num_waiting": 0, "num_waiting_tokens": 0}

    async def _watch_for_stalls(self) -> None:
        while not self._stopping:
            await asyncio.sleep(min(0.5, self.limits.stall_timeout / 4))
            child = self._child
            if child is None or not self._up or not self._queues:
                continue
            idle_for = time.monotonic() - self._progress_time
            if idle_for > self.limits.stall_timeout:
                logger.error(
                    "engine process %d finished no step for %.1f s with work queued; killing it",
                    child.proc.pid,
                    idle_for,
                )
                self._kill_reason = f"made no progress for {idle_for:.0f} s and was killed"
                child.kill()
                self._progress_time = time.monotonic()
