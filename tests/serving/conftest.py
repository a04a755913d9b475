"""Harnesses for the serving acceptance tests.

Two kinds of server, both on 127.0.0.1 and a free port, both stopped by their fixture:

- `SubprocessServer`: the real `qiao serve` command, for what only a process can show (the CLI,
  the bind check, signals, the log). Its output goes to a file, so nothing blocks on a pipe and a
  test can read the whole log.
- `InProcessServer`: `build_engine` + `create_app` under `uvicorn.Server` in a thread, so a test
  can hold or slow the engine loop (`StepGate`) and read the engine's block counts directly.

Every response body any client of this suite reads is recorded (`BODY_LOG`, fed by a transport
that tees the bytes) and checked after each test for leaked internals: tracebacks, file paths,
addresses.
"""

from __future__ import annotations

import logging
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

STARTUP_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 20.0
MODEL_NAME = "stories260K-hf"
PROMPT = "Once upon a time"
# Greedy continuation of PROMPT by stories260K, 32 tokens (finish_reason "length").
GREEDY_32 = (
    ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw"
)

# --- response-body recording ------------------------------------------------------------------

LEAK_PATTERNS = {
    "traceback": re.compile(rb"Traceback"),
    "source path": re.compile(rb"/work/"),
    "installed package path": re.compile(rb"site-packages"),
    "stack frame": re.compile(rb'File "'),
    "IPv4 address with port": re.compile(rb"\b(?:\d{1,3}\.){3}\d{1,3}:\d{1,5}\b"),
    "host name with port": re.compile(rb"\blocalhost:\d{1,5}\b"),
    "IPv6 address with port": re.compile(rb"\[[0-9a-fA-F:]+\]:\d{1,5}"),
}


def find_leaks(body: bytes) -> list[str]:
    """Names of the internals `body` gives away (empty: the body is clean)."""
    return [name for name, pattern in LEAK_PATTERNS.items() if pattern.search(body)]


class BodyLog:
    """Every response body read by a recording client in this session, as it was read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bodies: list[tuple[str, bytearray]] = []
        self.num_checked = 0

    def new(self, label: str) -> bytearray:
        sink = bytearray()
        with self._lock:
            self.bodies.append((label, sink))
        return sink

    def check_new(self) -> list[str]:
        """Leaks in bodies recorded since the last check, as 'label: kinds' lines."""
        with self._lock:
            new, self.num_checked = self.bodies[self.num_checked :], len(self.bodies)
        problems = []
        for label, body in new:
            leaks = find_leaks(bytes(body))
            if leaks:
                problems.append(f"{label}: {', '.join(leaks)} in {bytes(body[:300])!r}")
        return problems


BODY_LOG = BodyLog()


def _recording_transport(lib: ModuleType, inner: Any) -> Any:
    """A transport of `lib` (httpx or httpx2) that tees every response body into BODY_LOG.

    Bodies are recorded as the client reads them, so a stream closed early records what it got.
    """
    is_async = isinstance(inner, lib.AsyncBaseTransport)

    class SyncTee(lib.SyncByteStream):
        def __init__(self, stream: Any, sink: bytearray) -> None:
            self._stream, self._sink = stream, sink

        def __iter__(self) -> Iterator[bytes]:
            for chunk in self._stream:
                self._sink.extend(chunk)
                yield chunk

        def close(self) -> None:
            self._stream.close()

    class AsyncTee(lib.AsyncByteStream):
        def __init__(self, stream: Any, sink: bytearray) -> None:
            self._stream, self._sink = stream, sink

        async def __aiter__(self) -> Any:
            async for chunk in self._stream:
                self._sink.extend(chunk)
                yield chunk

        async def aclose(self) -> None:
            await self._stream.aclose()

    def wrap(request: Any, response: Any, tee: type) -> Any:
        sink = BODY_LOG.new(f"{request.method} {request.url.path} -> {response.status_code}")
        return lib.Response(
            response.status_code,
            headers=response.headers,
            stream=tee(response.stream, sink),
            extensions=response.extensions,
            request=request,
        )

    if is_async:

        class AsyncRecording(lib.AsyncBaseTransport):
            async def handle_async_request(self, request: Any) -> Any:
                return wrap(request, await inner.handle_async_request(request), AsyncTee)

            async def aclose(self) -> None:
                await inner.aclose()

        return AsyncRecording()

    class SyncRecording(lib.BaseTransport):
        def handle_request(self, request: Any) -> Any:
            return wrap(request, inner.handle_request(request), SyncTee)

        def close(self) -> None:
            inner.close()

    return SyncRecording()


def http_client(base_url: str, **kwargs: Any) -> httpx.Client:
    """An httpx client whose response bodies are recorded."""
    transport = _recording_transport(httpx, httpx.HTTPTransport())
    return httpx.Client(base_url=base_url, transport=transport, **kwargs)


def async_http_client(
    base_url: str, *, transport: Any = None, limits: httpx.Limits | None = None, **kwargs: Any
) -> httpx.AsyncClient:
    """An httpx async client (over the network, or `transport`) whose bodies are recorded."""
    inner = transport or httpx.AsyncHTTPTransport(limits=limits or httpx.Limits())
    return httpx.AsyncClient(
        base_url=base_url, transport=_recording_transport(httpx, inner), **kwargs
    )


def openai_client(base_url: str, api_key: str = "unused") -> Any:
    """The official client, max_retries=0 so a failure shows as it is; bodies are recorded."""
    import openai

    # openai 3.x is built on httpx2 (an httpx fork with the same API), older releases on httpx.
    lib = sys.modules.get("httpx2", httpx)
    transport = _recording_transport(lib, lib.HTTPTransport())
    return openai.OpenAI(
        base_url=f"{base_url}/v1",
        api_key=api_key,
        max_retries=0,
        timeout=60.0,
        http_client=lib.Client(transport=transport, timeout=60.0),
    )


@pytest.fixture(autouse=True)
def _no_internals_in_response_bodies() -> Iterator[None]:
    yield
    problems = BODY_LOG.check_new()
    if problems:
        pytest.fail("response bodies leak internals:\n" + "\n".join(problems), pytrace=False)


class _ErrorRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "logs_errors: the test provokes server errors on purpose (no log check)"
    )


@pytest.fixture(autouse=True)
def _no_errors_logged_in_process(request: pytest.FixtureRequest) -> Iterator[None]:
    """In-process servers log to this process: an unexpected error there fails the test.

    (It sees uvicorn's "Exception in ASGI application" too: in-process servers leave logging
    unconfigured, so uvicorn's loggers propagate to the root logger.)
    """
    handler = _ErrorRecords()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
    if handler.records and request.node.get_closest_marker("logs_errors") is None:
        lines = [f"{r.name}: {r.getMessage()} {r.exc_info[1]!r}" for r in handler.records]
        pytest.fail("errors were logged:\n" + "\n".join(lines), pytrace=False)


# --- polling ------------------------------------------------------------------------------------


def wait_until(
    condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.01
) -> None:
    """Poll `condition` until it holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


# --- subprocess server --------------------------------------------------------------------------

_LISTENING = re.compile(r"Uvicorn running on http://([^\s:]+|\[[^\]]+\]):(\d+)")


def qiao_command() -> list[str]:
    script = Path(sys.executable).with_name("qiao")
    return [str(script)] if script.exists() else [sys.executable, "-m", "qiao.cli"]


class SubprocessServer:
    """`qiao serve ... --port 0`, its output in `log_path`; the port is read from the log.

    `args=None` runs a bare `qiao serve` (the port then comes from `QIAO_PORT` in `env`).
    """

    def __init__(
        self, args: list[str] | None, log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        self.log_path = log_path
        self._log_file = log_path.open("wb")
        argv = [] if args is None else ["--port", "0", *args]
        self.proc = subprocess.Popen(
            [*qiao_command(), "serve", *argv],
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> SubprocessServer:
        deadline = time.monotonic() + timeout
        while not self.port:
            match = _LISTENING.search(self.log())
            if match:
                self.port = int(match.group(2))
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"qiao serve did not start:\n{self.log()[-3000:]}")
            else:
                time.sleep(0.05)
        try:
            with httpx.Client(base_url=self.base_url, timeout=5.0) as client:
                wait_until(
                    lambda: client.get("/health/ready").status_code == 200,
                    max(deadline - time.monotonic(), 1.0),
                    "/health/ready to answer 200",
                )
        except BaseException:
            self.stop()  # never leave a server behind, whatever the test does next
            raise
        return self

    def stop(self) -> int:
        """SIGTERM, then SIGKILL if it does not exit in time; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)
        self._log_file.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def qiao_server(
    stories_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SubprocessServer]:
    """One default `qiao serve` on stories260K, shared by the tests that only send requests."""
    log_path = tmp_path_factory.mktemp("qiao-server") / "server.log"
    server = SubprocessServer(
        ["--model", str(stories_dir), "--log-interval", "0", "--drain-timeout", "2"], log_path
    )
    try:
        yield server.wait_ready()
    finally:
        server.stop()
    if "Traceback" in server.log():
        pytest.fail(f"the shared server logged a traceback:\n{server.log()[-3000:]}")


# --- in-process server --------------------------------------------------------------------------


class StepGate:
    """Wraps `LLMEngine.step` so a test can hold the engine loop or slow every step.

    It also records the scheduler's waiting count as each step starts: that is after the step's
    new requests were added, so it is the waiting queue at its largest.
    """

    def __init__(self, llm_engine: Any) -> None:
        self._llm_engine = llm_engine
        self._step = llm_engine.step
        self._open = threading.Event()
        self._open.set()
        self.held = threading.Event()  # set while a step waits at the closed gate
        self.delay = 0.0
        self.max_num_waiting = 0
        llm_engine.step = self._gated_step

    def _gated_step(self) -> Any:
        scheduler = self._llm_engine.scheduler
        self.max_num_waiting = max(self.max_num_waiting, scheduler.num_waiting)
        if not self._open.is_set():
            self.held.set()
            # Bounded, so a test that forgets to release cannot wedge the engine thread forever.
            self._open.wait(60.0)
            self.held.clear()
        if self.delay:
            time.sleep(self.delay)
        return self._step()

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def reset(self) -> None:
        self.delay = 0.0
        self.max_num_waiting = 0
        self.release()


class InProcessServer:
    def __init__(self, settings: Any) -> None:
        import uvicorn

        from qiao.api.app import create_app
        from qiao.api.server import build_engine

        self.settings = settings
        self.engine = build_engine(settings)
        self.gate = StepGate(self.engine.engine)
        self.app = create_app(settings, self.engine)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        # log_config=None: leave logging alone, so errors reach the root logger (and the check).
        from qiao.api.http_protocol import MAX_HEADER_BYTES, QiaoH11Protocol

        config = uvicorn.Config(
            self.app,
            log_config=None,
            access_log=False,
            http=QiaoH11Protocol,
            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )
        self._thread.start()
        wait_until(
            lambda: self.server.started or not self._thread.is_alive(), 60.0, "uvicorn to start"
        )
        if not self.server.started:
            pytest.fail("the in-process server failed to start")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def num_kv_blocks(self) -> int:
        return self.engine.engine.num_kv_blocks

    def num_free_kv_blocks(self) -> int:
        return self.engine.stats()["num_free_kv_blocks"]

    def is_idle(self) -> bool:
        """No request anywhere (API streams, engine, scheduler) and every KV block free."""
        llm = self.engine.engine
        stats = self.engine.stats()
        return (
            self.engine.num_unfinished() == 0
            and not llm.has_unfinished_requests()
            and stats["num_running"] == 0
            and stats["num_waiting"] == 0
            and stats["num_free_kv_blocks"] == self.num_kv_blocks
        )

    def wait_idle(self, timeout: float = 15.0) -> None:
        wait_until(self.is_idle, timeout, "the engine to go idle with every KV block free")

    def stop(self) -> None:
        self.gate.release()
        self.server.should_exit = True
        self._thread.join(STOP_TIMEOUT_S)
        self._socket.close()
        assert not self._thread.is_alive(), "the in-process server did not stop"


def serve_settings(stories_dir: Path, **overrides: Any) -> Any:
    from qiao.api.settings import ServeSettings

    # A thread engine: tests hold or slow its steps (StepGate) and read its scheduler directly.
    defaults: dict[str, Any] = {
        "model": str(stories_dir),
        "log_interval": 0,
        "num_kv_blocks": 256,
        "in_process_engine": True,
    }
    return ServeSettings(**{**defaults, **overrides})


@pytest.fixture(scope="module")
def make_inprocess_server(stories_dir: Path) -> Iterator[Callable[..., InProcessServer]]:
    """make_inprocess_server(**settings) -> a started server, stopped when the module ends."""
    servers: list[InProcessServer] = []

    def make(**overrides: Any) -> InProcessServer:
        servers.append(InProcessServer(serve_settings(stories_dir, **overrides)))
        return servers[-1]

    yield make
    for server in servers:
        server.stop()


# --- metrics ------------------------------------------------------------------------------------

MetricKey = tuple[str, tuple[tuple[str, str], ...]]


def parse_metrics(text: str) -> dict[MetricKey, float]:
    """Prometheus text -> {(sample name, sorted labels without model_name and version): value}
    (these tests serve one model, version 1)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[MetricKey, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(
                sorted(
                    (k, v) for k, v in sample.labels.items() if k not in ("model_name", "version")
                )
            )
            samples[(sample.name, labels)] = sample.value
    return samples


def http_status_counts(metrics: dict[MetricKey, float]) -> dict[str, float]:
    """`qiao:http_requests_total` summed per status code."""
    counts: dict[str, float] = {}
    for (name, labels), value in metrics.items():
        if name == "qiao:http_requests_total":
            status = dict(labels)["status_code"]
            counts[status] = counts.get(status, 0.0) + value
    return counts
