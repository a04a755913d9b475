"""An encoder in its own process, supervised: what an `EncoderVersion` runs its batches on under
`qiao serve` (with `--in-process-engine`, the encoder itself, in the batcher's thread).

The API process keeps HTTP, tokenization and the dynamic batcher; the encoder process
(`encoder_worker`) runs the model. They talk in msgpack frames over a socket pair (`wire`): one
`run` frame per batch (its token-id rows), one `result` frame back (the embeddings as raw bytes
with their dtype and shape; never pickle). Batches go one at a time: the batcher's worker thread
sends one and blocks for its answer.

Supervision, as `ProcessEngine`'s: when the encoder process exits for any reason (an exception
that escapes, SIGKILL, a segfault, the OOM killer), the batch it held fails at once with
`EngineRestartedError` (503 `engine_restarted`, Retry-After), and so does every batch after it
until a new process is ready, so the batcher's queue empties at once. Readiness fails, the log
names the exit code or signal, the version's breaker records one failure, and a new process
starts after a delay that doubles with each failure in a row (1 s, 2 s, ... 30 s; back to 1 s
once one has run for a minute). A batch not answered within the stall timeout kills the process,
which then restarts the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np

from qiao import errors
from qiao.engine import wire
from qiao.engine.engine_process import (
    FIRST_RESTART_DELAY_S,
    HEALTHY_RUN_S,
    MAX_RESTART_DELAY_S,
    STOP_TIMEOUT_S,
    describe_exit,
)
from qiao.errors import (
    ConfigError,
    EngineRestartedError,
    EngineUnavailableError,
    ModelLoadError,
    QiaoError,
)
from qiao.runner.encoder import Encoder, load_encoder, load_tokenizer

logger = logging.getLogger("qiao.engine.supervisor")

# How long a batch that found the channel closed waits for the process's exit status.
EXIT_WAIT_S = 1.0


@dataclass(frozen=True)
class EncoderSpec:
    """What an encoder process loads (and `--in-process-engine` loads in this process)."""

    path: str  # the version folder: an HF checkpoint, or a folder of `qiao export onnx`
    backend: str  # "embedding" or "onnx"
    precision: str = "FP32"
    device: str = "cpu"
    max_length: int | None = None  # below the model's own (a repository's max_sequence_length)

    def load(self) -> Encoder:
        backend = cast(Literal["embedding", "onnx"], self.backend)
        encoder = load_encoder(
            Path(self.path), backend, precision=self.precision, device=self.device
        )
        if self.max_length is not None:
            encoder.max_length = min(encoder.max_length, self.max_length)
        return encoder


class _EncoderChild:
    """One encoder process and the API process's end of its socket."""

    def __init__(self, spec: EncoderSpec, log_level: str) -> None:
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "qiao.engine.encoder_worker", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        self.sock = ours
        self.sock.sendall(wire.pack({"spec": dataclasses.asdict(spec), "log_level": log_level}))
        self.started = time.monotonic()
        self.ready: dict[str, Any] = {}
        self.io_lock = threading.Lock()  # held while a batch is on the socket
        self.kill_reason: str | None = None  # why this side killed the process, if it did

    def wait_ready(self) -> dict[str, Any]:
        """Block until the encoder is loaded; raise what stopped it otherwise."""
        frame = wire.recv_frame(self.sock)
        if frame is not None and frame["t"] == "ready":
            self.ready = frame
            return frame
        self.sock.close()
        code = self.proc.wait()
        if frame is not None and frame["t"] == "failed":
            raise ModelLoadError(f"the encoder process failed to start: {frame['error']}")
        raise ModelLoadError(f"the encoder process exited while starting ({describe_exit(code)})")

    def kill(self, reason: str | None = None) -> None:
        if self.proc.poll() is None:
            self.kill_reason = self.kill_reason or reason
            self.proc.kill()

    def stop(self) -> None:
        """Close this end (the process finishes its batch, then exits); kill it if it lingers."""
        with contextlib.suppress(OSError):  # gone already
            self.sock.shutdown(socket.SHUT_WR)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("encoder process %d did not stop; killing it", self.proc.pid)
            self.kill()
            self.proc.wait()
        with self.io_lock:
            self.sock.close()


class ProcessEncoder:
    """An `Encoder` whose model runs in a supervised encoder process; tokenization stays here.

    `embed` blocks until the batch is answered; call it from one thread at a time (the
    batcher's worker). `start` begins the supervision, `shutdown` ends it and the process."""

    def __init__(
        self,
        spec: EncoderSpec,
        child: _EncoderChild,
        *,
        name: str,
        stall_timeout: float,
        log_level: str,
    ) -> None:
        self.spec = spec
        self.name = name
        self.stall_timeout = stall_timeout
        self._log_level = log_level
        self.dim: int = child.ready["dim"]
        self.max_length: int = child.ready["max_length"]
        self._tokenizer = load_tokenizer(Path(spec.path), self.max_length)
        # The fields below are shared by the batcher's worker, the supervisor and the loop.
        self._lock = threading.Lock()
        self._child: _EncoderChild | None = None
        self._starting: _EncoderChild | None = None
        self._up = False
        self._down_reason = "not started"
        self._resident_bytes: int = child.ready["resident_bytes"]
        self.restarts = 0
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._on_lost: Callable[[], None] = lambda: None
        with self._lock:
            self._install(child)

    @classmethod
    def build(
        cls,
        spec: EncoderSpec,
        *,
        name: str,
        stall_timeout: float = 30.0,
        log_level: str = "INFO",
    ) -> ProcessEncoder:
        """Start the encoder process and return once its encoder is loaded (raising what
        stopped it). `name` ("model/version") is for the log."""
        child = _EncoderChild(spec, log_level)
        try:
            child.wait_ready()
            encoder = cls(spec, child, name=name, stall_timeout=stall_timeout, log_level=log_level)
        except BaseException:
            child.kill()
            raise
        logger.info("encoder process %d of %s is ready", child.proc.pid, name)
        return encoder

    # --- lifecycle -------------------------------------------------------------------------

    def start(self, on_lost: Callable[[], None] | None = None) -> None:
        """Supervise the process from now on; `on_lost()` is called once per death or kill
        (the version's circuit breaker)."""
        if self._supervisor is not None:
            return
        self._on_lost = on_lost or (lambda: None)
        self._supervisor = threading.Thread(
            target=self._supervise, name=f"qiao-encoder-supervisor-{self.name}", daemon=True
        )
        self._supervisor.start()

    def shutdown(self) -> None:
        """Stop the encoder process (from any thread) and the supervision."""
        with self._lock:
            self._stopping.set()
            child, starting = self._child, self._starting
            self._up, self._down_reason = False, "stopped"
        if starting is not None:
            starting.kill()
        if child is not None:
            child.stop()
        if self._supervisor is not None:
            self._supervisor.join(STOP_TIMEOUT_S)

    # --- Encoder ---------------------------------------------------------------------------

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text with [CLS]/[SEP], cut to `max_length`."""
        if isinstance(texts, str):
            raise ConfigError("texts: expected a list of strings, got one string")
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise ConfigError(f"texts[{i}]: expected a string, got {type(text).__name__}")
        return [encoding.ids for encoding in self._tokenizer.encode_batch(list(texts))]

    def embed(self, token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        """[len(token_ids), dim] embeddings from the encoder process. Raises what the encoder
        raised (its class, its message), or EngineRestartedError when the process is down or
        goes down during the batch."""
        child = self.check_up()
        rows = [row.tolist() if isinstance(row, np.ndarray) else list(row) for row in token_ids]
        cause = None
        with child.io_lock:
            try:
                child.sock.sendall(wire.pack({"t": "run", "rows": rows}))
                frame = wire.recv_frame(child.sock)
            except TimeoutError:
                frame, cause = None, self._kill_stalled(child)
            except OSError:  # the process is gone (a reset, or the supervisor closed the socket)
                frame = None
        if frame is None:
            cause = cause or self._exit_cause(child)
            self._mark_down(child, cause)
            raise EngineRestartedError(f"the encoder restarted ({cause}); retry")
        if frame["t"] == "error":
            raise _error_class(frame["kind"])(frame["error"])
        self._resident_bytes = frame["resident_bytes"]
        return np.frombuffer(frame["data"], dtype=np.dtype(frame["dtype"])).reshape(frame["shape"])

    # --- state -----------------------------------------------------------------------------

    def check_up(self) -> _EncoderChild:
        """The running process, or EngineRestartedError (503, Retry-After) while it restarts
        (EngineUnavailableError once shut down)."""
        with self._lock:
            child, reason = self._child, self._down_reason
            if self._up and child is not None:
                return child
        if self._stopping.is_set():
            raise EngineUnavailableError(f"the encoder of {self.name} is stopped")
        raise EngineRestartedError(f"the encoder is restarting ({reason}); retry")

    def health(self) -> tuple[bool, str]:
        with self._lock:
            if self._up:
                return True, "ok"
            if self._stopping.is_set():
                return False, "encoder stopped"
            return False, f"encoder restarting ({self._down_reason})"

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "engine_up": int(self._up),
                "engine_restarts": self.restarts,
                "resident_bytes": self._resident_bytes,
            }

    def _install(self, child: _EncoderChild) -> None:
        """Make a ready process the one batches go to; call under the lock."""
        # A batch not answered in time (nothing read for `stall_timeout`) raises TimeoutError.
        child.sock.settimeout(self.stall_timeout)
        self._child, self._up = child, True
        self._resident_bytes = child.ready["resident_bytes"]

    def _mark_down(self, child: _EncoderChild, cause: str) -> None:
        """Refuse batches from now on (the supervisor may not have seen the exit yet)."""
        with self._lock:
            if self._child is child and self._up:
                self._up = False
                self._down_reason = f"the last one {cause}"

    def _kill_stalled(self, child: _EncoderChild) -> str:
        reason = f"made no progress for {self.stall_timeout:.0f} s and was killed"
        logger.error(
            "encoder process %d of %s answered no batch for %.1f s; killing it",
            child.proc.pid,
            self.name,
            self.stall_timeout,
        )
        child.kill(reason)
        return reason

    def _exit_cause(self, child: _EncoderChild) -> str:
        try:
            code = child.proc.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            # It closed its end but lives on: no batch can reach it, so it goes too.
            child.kill("closed its channel and was killed")
            return "closed its channel and was killed"
        return child.kill_reason or describe_exit(code)

    # --- supervision -----------------------------------------------------------------------

    def _supervise(self) -> None:
        """In the supervisor thread: wait for the process to exit, restart it, repeat."""
        delay = FIRST_RESTART_DELAY_S
        child = self._child
        while child is not None:
            code = child.proc.wait()
            if self._stopping.is_set():
                return
            if time.monotonic() - child.started >= HEALTHY_RUN_S:
                delay = FIRST_RESTART_DELAY_S
            self._lost(child, child.kill_reason or describe_exit(code), delay)
            child, delay = self._restart(delay)

    def _lost(self, child: _EncoderChild, cause: str, delay: float) -> None:
        with self._lock:
            self._child, self._up = None, False
            self._down_reason = f"the last one {cause}"
            self.restarts += 1
        self._on_lost()  # one failure per death, however many batches it took down
        logger.error(
            "encoder process %d of %s %s; failing the batch it held and those queued, "
            "restarting in %.0f s",
            child.proc.pid,
            self.name,
            cause,
            delay,
        )
        with child.io_lock:  # a batch in flight has had its end of stream by now
            child.sock.close()

    def _restart(self, delay: float) -> tuple[_EncoderChild | None, float]:
        """A new ready process after `delay`, retrying with doubling delays; None once
        stopping. Returns the delay to use after its next failure too."""
        while not self._stopping.wait(delay):
            delay = min(delay * 2, MAX_RESTART_DELAY_S)
            try:
                child = self._start_child()
            except Exception as exc:
                if self._stopping.is_set():
                    break
                logger.error(
                    "encoder %s: restart failed (%s); next try in %.0f s", self.name, exc, delay
                )
                continue
            if child is not None:
                logger.info(
                    "encoder process %d of %s is ready (restart %d)",
                    child.proc.pid,
                    self.name,
                    self.restarts,
                )
            return child, delay
        return None, delay

    def _start_child(self) -> _EncoderChild | None:
        child = _EncoderChild(self.spec, self._log_level)
        with self._lock:
            self._starting = child
        try:
            child.wait_ready()
        except BaseException:
            child.kill()
            raise
        finally:
            with self._lock:
                self._starting = None
        with self._lock:
            if not self._stopping.is_set():
                self._install(child)
                return child
        child.stop()  # shutdown began while this one loaded
        return None


def _error_class(kind: str) -> type[QiaoError]:
    """The qiao error class an `error` frame names (EngineUnavailableError for anything else)."""
    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, QiaoError):
        return cls
    return errors.EngineUnavailableError
