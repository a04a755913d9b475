"""`--log-format json`: every line of the server and its engine process is a JSON object; the
access line of a request names its route, status, latency, tokens and key; lines written while
a request is served carry its id. Progress lines of long work (qiao/logs.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import pytest

from qiao.logs import JsonFormatter, Progress, configure_logging, heartbeat, start_request
from tests.serving.conftest import MODEL_NAME, SubprocessServer, openai_client

KEY = "test-key-0123456789abcdef"


@pytest.fixture(scope="module")
def json_server(stories_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log_path = tmp_path_factory.mktemp("json-logs") / "server.log"
    server = SubprocessServer(
        [
            "--model",
            str(stories_dir),
            "--log-format",
            "json",
            "--api-key",
            KEY,
            "--log-interval",
            "0",
            "--drain-timeout",
            "2",
        ],
        log_path,
    )
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def _entries(server: SubprocessServer) -> list[dict]:
    lines = [line for line in server.log().splitlines() if line.strip()]
    entries = []
    for line in lines:
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"a log line is not JSON: {line!r}")
    return entries


def test_every_line_is_json_and_the_access_line_has_the_request_fields(json_server):
    client = openai_client(json_server.base_url, api_key=KEY)
    answer = client.with_options(max_retries=0).chat.completions.with_raw_response.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Once upon a time"}],
        max_tokens=5,
        temperature=0,
        extra_headers={"X-Request-Id": "trace-json-1"},
    )
    usage = answer.parse().usage
    refused = httpx.get(f"{json_server.base_url}/v1/models")  # no key: 401
    assert refused.status_code == 401
    json_server.stop()  # flushes every line
    entries = _entries(json_server)
    assert {e["process"].split("[")[0] for e in entries} >= {"server", "engine"}
    for entry in entries:
        assert {"ts", "level", "logger", "process", "pid", "message"} <= set(entry)
    access = [e for e in entries if e["logger"] == "qiao.access"]
    (chat,) = [e for e in access if e.get("request_id") == "trace-json-1"]
    assert chat["route"] == "/v1/chat/completions" and chat["status"] == 200
    assert chat["method"] == "POST" and chat["latency_ms"] > 0
    assert chat["tokens"] == usage.total_tokens
    assert chat["key"] == "key-1"
    (denied,) = [e for e in access if e.get("path") == "/v1/models" and e["status"] == 401]
    assert denied["key"] is None and denied["request_id"] == refused.headers["x-request-id"]


def test_lines_logged_under_a_request_carry_its_id(caplog):
    logger = logging.getLogger("qiao.test")
    formatter = JsonFormatter("server")
    with caplog.at_level(logging.INFO):
        configure_logging("info", "server", "json")
        notes, token = start_request("req-77")
        logger.info("inside")
        from qiao.logs import end_request

        end_request(token)
        logger.info("outside")
    inside, outside = (r for r in caplog.records if r.name == "qiao.test")
    # The filter sits on qiao's handler; format as it would.
    for handler in logging.getLogger().handlers:
        if getattr(handler, "_qiao", False):
            for record in (inside, outside):
                handler.filter(record)
            logging.getLogger().removeHandler(handler)
    assert json.loads(formatter.format(inside))["request_id"] == "req-77"
    assert "request_id" not in json.loads(formatter.format(outside))
    assert notes == {"request_id": "req-77"}


def test_progress_reports_shares_and_a_heartbeat_reports_time(caplog):
    logger = logging.getLogger("qiao.test.progress")
    with caplog.at_level(logging.INFO, logger="qiao.test.progress"):
        progress = Progress(logger, "loading", total=4, unit="MB", every=0.0)
        for _ in range(4):
            progress.advance(1)
        progress.done()
        with heartbeat(logger, "building", every=0.01):
            import time

            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not any(
                r.getMessage().startswith("building: ") and "done" not in r.getMessage()
                for r in caplog.records
            ):
                time.sleep(0.01)
    messages = [r.getMessage() for r in caplog.records]
    assert "loading: 50% (2/4 MB)" in " ".join(messages)
    assert any(m.startswith("loading: done in") and "(4 MB)" in m for m in messages)
    assert [
        r.fields["share"]
        for r in caplog.records
        if r.getMessage().startswith("loading: ") and "done" not in r.getMessage()
    ] == [0.25, 0.5, 0.75, 1.0]
    assert any(m.startswith("building: ") and " s" in m for m in messages)
    assert any(m.startswith("building: done in") for m in messages)
