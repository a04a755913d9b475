"""The engine process: one `LLMEngine` driven by frames from the API process.

Started by `ProcessEngine` as `python -m qiao.engine.engine_worker FD` with one end of a socket
pair. It reads its settings from the first frame, builds the engine (weights, kernels, KV pool),
answers `ready` (or `failed`), then loops: take every command that arrived (add, abort,
stop_samples, stop),
end requests whose deadline passed, run a step, and send one `step` frame with that turn's
outputs. Nothing here is shared with the API process but the socket, so a crash, a kernel
segfault or an out-of-memory kill here ends this process alone; the API process answers the
requests it held and starts another.
"""

from __future__ import annotations

import heapq
import importlib
import logging
import os
import selectors
import signal
import socket
import sys
import time
from typing import Any

from qiao import envs
from qiao.config import EngineConfig
from qiao.engine import wire
from qiao.engine.async_engine import apply_lora_command, engine_failed_message, log_throughput
from qiao.engine.llm_engine import LLMEngine
from qiao.errors import QiaoError
from qiao.logs import configure_logging
from qiao.outputs import RequestOutput

logger = logging.getLogger("qiao.engine.process")


class EngineWorker:
    def __init__(self, sock: socket.socket, engine: LLMEngine, log_interval: float) -> None:
        self.sock = sock
        self.engine = engine
        self.log_interval = log_interval
        self.reader = wire.FrameReader()
        self.selector = selectors.DefaultSelector()
        self.selector.register(sock, selectors.EVENT_READ)
        self.deadlines: list[tuple[float, str]] = []
        self.applied = 0  # sequence number of the last command applied
        self.stopping = False

    def run(self) -> None:
        last_log, last_counts = time.monotonic(), (0, 0)
        while not self.stopping:
            commands = self._receive(block=not self.engine.has_unfinished_requests())
            if commands is None:
                return  # the API process is gone
            outputs, failed = self._apply(commands)
            outputs += self._expire_deadlines()
            stepped = False
            if self.engine.has_unfinished_requests():
                try:
                    outputs += self.engine.step()
                except Exception as exc:  # a bug outside the forward: fail what is in flight
                    logger.exception("engine step failed; failing the requests in flight")
                    failed += self._fail_all(exc)
                failed += [
                    [rid, type(error).__name__, str(error)]
                    for rid, error in self.engine.take_failed_requests()
                ]
                stepped = True
            if commands or outputs or failed or stepped:
                self._send(outputs, failed)
            now = time.monotonic()
            if self.log_interval and now - last_log >= self.log_interval:
                last_counts = log_throughput(self.engine.stats(), now - last_log, last_counts)
                last_log = now

    def _receive(self, block: bool) -> list[dict[str, Any]] | None:
        """Every command frame available now; when `block`, wait for one (or a deadline, or
        the next log line). None when the API process closed its end."""
        timeout: float | None = 0.0
        if block:
            timeout = self.log_interval or None
            if self.deadlines:
                until = max(self.deadlines[0][0] - time.monotonic(), 0.0)
                timeout = until if timeout is None else min(timeout, until)
        frames: list[dict[str, Any]] = []
        while self.selector.select(timeout):
            data = self.sock.recv(1 << 20)
            if not data:
                return None
            frames += self.reader.feed(data)
            timeout = 0.0
        return frames

    def _apply(self, commands: list[dict[str, Any]]) -> tuple[list[RequestOutput], list[list[Any]]]:
        outputs: list[RequestOutput] = []
        failed: list[list[Any]] = []
        for command in commands:
            kind = command["t"]
            if kind == "add":
                for rid, prompt, params, priority, deadline, arrival, lora in command["requests"]:
                    try:
                        self.engine.add_request(
                            rid,
                            prompt,
                            wire.params_from_wire(params),
                            priority=priority,
                            stream=True,
                            arrival_time=arrival,
                            lora_request=lora,
                        )
                    except QiaoError as exc:
                        failed.append([rid, type(exc).__name__, str(exc)])
                        continue
                    except Exception as exc:  # a bug: this request fails, the loop goes on
                        logger.exception("adding request %s failed", rid)
                        failed.append([rid, "EngineUnavailableError", engine_failed_message(exc)])
                        continue
                    if deadline is not None:
                        heapq.heappush(self.deadlines, (deadline, rid))
                self.applied = command["seq"]
            elif kind == "abort":
                outputs += self.engine.abort_request(command["ids"], reason=command["reason"])
            elif kind == "stop_samples":
                samples = [(rid, index) for rid, index in command["samples"]]
                outputs += self.engine.stop_samples(samples)
            elif kind == "lora":
                self._apply_lora(command)
            elif kind == "stop":
                self.stopping = True
        return outputs, failed

    def _expire_deadlines(self) -> list[RequestOutput]:
        now = time.monotonic()
        live = self.engine.output_processor.states
        if len(self.deadlines) > 2 * len(live) + 64:
            # Requests that finished before their deadline leave entries behind; a far deadline
            # (`timeout: 1e308`) would keep them forever.
            self.deadlines = [entry for entry in self.deadlines if entry[1] in live]
            heapq.heapify(self.deadlines)
        expired = []
        while self.deadlines and self.deadlines[0][0] <= now:
            expired.append(heapq.heappop(self.deadlines)[1])
        return self.engine.abort_request(expired, reason="timeout") if expired else []

    def _fail_all(self, exc: Exception) -> list[list[Any]]:
        request_ids = list(self.engine.output_processor.states)
        try:
            self.engine.abort_request(request_ids)
        except Exception:
            logger.exception("could not abort the failed requests")
        message = engine_failed_message(exc)
        return [[rid, "EngineUnavailableError", message] for rid in request_ids]

    def _apply_lora(self, command: dict[str, Any]) -> None:
        """Load or unload an adapter between steps; the answer goes back at once."""
        error = None
        try:
            apply_lora_command(self.engine, command["name"], command["path"])
        except QiaoError as exc:
            error = [type(exc).__name__, str(exc)]
        except Exception as exc:  # a bug: this command fails, the loop goes on
            logger.exception("LoRA command for %r failed", command["name"])
            error = ["EngineUnavailableError", engine_failed_message(exc)]
        self.sock.sendall(wire.pack({"t": "lora", "seq": command["seq"], "error": error}))

    def _send(self, outputs: list[RequestOutput], failed: list[list[Any]]) -> None:
        frame = {
            "t": "step",
            "outputs": [wire.output_to_wire(o) for o in outputs],
            "failed": failed,
            "applied": self.applied,
            "stats": {**self.engine.stats(), "resident_bytes": resident_bytes()},
            "time": time.monotonic(),
        }
        self.sock.sendall(wire.pack(frame))


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
_rss: list[float] = [0.0, 0.0]  # (read at, bytes): read at most once a second, not per step


def resident_bytes() -> int:
    """This process's resident memory (Linux; 0 elsewhere), at most a second old."""
    now = time.monotonic()
    if now - _rss[0] >= 1.0:
        try:
            with open("/proc/self/statm") as f:
                _rss[1] = int(f.read().split()[1]) * _PAGE_SIZE
        except (OSError, ValueError, IndexError):
            _rss[1] = 0
        _rss[0] = now
    return int(_rss[1])


def main(argv: list[str]) -> int:
    sock = socket.socket(fileno=int(argv[0]))
    # The API process stops this one with a `stop` frame or by closing the socket; a signal
    # meant for the server's process group (Ctrl-C) must not kill it mid-step first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    settings = wire.recv_frame(sock)
    if settings is None:
        return 1
    configure_logging(settings["log_level"], f"engine[{os.getpid()}]")
    try:
        if settings.get("cpus"):  # a data-parallel replica: its own cores, before any thread
            os.sched_setaffinity(0, settings["cpus"])
            if settings["num_threads"] is None:
                settings["num_threads"] = len(settings["cpus"])
        if settings["num_threads"] is not None:
            import torch

            torch.set_num_threads(settings["num_threads"])
        config = EngineConfig.from_dict(settings["config"])
        engine = LLMEngine(config, detokenize=settings.get("detokenize", True))
        engine.warm_row_buckets()  # a long-lived engine: its matmul memory paid now, then flat
        hook = envs.engine_hook()
        if hook is not None:
            module_name, _, function = hook.partition(":")
            getattr(importlib.import_module(module_name), function)(engine)
    except Exception as exc:
        logger.exception("the engine failed to start")
        message = str(exc) if isinstance(exc, QiaoError) else f"{type(exc).__name__}: {exc}"
        sock.sendall(wire.pack({"t": "failed", "error": message}))
        return 1
    sock.sendall(
        wire.pack(
            {
                "t": "ready",
                "pid": os.getpid(),
                "max_model_len": engine.max_model_len,
                "vocab_size": engine.arch.vocab_size,
                "max_sequence_tokens": engine.max_sequence_tokens,
                "stats": {**engine.stats(), "resident_bytes": resident_bytes()},
                "memory": engine.memory_bytes(),
            }
        )
    )
    EngineWorker(sock, engine, settings["log_interval"]).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
