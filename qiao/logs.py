"""Logging for every qiao process: text or JSON lines, each tagged with its request id.

`configure_logging` is the one setup the server, its engine and encoder processes and the
command line use. With `--log-format json` (env `QIAO_LOG_FORMAT`, which child processes
inherit) every record is one JSON object per line: `ts`, `level`, `logger`, `process`, `pid`,
`message`, the `request_id` of the HTTP request it was logged under (a context variable set by
the request-id middleware), and any fields the caller passed (`extra={"fields": {...}}`; the
access log's route, status, latency_ms, tokens and key).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, Literal

LogFormat = Literal["text", "json"]
ENV_LOG_FORMAT = "QIAO_LOG_FORMAT"

# The request a log line is written under: {"request_id": ..., "tokens": ...}, else None.
_request: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "qiao_request", default=None
)


def start_request(request_id: str) -> tuple[dict[str, Any], contextvars.Token]:
    """Mark the current context (and the tasks it starts) as serving `request_id`; returns the
    request's notes and the token `end_request` takes."""
    notes: dict[str, Any] = {"request_id": request_id}
    return notes, _request.set(notes)


def end_request(token: contextvars.Token) -> None:
    _request.reset(token)


def note_tokens(num_tokens: int) -> None:
    """Add prompt + generated tokens to the current request's access-log line."""
    notes = _request.get()
    if notes is not None:
        notes["tokens"] = notes.get("tokens", 0) + num_tokens


def current_request_id() -> str | None:
    notes = _request.get()
    return None if notes is None else notes["request_id"]


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = current_request_id()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record; exceptions as a `traceback` string."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "process": self.process,
            "pid": record.process,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            entry["request_id"] = request_id
        entry.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def log_format() -> LogFormat:
    return "json" if os.environ.get(ENV_LOG_FORMAT, "text").lower() == "json" else "text"


def configure_logging(level: str, process: str, fmt: LogFormat | None = None) -> None:
    """Route the root logger to stderr in `fmt` (default: `QIAO_LOG_FORMAT`, else text).
    `process` names this process in every line (`server`, `engine[1234]`, ...)."""
    fmt = fmt or log_format()
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RequestIdFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter(process))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s {process} %(name)s: %(message)s")
        )
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_qiao", False):
            root.removeHandler(old)
    handler._qiao = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level.upper())
    # A client's line per HTTP request (the benchmarks send thousands) only at debug level.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(
            logging.NOTSET if root.level <= logging.DEBUG else logging.WARNING
        )


class Progress:
    """Progress of long work as log lines (so it shows in JSON logs and in a service's log,
    where a terminal bar would not): one line at most every `every` seconds while it runs,
    and one at the end. `total` may be None (a heartbeat: elapsed time only).

        progress = Progress(logger, "loading weights", total=n, unit="tensors")
        for ...: progress.advance()
        progress.done()
    """

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        total: float | None = None,
        unit: str = "",
        every: float = 5.0,
    ) -> None:
        self.logger, self.what, self.total, self.unit, self.every = logger, what, total, unit, every
        self.count = 0.0
        self.started = time.monotonic()
        self._next = self.started + every

    def advance(self, amount: float = 1.0) -> None:
        self.count += amount
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.every
            self._log(now, final=False)

    def done(self) -> None:
        self._log(time.monotonic(), final=True)

    def _log(self, now: float, final: bool) -> None:
        elapsed = now - self.started
        fields: dict[str, Any] = {"task": self.what, "elapsed_s": round(elapsed, 1)}
        if self.total:
            share = min(self.count / self.total, 1.0)
            fields.update(
                done=round(self.count, 3), total=round(self.total, 3), share=round(share, 3)
            )
            amount = f"{_fmt(self.count)}/{_fmt(self.total)} {self.unit}".rstrip()
            text = f"{self.what}: {share:.0%} ({amount}) in {elapsed:.1f} s"
        else:
            text = f"{self.what}: {elapsed:.0f} s"
        if final:
            text = f"{self.what}: done in {elapsed:.1f} s" + (
                f" ({_fmt(self.count)} {self.unit})".rstrip() if self.count else ""
            )
        self.logger.info(text, extra={"fields": fields})


def _fmt(value: float) -> str:
    return f"{value:.0f}" if value == int(value) else f"{value:.1f}"


@contextlib.contextmanager
def heartbeat(logger: logging.Logger, what: str, every: float = 5.0) -> Iterator[None]:
    """A log line every `every` seconds while the block runs, for work that reports no
    progress of its own (a compiler, an exporter), and one when it ends."""
    stop = threading.Event()
    progress = Progress(logger, what, every=every)

    def beat() -> None:
        while not stop.wait(every):
            progress.advance(0)

    thread = threading.Thread(target=beat, name="qiao-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    progress.done()
