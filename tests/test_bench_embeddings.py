"""`qiao bench embeddings` against a fake OpenAI-compatible embeddings server.

The fake (FastAPI under uvicorn, in a thread, on a loopback port) answers each input with a
deterministic vector after a fixed asyncio delay, and keeps its own tally of what it received
and what it refused: the reference the benchmark's counts are checked against. Timing figures
are checked only against bounds the delay implies (latency >= delay, closed-loop QPS <= C/delay).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import socket
import statistics
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from qiao.bench.cli import add_bench_subcommands
from qiao.bench.common import LengthSpec
from qiao.bench.embeddings import (
    EmbeddingsBenchConfig,
    Level,
    encode_bodies,
    level_shares,
    make_inputs,
)
from qiao.bench.embeddings_load import LevelRecorder
from qiao.bench.embeddings_report import latency_stats, summarize_level
from qiao.cli import main
from qiao.errors import ConfigError

DIMS = 6


@dataclass
class FakeServer:
    """What the fake does and what it saw. Mutated only on the server's event loop."""

    delay: float = 0.0  # seconds before each answer (asyncio.sleep)
    fail_every: int = 0  # answer 503 to every n-th request (1-based count)
    drop_one_vector: bool = False  # answer one vector fewer than inputs
    bodies: list[dict[str, Any]] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)  # in the order answered


def _vector(text: str) -> list[float]:
    return [float(len(text) % 97 + i) / 100 for i in range(DIMS)]


def _fake_app(fake: FakeServer) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> JSONResponse:
        body = await request.json()
        fake.bodies.append(body)
        if fake.delay:
            await asyncio.sleep(fake.delay)
        if fake.fail_every and len(fake.bodies) % fake.fail_every == 0:
            fake.statuses.append(503)
            return JSONResponse({"error": {"message": "fake queue is full"}}, status_code=503)
        texts = [body["input"]] if isinstance(body["input"], str) else body["input"]
        if fake.drop_one_vector:
            texts = texts[1:]
        data = []
        for i, text in enumerate(texts):
            vector: list[float] | str = _vector(text)
            if body.get("encoding_format") == "base64":
                vector = base64.b64encode(struct.pack(f"<{DIMS}f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": vector})
        fake.statuses.append(200)
        return JSONResponse({"object": "list", "data": data, "model": body["model"]})

    return app


@contextlib.contextmanager
def serving(fake: FakeServer) -> Iterator[str]:
    """Serve `fake` on a free loopback port; yield its base URL; stop it afterwards. The socket
    listens before uvicorn starts, so clients may connect at once (the kernel queues them)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # Accepted connections inherit it: without, Nagle holds back the answer's second write.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    config = uvicorn.Config(_fake_app(fake), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def _run(argv: list[str], tmp_path: Path, expect_rc: int = 0) -> dict[str, Any]:
    out = tmp_path / "report.json"
    assert main(["bench", "embeddings", *argv, "--quiet", "--out", str(out)]) == expect_rc
    return json.loads(out.read_text())


def _word_counts(body: dict[str, Any]) -> list[int]:
    texts = [body["input"]] if isinstance(body["input"], str) else body["input"]
    return [len(text.split()) for text in texts]


# --- end to end -------------------------------------------------------------------------------


def test_closed_loop_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    delay, num_requests = 0.02, 24
    fake = FakeServer(delay=delay)
    plot = tmp_path / "latency.png"
    with serving(fake) as url:
        argv = ["--base-url", url + "/v1/", "--model", "mini", "--concurrency", "1,4"]
        argv += ["--num-requests", str(num_requests), "--inputs-per-request", "3"]
        argv += ["--input-len", "4:8", "--warmup", "2", "--plot", str(plot)]
        report = _run(argv, tmp_path)
    # The fake saw warmup, then per level one request per client opening its connection and
    # the level's requests, each a well-formed body.
    assert len(fake.bodies) == 2 + (1 + num_requests) + (4 + num_requests)
    for body in fake.bodies:
        assert body["model"] == "mini" and body["encoding_format"] == "float"
        counts = _word_counts(body)
        assert len(counts) == 3 and all(4 <= n <= 8 for n in counts)

    assert report["config"]["load"] == "closed" and "api_key" not in report["config"]
    assert report["client_machine"]["num_cpus"] >= 1
    assert report["comparison"] is None
    (run,) = report["runs"]
    assert run["model"] == "mini" and run["base_url"] == url and run["dimensions"] == DIMS
    assert [level["concurrency"] for level in run["levels"]] == [1, 4]
    for level in run["levels"]:
        c, lat = level["concurrency"], level["latency_ms"]
        assert level["num_requests"] == level["num_completed"] == num_requests
        assert level["num_errors"] == 0 and level["errors"] == {} and level["first_error"] is None
        assert level["qps"] == pytest.approx(num_requests / level["duration_s"])
        assert level["inputs_per_s"] == pytest.approx(3 * level["qps"])
        assert level["qps"] <= c / delay
        assert delay * 1e3 <= lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
        assert level["meets_slo"] is (lat["p99"] < 200)
        assert level["send_lag_ms"] is None  # closed loop: no schedule to lag behind
        assert level["num_verified"] >= 1 and level["dimensions"] == DIMS
    # Four clients keep four requests in flight: well above one client's 1/delay.
    assert run["levels"][1]["qps"] > 1.5 / delay
    passing = [level["qps"] for level in run["levels"] if level["meets_slo"]]
    assert run["qps_at_slo"] == (max(passing) if passing else None)
    assert plot.stat().st_size > 1000
    text = capsys.readouterr().out
    assert "closed loop" in text and "QPS at p99 < 200 ms" in text


def test_open_loop_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    delay, duration, rates = 0.01, 0.5, (40.0, 80.0)
    fake = FakeServer(delay=delay)
    with serving(fake) as url:
        argv = ["--base-url", url, "--model", "mini", "--rate", "40,80", "--duration", "0.5"]
        argv += ["--warmup", "0", "--encoding-format", "base64", "--seed", "3"]
        report = _run(argv, tmp_path)
    run = report["runs"][0]
    assert report["config"]["load"] == "open" and run["dimensions"] == DIMS
    cfg = EmbeddingsBenchConfig("http://x", "m", rates=rates, duration=duration, seed=3)
    expected = [
        len(level_shares(cfg, i, level, "http://x", [b"{}"])[0].arrivals)
        for i, level in enumerate(cfg.levels())
    ]
    # warmup 0 still sends one request: the reachability check.
    assert len(fake.bodies) == 1 + sum(expected)
    assert all(isinstance(body["input"], str) for body in fake.bodies)
    for level, rate, count in zip(run["levels"], rates, expected, strict=True):
        assert level["request_rate"] == rate and level["concurrency"] is None
        assert level["num_requests"] == level["num_completed"] == count
        # A Poisson count over 0.5 s at rate r: mean r/2, well within 4 standard deviations.
        assert abs(count - rate * duration) < 4 * (rate * duration) ** 0.5
        # The last arrival is before `duration`, its answer at least `delay` later.
        assert level["duration_s"] >= delay
        assert level["qps"] == pytest.approx(count / level["duration_s"])
        assert level["latency_ms"]["min"] >= delay * 1e3
        assert level["send_lag_ms"]["max"] >= level["send_lag_ms"]["p50"] >= 0
    assert "open loop" in capsys.readouterr().out


def test_worker_processes_share_a_level(tmp_path: Path) -> None:
    # Long enough that worker start-up and HTTP costs stay small beside it (0.02 s missed 1.5x
    # once on 2 cores: 73.6 qps).
    delay, num_requests = 0.05, 10
    fake = FakeServer(delay=delay)
    with serving(fake) as url:
        argv = ["--base-url", url, "--model", "m", "--concurrency", "1,3", "--workers", "2"]
        report = _run(argv + ["--num-requests", str(num_requests), "--warmup", "1"], tmp_path)
    assert len(fake.bodies) == 1 + (1 + num_requests) + (3 + num_requests)
    for level in report["runs"][0]["levels"]:
        assert level["num_completed"] == num_requests and level["num_errors"] == 0
        assert level["qps"] <= level["concurrency"] / delay
        assert level["latency_ms"]["min"] >= delay * 1e3
    # Three clients over two processes still overlap their requests.
    assert report["runs"][0]["levels"][1]["qps"] > 1.5 / delay


def test_refusals_are_counted_with_the_first_error_body(tmp_path: Path) -> None:
    fake = FakeServer(fail_every=3)
    with serving(fake) as url:
        argv = ["--base-url", url, "--model", "m", "--concurrency", "2", "--num-requests", "30"]
        report = _run(argv + ["--warmup", "1"], tmp_path)
    (level,) = report["runs"][0]["levels"]
    # The level's requests were the fake's last 30: every third of them refused.
    assert fake.statuses[-30:].count(503) == 10
    assert level["num_errors"] == 10 and level["num_completed"] == 20
    assert level["errors"] == {"HTTP 503": 10}
    assert "HTTP 503" in level["first_error"] and "fake queue is full" in level["first_error"]
    assert level["meets_slo"] is False and report["runs"][0]["qps_at_slo"] is None


def test_wrong_vector_count_is_an_error(tmp_path: Path) -> None:
    fake = FakeServer(drop_one_vector=True)
    with serving(fake) as url:
        argv = ["--base-url", url, "--model", "m", "--concurrency", "2", "--num-requests", "5"]
        argv += ["--inputs-per-request", "4"]
        report = _run(argv, tmp_path, expect_rc=1)
    (level,) = report["runs"][0]["levels"]
    assert level["errors"] == {"bad response": 5} and level["num_completed"] == 0
    assert "expected 4 vectors, found 3" in level["first_error"]


def test_every_request_failing_exits_nonzero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeServer(fail_every=1)
    with serving(fake) as url:
        argv = ["--base-url", url, "--model", "m", "--concurrency", "1", "--num-requests", "3"]
        report = _run(argv, tmp_path, expect_rc=1)
    assert report["runs"][0]["levels"][0]["errors"] == {"HTTP 503": 3}
    assert "every request to" in capsys.readouterr().err


def test_compare_url_runs_both_sides_with_a_ratio(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fast, slow = FakeServer(delay=0.005), FakeServer(delay=0.04)
    with serving(fast) as fast_url, serving(slow) as slow_url:
        argv = ["--base-url", fast_url, "--compare-url", slow_url, "--model", "m"]
        argv += ["--compare-model", "m2", "--concurrency", "1,2", "--num-requests", "12"]
        argv += ["--p99-slo-ms", "1000", "--warmup", "1"]
        report = _run(argv, tmp_path)
    assert {b["model"] for b in fast.bodies} == {"m"} and {b["model"] for b in slow.bodies} == {
        "m2"
    }
    # Both servers got the same texts.
    assert sorted(b["input"] for b in fast.bodies) == sorted(b["input"] for b in slow.bodies)
    base, other = report["runs"]
    assert (base["label"], base["base_url"]) == ("base", fast_url)
    assert (other["label"], other["base_url"], other["model"]) == ("compare", slow_url, "m2")
    for run in (base, other):
        assert [lv["num_completed"] for lv in run["levels"]] == [12, 12]
        assert run["qps_at_slo"] == max(lv["qps"] for lv in run["levels"])
    ratio = report["comparison"]["qps_at_slo_ratio"]
    assert ratio == pytest.approx(base["qps_at_slo"] / other["qps_at_slo"])
    # The slow side's QPS is bounded by 2 / 40 ms = 50; the fast side is several times quicker.
    assert other["qps_at_slo"] <= 2 / 0.04 and ratio > 1.5
    text = capsys.readouterr().out
    assert "side by side" in text and f"{ratio:.2f}x" in text and slow_url in text


def test_unreachable_server_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = ["bench", "embeddings", "--base-url", f"http://127.0.0.1:{port}", "--model", "m"]
    assert main([*argv, "--num-requests", "2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--base-url" in err and "ConnectError" in err and "Traceback" not in err


def test_help_documents_every_flag() -> None:
    bench = argparse.ArgumentParser(prog="qiao bench")
    add_bench_subcommands(bench)
    subparsers = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    parser = subparsers.choices["embeddings"]
    text = parser.format_help()
    flags = {opt for action in parser._actions for opt in action.option_strings}
    wanted = {
        "--base-url", "--model", "--api-key", "--concurrency", "--rate", "--duration",
        "--num-requests", "--inputs-per-request", "--input-len", "--p99-slo-ms", "--warmup",
        "--out", "--plot", "--seed", "--quiet", "--compare-url", "--workers",
    }  # fmt: skip
    assert wanted <= flags
    for action in parser._actions:
        assert action.help, f"{action.option_strings} lacks help"
        for opt in action.option_strings:
            assert opt in text


# --- pieces -----------------------------------------------------------------------------------


def test_inputs_are_seeded_and_sized() -> None:
    def inputs_for(seed: int) -> list[list[str]]:
        cfg = EmbeddingsBenchConfig(
            "http://x",
            "m",
            num_requests=40,
            inputs_per_request=2,
            input_len=LengthSpec(3, 9),
            seed=seed,
        )
        return make_inputs(cfg)

    inputs = inputs_for(7)
    assert inputs == inputs_for(7) and inputs != inputs_for(8)
    assert len(inputs) == 40 and all(len(texts) == 2 for texts in inputs)
    lengths = [len(text.split()) for texts in inputs for text in texts]
    assert min(lengths) >= 3 and max(lengths) <= 9 and len(set(lengths)) > 3
    body = json.loads(encode_bodies(inputs[:1], "m", "base64")[0])
    assert body == {"model": "m", "input": inputs[0], "encoding_format": "base64"}


def test_levels_split_over_workers() -> None:
    cfg = EmbeddingsBenchConfig("http://x", "m", num_requests=10, workers=3)
    shares = level_shares(cfg, 0, Level(concurrency=4), "u", [b"{}"])
    assert [(s.concurrency, s.num_requests) for s in shares] == [(2, 4), (1, 3), (1, 3)]
    shares = level_shares(cfg, 0, Level(concurrency=2), "u", [b"{}"])
    assert [(s.concurrency, s.num_requests, s.is_idle) for s in shares] == [
        (1, 5, False),
        (1, 5, False),
        (0, 0, True),
    ]
    # An open loop: three independent Poisson streams of a third of the rate each.
    cfg = EmbeddingsBenchConfig("http://x", "m", rates=(300.0,), duration=2.0, workers=3)
    streams = [s.arrivals for s in level_shares(cfg, 0, cfg.levels()[0], "u", [b"{}"])]
    assert len({tuple(a) for a in streams}) == 3
    for arrivals in streams:
        assert arrivals[0] == 0 and arrivals == sorted(arrivals) and arrivals[-1] < 2.0
        assert abs(len(arrivals) - 200) < 4 * 200**0.5
    assert streams == [s.arrivals for s in level_shares(cfg, 0, cfg.levels()[0], "u", [b"{}"])]


def test_summary_matches_numpy_and_the_slo_rule() -> None:
    cfg = EmbeddingsBenchConfig("http://x", "m", inputs_per_request=2, p99_slo_ms=50)
    rec = LevelRecorder(expected_vectors=2)
    latencies = [0.001 * i for i in range(1, 41)]  # 1..40 ms
    rec.latencies.extend(latencies)
    summary = summarize_level(Level(concurrency=4), rec, 2.0, 0.25, cfg)
    lat = summary["latency_ms"]
    assert lat["p50"] == pytest.approx(statistics.median(latencies) * 1e3)
    assert lat["p99"] == pytest.approx(float(np.percentile(latencies, 99)) * 1e3)
    assert (lat["min"], lat["max"]) == pytest.approx((1.0, 40.0))
    assert summary["qps"] == 20 and summary["inputs_per_s"] == 40
    assert summary["client_cpu"] == 0.25 and summary["meets_slo"] is True
    rec.fail("HTTP 503", "busy")  # a single error fails the level, whatever the latencies
    assert summarize_level(Level(concurrency=4), rec, 2.0, 0.25, cfg)["meets_slo"] is False
    assert latency_stats([])["p99"] is None


def test_recorder_checks_vector_counts_and_dimensions() -> None:
    def answer(vectors: list[Any]) -> bytes:
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
        return json.dumps({"object": "list", "data": data}).encode()

    rec = LevelRecorder(expected_vectors=2)
    rec.answer(answer([[0.1, 0.2], [0.3, 0.4]]), 0.01)
    assert rec.latencies == [0.01] and rec.dimensions == 2 and rec.num_verified == 1
    rec.answer(answer([[0.1, 0.2]]), 0.01)
    assert rec.errors == {"bad response": 1} and "expected 2 vectors, found 1" in rec.first_error
    fresh = LevelRecorder(expected_vectors=2)
    fresh.answer(answer([[0.1, 0.2], [0.3]]), 0.01)  # parsed in full: dimensions differ
    assert fresh.errors == {"bad response": 1} and "differing" in fresh.first_error


def test_config_rejects_bad_levels() -> None:
    with pytest.raises(ConfigError, match="--rate"):
        EmbeddingsBenchConfig("http://x", "m", rates=(float("inf"),))
    with pytest.raises(ConfigError, match="--concurrency"):
        EmbeddingsBenchConfig("http://x", "m", concurrencies=(0,))
    with pytest.raises(ConfigError, match="--warmup"):
        EmbeddingsBenchConfig("http://x", "m", warmup=-1)
