"""OpenAI's Batch API through the official openai client against a bare `qiao serve` (the demo
LLM and MiniLM): files.create → batches.create → poll batches.retrieve → files.content, for
chat, completions and embeddings, with an error file for malformed lines; cancel; a server
SIGKILLed during a batch resumes it on restart, each line answered exactly once."""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

import qiao

from .conftest import SubprocessServer, openai_client, parse_metrics, wait_until

LLM = "demo_model"
ENCODER = "all-MiniLM-L6-v2"
TERMINAL = ("completed", "failed", "expired", "cancelled")


def _line(custom_id: str, url: str, body: dict[str, Any]) -> bytes:
    entry = {"custom_id": custom_id, "method": "POST", "url": url, "body": body}
    return json.dumps(entry).encode() + b"\n"


def _serve(data_dir: Path, log: Path, *extra: str) -> SubprocessServer:
    return SubprocessServer(
        ["--data-dir", str(data_dir), "--log-interval", "0", *extra], log
    ).wait_ready()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    folder = tmp_path_factory.mktemp("batches")
    running = _serve(folder / "data", folder / "server.log")
    try:
        yield running
    finally:
        running.stop()


def _finish(client: Any, batch_id: str, timeout: float = 120.0) -> Any:
    done: list[Any] = []

    def terminal() -> bool:
        done[:] = [client.batches.retrieve(batch_id)]
        return done[0].status in TERMINAL

    wait_until(terminal, timeout, f"batch {batch_id} to finish", interval=0.1)
    return done[0]


def _content(client: Any, file_id: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_chat_completions_and_embeddings_batches(server: SubprocessServer) -> None:
    client = openai_client(server.base_url)
    prompts = ["Once upon a time", "The little dog", "A king"]
    completions = b"".join(
        _line(
            f"c{i}",
            "/v1/completions",
            {"model": LLM, "prompt": p, "max_tokens": 12, "temperature": 0},
        )
        for i, p in enumerate(prompts)
    )
    completions += b"{not json\n"
    completions += _line("bad", "/v1/completions", {"model": LLM, "prompt": "x", "n": 0})
    completions += _line("chat-url", "/v1/chat/completions", {"model": LLM, "messages": []})
    upload = client.files.create(file=("completions.jsonl", completions), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id,
        endpoint="/v1/completions",
        completion_window="24h",
        metadata={"team": "eval"},
    )
    assert batch.status == "validating" and batch.metadata == {"team": "eval"}
    done = _finish(client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed) == (6, 3)
    assert done.request_counts.failed == 3
    assert done.completed_at >= done.in_progress_at >= done.created_at
    assert done.expires_at == done.created_at + 24 * 3600

    answered = _content(client, done.output_file_id)
    assert [r["custom_id"] for r in answered] == ["c0", "c1", "c2"]
    for record, prompt in zip(answered, prompts, strict=True):
        # The route's own answer to the same body, greedy: the batch must give the same text.
        direct = client.completions.create(model=LLM, prompt=prompt, max_tokens=12, temperature=0)
        body = record["response"]["body"]
        assert record["response"]["status_code"] == 200
        assert body["choices"][0]["text"] == direct.choices[0].text
        assert body["usage"]["completion_tokens"] == direct.usage.completion_tokens
    errors = {r["custom_id"]: r for r in _content(client, done.error_file_id)}
    assert set(errors) == {None, "bad", "chat-url"}
    assert errors[None]["error"]["code"] == "invalid_json"
    assert errors["bad"]["response"]["status_code"] == 400
    assert errors["bad"]["response"]["body"]["error"]["param"] == "n"
    assert (
        "this batch's endpoint is '/v1/completions'"
        in (errors["chat-url"]["response"]["body"]["error"]["message"])
    )
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"

    chat = _line(
        "hello",
        "/v1/chat/completions",
        {"model": LLM, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8},
    )
    upload = client.files.create(file=("chat.jsonl", chat), purpose="batch")
    done = _finish(
        client,
        client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id,
    )
    (chat_record,) = _content(client, done.output_file_id)
    assert chat_record["custom_id"] == "hello" and done.error_file_id is None
    message = chat_record["response"]["body"]["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)

    texts = ["hello world", "a quiet forest"]
    embed = b"".join(
        _line(f"e{i}", "/v1/embeddings", {"model": ENCODER, "input": t})
        for i, t in enumerate(texts)
    )
    upload = client.files.create(file=("embed.jsonl", embed), purpose="batch")
    done = _finish(
        client,
        client.batches.create(
            input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h"
        ).id,
    )
    records = _content(client, done.output_file_id)
    direct = client.embeddings.create(model=ENCODER, input=texts)
    for record, want in zip(records, direct.data, strict=True):
        got = record["response"]["body"]["data"][0]["embedding"]
        np.testing.assert_allclose(got, want.embedding, atol=1e-5)
    listed = client.batches.list()
    assert done.id == listed.data[0].id and len(listed.data) == 3

    metrics = parse_metrics(httpx.get(f"{server.base_url}/metrics").text)
    assert metrics[("qiao:batch_jobs", (("status", "completed"),))] == 3
    assert metrics[("qiao:batch_jobs", (("status", "in_progress"),))] == 0
    assert metrics[("qiao:batch_lines_total", (("outcome", "answered"),))] == 6
    assert metrics[("qiao:batch_lines_total", (("outcome", "failed"),))] == 3
    generated = sum(
        r["response"]["body"]["usage"]["completion_tokens"] for r in [*answered, chat_record]
    )
    assert metrics[("qiao:batch_generation_tokens_total", ())] == generated


def test_bad_batch_requests_are_4xx(server: SubprocessServer) -> None:
    client = openai_client(server.base_url)
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-missing", endpoint="/v1/completions", completion_window="24h"
        )
    upload = client.files.create(
        file=("x.jsonl", _line("a", "/v1/completions", {})), purpose="batch"
    )
    with pytest.raises(openai.BadRequestError) as endpoint:
        client.batches.create(
            input_file_id=upload.id, endpoint="/v1/images", completion_window="24h"
        )
    assert endpoint.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError) as window:
        client.batches.create(
            input_file_id=upload.id, endpoint="/v1/completions", completion_window="forever"
        )
    assert window.value.body["param"] == "completion_window"
    for priority in ("high", "-1", "1001"):
        with pytest.raises(openai.BadRequestError) as bad:
            client.batches.create(
                input_file_id=upload.id,
                endpoint="/v1/completions",
                completion_window="24h",
                metadata={"priority": priority},
            )
        assert bad.value.body["param"] == "metadata" and "metadata.priority" in str(bad.value)
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_missing")


def test_waiting_batches_run_by_their_priority(server: SubprocessServer) -> None:
    """One batch runs at a time (--batch-concurrency 1): behind a running one, a later batch of
    priority 0 overtakes an earlier one of priority 9."""
    client = openai_client(server.base_url)

    def create(lines: int, tokens: int, **metadata: str) -> Any:
        upload = client.files.create(file=("p.jsonl", _many(lines, tokens)), purpose="batch")
        return client.batches.create(
            input_file_id=upload.id,
            endpoint="/v1/completions",
            completion_window="24h",
            metadata=metadata or None,
        )

    blocker = create(400, 64)
    wait_until(
        lambda: client.batches.retrieve(blocker.id).status == "in_progress", 60, "the blocker"
    )
    late = create(200, 32, priority="9")
    urgent = create(1, 2)  # priority 0, the default
    client.batches.cancel(blocker.id)
    assert _finish(client, urgent.id).status == "completed"
    behind = client.batches.retrieve(late.id)
    assert behind.status in ("validating", "in_progress"), behind.status
    assert behind.request_counts.completed < 200
    assert _finish(client, late.id).status == "completed"


def _online_ttft(base_url: str, count: int) -> list[float]:
    """Time to the first streamed token of `count` online completions, one after another."""
    times = []
    with httpx.Client(base_url=base_url, timeout=60) as http:
        for i in range(count):
            body = {"model": LLM, "prompt": f"Online {i}:", "max_tokens": 8, "stream": True}
            start = time.perf_counter()
            with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                first = None
                for line in response.iter_lines():
                    if first is None and line.startswith("data: ") and '"text"' in line:
                        first = time.perf_counter() - start
            assert first is not None
            times.append(first)
    return times


def test_online_requests_are_served_beside_a_running_batch(server: SubprocessServer) -> None:
    """Online requests sent while a batch of 500 lines runs are all answered while the batch is
    still in progress, and the batch keeps moving meanwhile. How much latency they keep is a
    speed, measured by `qiao bench serve --with-batch` (docs/batch.md), not asserted here; the
    scheduler's yielding to online requests is checked step by step in
    tests/test_scheduler.py::test_background_requests_use_spare_capacity_and_yield_to_online_ones."""
    client = openai_client(server.base_url)
    _online_ttft(server.base_url, 3)  # warm-up
    alone = statistics.median(_online_ttft(server.base_url, 20))
    upload = client.files.create(file=("b.jsonl", _many(500, 64)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    try:
        wait_until(
            lambda: client.batches.retrieve(batch.id).request_counts.completed >= 5,
            60,
            "the batch's first lines",
        )
        before = client.batches.retrieve(batch.id).request_counts.completed
        beside = statistics.median(_online_ttft(server.base_url, 20))
        after = client.batches.retrieve(batch.id)
    finally:
        client.batches.cancel(batch.id)
    print(f"online p50 TTFT: {alone * 1e3:.1f} ms alone, {beside * 1e3:.1f} ms beside the batch")
    assert after.status == "in_progress", "the batch ended before the online requests did"
    assert after.request_counts.completed > before  # it used the spare capacity
    assert _finish(client, batch.id).status == "cancelled"


def _many(count: int, max_tokens: int, **extra: Any) -> bytes:
    return b"".join(
        _line(
            f"r{i}",
            "/v1/completions",
            {
                "model": LLM,
                "prompt": f"Story {i}:",
                "max_tokens": max_tokens,
                "ignore_eos": True,
                **extra,
            },
        )
        for i in range(count)
    )


def _without_run_ids(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records without what differs between two runs by design: ids and creation times."""
    for record in records:
        record.pop("id")
        response = record["response"]
        response.pop("request_id")
        response["body"].pop("id")
        response["body"].pop("created")
    return records


def test_cancel_stops_a_batch_and_keeps_what_finished(server: SubprocessServer) -> None:
    client = openai_client(server.base_url)
    upload = client.files.create(file=("many.jsonl", _many(400, 64)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    wait_until(
        lambda: client.batches.retrieve(batch.id).request_counts.completed > 0,
        60,
        "the first answered lines",
    )
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = _finish(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    kept = _content(client, done.output_file_id)
    assert 0 < len(kept) == done.request_counts.completed < 400
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: unchanged

    small = client.files.create(file=("one.jsonl", _many(1, 2)), purpose="batch")
    finished = client.batches.create(
        input_file_id=small.id, endpoint="/v1/completions", completion_window="24h"
    )
    assert _finish(client, finished.id).status == "completed"
    with pytest.raises(openai.APIStatusError) as late:
        client.batches.cancel(finished.id)
    assert late.value.status_code == 409 and "is completed" in late.value.body["message"]


@pytest.mark.slow
def test_a_killed_server_resumes_its_batch(tmp_path: Path) -> None:
    """Killed mid-batch and restarted, a batch-invariant server answers every line once, the
    same as an uninterrupted `qiao batch run` of the file, and writes the results to its
    --batch-output-url (file://) as well."""
    data = tmp_path / "data"
    lines = _many(300, 24, temperature=0)
    results = tmp_path / "results"
    flags = ("--batch-invariant", "--batch-output-url", f"file://{results}")
    first = _serve(data, tmp_path / "first.log", *flags)
    client = openai_client(first.base_url)
    upload = client.files.create(file=("many.jsonl", lines), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    wait_until(
        lambda: client.batches.retrieve(batch.id).request_counts.completed >= 20,
        60,
        "lines answered before the kill",
    )
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait()
    first.stop()
    assert (data / "qiao.sqlite").exists()  # the store it resumes from

    second = _serve(data, tmp_path / "second.log", *flags)
    try:
        client = openai_client(second.base_url)
        done = _finish(client, batch.id, timeout=180)
        assert done.status == "completed", done
        records = _content(client, done.output_file_id)
        assert [r["custom_id"] for r in records] == [f"r{i}" for i in range(300)]
        assert done.request_counts.completed == 300 and done.request_counts.failed == 0
        assert f"batch {batch.id}: resuming" in second.log()
    finally:
        second.stop()
    assert time.time() < done.expires_at
    copied = results / batch.id / "output.jsonl"
    assert done.model_extra["output_url"] == f"file://{copied}"
    assert "error_url" not in done.model_extra  # no line failed
    assert [json.loads(line) for line in copied.read_text().splitlines()] == records

    source = tmp_path / "many.jsonl"
    source.write_bytes(lines)
    offline = tmp_path / "offline.jsonl"
    demo = Path(qiao.__file__).parent / "demo_model"
    run = [sys.executable, "-m", "qiao.cli", "batch", "run", str(source), "-o", str(offline)]
    finished = subprocess.run(
        [*run, "--model", str(demo), "--no-progress"], capture_output=True, text=True
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    want = _without_run_ids([json.loads(line) for line in offline.read_text().splitlines()])
    assert _without_run_ids(records) == want


def test_bench_serve_with_batch_compares_alone_and_beside(server: SubprocessServer) -> None:
    """`qiao bench serve --with-batch`: the ladder alone, then beside a batch it starts on the
    server, side by side; the batch is cancelled afterwards."""
    from qiao.bench.common import LengthSpec
    from qiao.bench.serve import ServeConfig, run_serve
    from qiao.bench.serve_report import format_serve

    cfg = ServeConfig(
        base_url=server.base_url,
        model=LLM,
        request_rates=(20.0, float("inf")),
        num_prompts=6,
        input_len=LengthSpec(4, 8),
        output_len=LengthSpec(8, 8),
        # Enough lines that the batch outlasts the ladder even on a loaded machine.
        with_batch=3000,
        show_progress=False,
    )
    report = run_serve(cfg)
    beside = report["with_batch"]
    assert [r["num_completed"] for r in report["rates"]] == [6, 6]
    assert [r["num_completed"] for r in beside["rates"]] == [6, 6]
    batch = beside["batch"]
    assert (
        batch["total_lines"] == 3000
        and batch["ran_throughout"]
        and batch["status_after"] == ("in_progress")
    )
    comparison = beside["comparison"]
    assert [r["request_rate"] for r in comparison["rates"]] == [20.0, "inf"]
    pairs = zip(report["rates"], beside["rates"], comparison["rates"], strict=True)
    for alone, near, ratio in pairs:
        assert ratio["goodput_ratio"] == pytest.approx(near["goodput"] / alone["goodput"])
    client = openai_client(server.base_url)
    done = _finish(client, batch["id"])
    assert done.status == "cancelled"  # the bench left the server as it found it
    text = format_serve(report)
    assert f"beside batch {batch['id']} (3000 lines)" in text and "SLO rate:" in text
