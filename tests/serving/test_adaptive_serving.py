"""`qiao serve --target-itl-ms`: adaptive batching's token budget is on /metrics and moves
under load (a target no decode step can meet on this machine, so it must shrink), and the
change is logged."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import MODEL_NAME, PROMPT, SubprocessServer, http_client, parse_metrics, wait_until

MAX_BUDGET, MIN_BUDGET = 256, 16


@pytest.fixture(scope="module")
def adaptive_server(
    stories_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SubprocessServer]:
    log_path = tmp_path_factory.mktemp("qiao-adaptive") / "server.log"
    server = SubprocessServer(
        [
            "--model",
            str(stories_dir),
            "--log-interval",
            "0",
            "--max-num-batched-tokens",
            str(MAX_BUDGET),
            # One microsecond: every decode step is slower, so the budget goes to its floor.
            "--target-itl-ms",
            "0.001",
            "--adaptive-min-batched-tokens",
            str(MIN_BUDGET),
        ],
        log_path,
    )
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def _budget(client) -> float:
    metrics = parse_metrics(client.get("/metrics").text)
    return metrics[("qiao:adaptive_token_budget", ())]


def test_budget_gauge_moves_under_load(adaptive_server: SubprocessServer) -> None:
    with http_client(adaptive_server.base_url, timeout=60.0) as client:
        assert _budget(client) == MAX_BUDGET
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200
        wait_until(lambda: _budget(client) < MAX_BUDGET, 10.0, "the budget gauge to shrink")
        # More load drives it to its floor, never below.
        for _ in range(3):
            assert client.post("/v1/completions", json=body).status_code == 200
        wait_until(lambda: _budget(client) == MIN_BUDGET, 10.0, "the budget to reach its floor")
        metrics = parse_metrics(client.get("/metrics").text)
        assert metrics[("qiao:adaptive_step_time_seconds", ())] > 0.000001
    wait_until(
        lambda: f"adaptive token budget: {MAX_BUDGET} -> " in adaptive_server.log(),
        10.0,
        "the change to be logged",
    )
