"""`qiao bench soak`: it flags a server that leaks memory and passes the real one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import SubprocessServer, qiao_command, wait_until

LEAK_BYTES = 256 * 1024  # per request


def _leaky_app():  # type: ignore[no-untyped-def]
    """An OpenAI-shaped server that keeps 256 KiB of every request it answers."""
    from fastapi import FastAPI, Request
    from fastapi.responses import Response, StreamingResponse
    from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest

    app = FastAPI()
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    kept: list[bytes] = []

    def leak() -> None:
        kept.append(os.urandom(LEAK_BYTES))  # random bytes: every page touched

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "leaky", "max_model_len": 64}]}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> object:
        body = await request.json()
        leak()
        if body.get("stream"):

            async def events():  # type: ignore[no-untyped-def]
                for word in ("a", "b", "c"):
                    yield f'data: {{"choices": [{{"text": "{word}"}}]}}\n\n'
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return {"choices": [{"text": "abc", "finish_reason": "length"}]}

    @app.post("/v1/chat/completions")
    async def chat() -> dict:
        leak()
        return {"choices": [{"message": {"role": "assistant", "content": "abc"}}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type="text/plain")

    return app


@pytest.fixture
def leaky_server() -> Iterator[str]:
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_leaky_app(), log_config=None, access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "the leaky server to start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def _soak(base_url: str, tmp_path: Path, *extra: str) -> tuple[int, str, dict]:
    report = tmp_path / "soak.json"
    result = subprocess.run(
        [*qiao_command(), "bench", "soak", "--base-url", base_url, "--json", str(report)]
        + ["--no-progress", "--sample-interval", "0.5", *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return result.returncode, result.stdout + result.stderr, json.loads(report.read_text())


def test_soak_flags_a_leaking_server(leaky_server: str, tmp_path: Path) -> None:
    code, output, report = _soak(leaky_server, tmp_path, "--duration", "6", "--concurrency", "2")
    assert code == 1, output
    assert report["leak"] and "LEAK" in output
    assert report["slopes_mib_per_min"]["api_rss_bytes"] > 10
    assert "embedding" not in report["requests"]  # the server lists no embedding model


def test_soak_passes_the_real_server(stories_dir: Path, tmp_path: Path) -> None:
    server = SubprocessServer(
        ["--model", str(stories_dir), "--log-interval", "0"], tmp_path / "server.log"
    ).wait_ready()
    try:
        # 20 s mostly measure a fresh server settling (its allocator's arenas filling); only a
        # gross leak shows this soon. The leaky fixture above grows hundreds of MiB a minute;
        # a real verdict takes the default bound over a long run (docs/operations.md).
        code, output, report = _soak(
            server.base_url,
            tmp_path,
            *("--duration", "20", "--concurrency", "2", "--warmup", "0.3", "--max-slope", "30"),
        )
    finally:
        server.stop()
    assert code == 0, output
    assert not report["leak"] and "no leak" in report["verdict"]
    # The engines summed, and each engine process apart (a bare --model serves one: version 1).
    assert set(report["slopes_mib_per_min"]) == {
        "api_rss_bytes",
        "engine_rss_bytes",
        "engine_rss_bytes[stories260K-hf@1]",
    }
    kinds = report["requests"]
    for kind in ("completion", "chat", "stream", "disconnect"):
        assert kinds[kind].get("200", 0) > 0, kinds
    assert all(status == "200" for counts in kinds.values() for status in counts), kinds
