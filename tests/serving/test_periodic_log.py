"""The engine logs throughput, queue sizes and KV usage every `log_interval` seconds."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import pytest

from .conftest import MODEL_NAME, PROMPT, InProcessServer, http_client, wait_until

LINE = re.compile(
    r"throughput: [\d.]+ computed tok/s, [\d.]+ generated tok/s \| running \d+, waiting \d+ \| "
    r"KV cache [\d.]+% \| prefix-cache hit rate [\d.]+%"
)


@pytest.fixture(scope="module")
def server(make_inprocess_server: Callable[..., InProcessServer]) -> InProcessServer:
    return make_inprocess_server(log_interval=0.2)


def test_periodic_log_line(server: InProcessServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="qiao.engine.async_engine")
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 64, "temperature": 0}
    with http_client(server.base_url, timeout=30.0) as client:
        assert client.post("/v1/completions", json=body).status_code == 200

    def logged() -> bool:
        return any(LINE.search(r.getMessage()) for r in caplog.records)

    wait_until(logged, 10.0, "a throughput log line")
    generated = [
        float(m.group(1))
        for r in caplog.records
        if (m := re.search(r"([\d.]+) generated tok/s", r.getMessage()))
    ]
    assert max(generated) > 0, "the log line never saw the generated tokens"
