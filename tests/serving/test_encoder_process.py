"""Encoders in their own supervised process (`qiao serve`'s default for embedding and onnx
models): the same embeddings as in process, a killed encoder answers what it held and comes
back, a hung one is killed after the stall timeout, and the API process (its liveness) never
goes down meanwhile."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from qiao.engine.encoder_process import EncoderSpec, ProcessEncoder
from qiao.errors import CircuitOpenError, ConfigError, EngineUnavailableError

from .conftest import SubprocessServer, async_http_client, http_client, parse_metrics, wait_until
from .engine_faults import ENCODER_HANG, ENCODER_SLOW, SLOW_BATCH_S
from .test_supervision import LivenessProbe

MODEL = "tiny"
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "the cat sat on the mat."]
NUM_REQUESTS = 10


def encoder_pid(server: SubprocessServer) -> int:
    out = subprocess.run(
        ["pgrep", "-P", str(server.proc.pid), "-f", "qiao.engine.encoder_worker"],
        capture_output=True,
        text=True,
    ).stdout.split()
    assert len(out) == 1, f"expected one encoder process, found {out}"
    return int(out[0])


def restarts(client: httpx.Client) -> float:
    return parse_metrics(client.get("/metrics").text)[("qiao:engine_restarts_total", ())]


def embed_body(token_ids: list[list[int]] | None = None) -> dict:
    return {"model": MODEL, "input": token_ids if token_ids is not None else TEXTS}


def write_repository(root: Path, checkpoint: Path) -> Path:
    shutil.copytree(checkpoint, root / MODEL / "1")
    (root / MODEL / "config.yaml").write_text(
        "backend: embedding\nmax_batch_size: 32\ndynamic_batching:\n"
        "  max_queue_delay_microseconds: 1000\n"
    )
    return root


@pytest.fixture
def faulty_server(
    tiny_bert_checkpoint: Callable[[str], Path], tmp_path: Path
) -> Iterator[SubprocessServer]:
    """`qiao serve` of a repository holding one tiny encoder, in its process with faults."""
    root = write_repository(tmp_path / "repo", tiny_bert_checkpoint("bert-mlm"))
    env = {
        **os.environ,
        "QIAO_ENCODER_HOOK": "tests.serving.engine_faults:encoder_faults",
        "PYTHONPATH": str(Path(__file__).parents[2]),
    }
    server = SubprocessServer(
        ["--model-repository", str(root), "--log-interval", "0", "--stall-timeout", "2"],
        tmp_path / "server.log",
        env=env,
    )
    try:
        yield server.wait_ready()
    finally:
        server.stop()


# --- the same embeddings ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def onnx_folder(
    tiny_bert_checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    pytest.importorskip("onnxruntime")
    from qiao.export.onnx import export_onnx

    out = tmp_path_factory.mktemp("onnx") / "1"
    export_onnx(tiny_bert_checkpoint("bert-mlm"), out, opset=18, overwrite=True)
    return out


@pytest.mark.parametrize("variant", ["bert-model", "bert-mlm", "onnx"])
def test_the_encoder_process_gives_the_in_process_embeddings(
    tiny_bert_checkpoint: Callable[[str], Path],
    request: pytest.FixtureRequest,
    variant: str,
) -> None:
    if variant == "onnx":
        spec = EncoderSpec(str(request.getfixturevalue("onnx_folder")), "onnx")
    else:
        spec = EncoderSpec(str(tiny_bert_checkpoint(variant)), "embedding", max_length=20)
    local = spec.load()
    remote = ProcessEncoder.build(spec, name=f"{variant}/1")
    try:
        assert (remote.dim, remote.max_length) == (local.dim, local.max_length)
        ids = remote.tokenize([*TEXTS, "the dog " * 30])
        assert ids == local.tokenize([*TEXTS, "the dog " * 30])
        assert len(ids[-1]) == local.max_length  # cut here, by the API process's tokenizer
        vectors = remote.embed(ids)
        assert vectors.dtype == np.float32 and vectors.shape == (len(ids), local.dim)
        assert np.allclose(vectors, local.embed(ids), atol=1e-6)
        # The encoder's own errors cross the boundary as they are (class and message).
        with pytest.raises(ConfigError, match=r"token_ids: id 999 is outside the vocabulary"):
            remote.embed([[2, 999, 3]])
    finally:
        remote.shutdown()
    assert remote.restarts == 0 and remote.health() == (False, "encoder stopped")


def test_a_version_in_process_and_one_in_its_process_answer_alike(
    tiny_bert_checkpoint: Callable[[str], Path],
) -> None:
    from qiao.engine.async_engine import AdmissionLimits
    from qiao.engine.batcher import BatcherConfig
    from qiao.repository.loading import VersionBuilder
    from qiao.repository.served import EncoderVersion

    spec = EncoderSpec(str(tiny_bert_checkpoint("bert-model")), "embedding")

    async def embeddings(in_process: bool) -> tuple[np.ndarray, ProcessEncoder | None]:
        builder = VersionBuilder(AdmissionLimits(), in_process_engine=in_process)
        encoder = builder.encoder(spec, name="tiny/1")
        version = EncoderVersion("tiny", "1", encoder, BatcherConfig(), backend="embedding")
        version.start()
        try:
            assert version.is_healthy() == (True, "ok")
            parts = await asyncio.gather(*(version.embed([text]) for text in TEXTS))
        finally:
            await version.stop()
        process = encoder if isinstance(encoder, ProcessEncoder) else None
        return np.concatenate(parts), process

    thread, none = asyncio.run(embeddings(in_process=True))
    process, encoder = asyncio.run(embeddings(in_process=False))
    assert none is None and encoder is not None
    assert np.allclose(thread, process, atol=1e-6)
    assert encoder.stats()["engine_restarts"] == 0  # stopped cleanly: not a death
    with pytest.raises(EngineUnavailableError, match="is stopped"):
        encoder.embed([[2, 5, 3]])


@pytest.mark.logs_errors
def test_each_death_is_one_failure_of_the_versions_breaker(
    tiny_bert_checkpoint: Callable[[str], Path],
) -> None:
    from qiao.engine.batcher import BatcherConfig
    from qiao.engine.breaker import BreakerConfig
    from qiao.repository.served import EncoderVersion

    spec = EncoderSpec(str(tiny_bert_checkpoint("bert-model")), "embedding")
    encoder = ProcessEncoder.build(spec, name="tiny/1")
    breaker = BreakerConfig(failures=1, window=30, cooldown=60)
    version = EncoderVersion(
        "tiny", "1", encoder, BatcherConfig(), backend="embedding", breaker=breaker
    )

    async def kill_once() -> None:
        version.start()
        try:
            os.kill(encoder.check_up().proc.pid, signal.SIGKILL)
            while version.is_healthy()[0]:
                await asyncio.sleep(0.01)
            assert version.is_healthy() == (
                False,
                "encoder restarting (the last one killed by SIGKILL)",
            )
            with pytest.raises(CircuitOpenError):
                await version.embed(TEXTS)
        finally:
            await version.stop()  # within the restart delay: no new process starts

    asyncio.run(kill_once())
    stats = version.stats()
    assert stats["engine_restarts"] == 1 and stats["breaker_state"] == 1
    assert stats["breaker_opened"] == 1


# --- supervision ------------------------------------------------------------------------------


async def _requests_cut_by_a_kill(server: SubprocessServer) -> tuple[list[httpx.Response], float]:
    """NUM_REQUESTS slow requests at once; the encoder process SIGKILLed while they are held.
    Returns the answers and the time of the kill."""
    limits = httpx.Limits(max_connections=NUM_REQUESTS + 2)
    async with async_http_client(server.base_url, limits=limits, timeout=60.0) as client:
        bodies = [embed_body([[ENCODER_SLOW, 5 + i, 6]]) for i in range(NUM_REQUESTS)]
        tasks = [asyncio.ensure_future(client.post("/v1/embeddings", json=b)) for b in bodies]
        await asyncio.sleep(1.0)  # all sent: the first batch sleeps, the rest are queued
        assert not any(task.done() for task in tasks)
        os.kill(encoder_pid(server), signal.SIGKILL)
        killed_at = time.monotonic()
        answers = []
        for task in tasks:
            answers.append(await task)
            assert time.monotonic() - killed_at < 2.0, "an answer came later than 2 s"
        return answers, killed_at


def test_a_killed_encoder_answers_what_it_held_and_comes_back(
    faulty_server: SubprocessServer,
) -> None:
    server = faulty_server
    first_pid = encoder_pid(server)
    probe = LivenessProbe(server.base_url)
    try:
        with http_client(server.base_url, timeout=30.0) as client:
            before = client.post("/v1/embeddings", json=embed_body())
            assert before.status_code == 200, before.text
            metrics = parse_metrics(client.get("/metrics").text)
            assert metrics[("qiao:engine_up", ())] == 1
            assert metrics[("qiao:engine_restarts_total", ())] == 0
            assert metrics[("qiao:engine_resident_memory_bytes", ())] > 0

            answers, _ = asyncio.run(_requests_cut_by_a_kill(server))
            assert client.get("/health/ready").status_code == 503  # restarting
            assert parse_metrics(client.get("/metrics").text)[("qiao:engine_up", ())] == 0
            wait_until(
                lambda: client.get("/health/ready").status_code == 200, 60, "the encoder to return"
            )
            after = client.post("/v1/embeddings", json=embed_body())
            assert after.status_code == 200, after.text
            assert after.json()["data"] == before.json()["data"]
            assert restarts(client) == 1
    finally:
        probe.stop()
    failed = [a for a in answers if a.status_code != 200]
    assert failed, "every request finished before the kill"
    for answer in failed:
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "engine_restarted"
        assert answer.headers["Retry-After"]
    assert encoder_pid(server) != first_pid
    assert probe.samples > 0 and probe.failures == []
    second_pid = encoder_pid(server)
    assert server.stop() == 0
    assert not Path(f"/proc/{second_pid}").exists()  # stopped with the server
    log = server.log()
    assert "killed by SIGKILL" in log and "Traceback" not in log
    assert "did not stop" not in log


def test_a_hung_encoder_is_killed_after_the_stall_timeout_and_restarted(
    faulty_server: SubprocessServer,
) -> None:
    server = faulty_server
    readiness: list[int] = []
    stop_watching = threading.Event()

    def watch_ready() -> None:
        with httpx.Client(base_url=server.base_url, timeout=5.0) as c:
            while not stop_watching.wait(0.05):
                readiness.append(c.get("/health/ready").status_code)

    async def hung_and_queued() -> tuple[httpx.Response, httpx.Response]:
        async with async_http_client(server.base_url, timeout=60.0) as client:
            hung = asyncio.ensure_future(
                client.post("/v1/embeddings", json=embed_body([[ENCODER_HANG, 5, 6]]))
            )
            await asyncio.sleep(0.5)
            queued = await client.post("/v1/embeddings", json=embed_body())
            return await hung, queued

    watcher = threading.Thread(target=watch_ready, daemon=True)
    watcher.start()
    probe = LivenessProbe(server.base_url)
    started = time.monotonic()
    try:
        hung, queued = asyncio.run(hung_and_queued())
        elapsed = time.monotonic() - started
        with http_client(server.base_url, timeout=30.0) as client:
            wait_until(
                lambda: client.get("/health/ready").status_code == 200, 60, "the encoder to return"
            )
            assert client.post("/v1/embeddings", json=embed_body()).status_code == 200
            assert restarts(client) == 1
    finally:
        probe.stop()
        stop_watching.set()
        watcher.join(10)
    for answer in (hung, queued):
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "engine_restarted"
    assert 2.0 <= elapsed < 2.0 + SLOW_BATCH_S  # the stall timeout, then at once
    assert 503 in readiness  # readiness turned while the encoder restarted
    assert probe.failures == []
    assert "made no progress for 2 s and was killed" in server.log()
