"""`qiao serve --ray ADDRESS --replicas 2`: engine replicas of the demo model as a Ray Serve
application on a local Ray cluster this module starts (`ray start --head`) and stops. Distinct
prompts spread over both replicas; prompts sharing a long prefix land on one; a replica
SIGKILLed under load leaves no request hanging (200, or 503 at once) and Ray Serve replaces it;
with autoscaling a burst adds a replica and idleness removes it. `qiao batch run --ray` over two
actors writes the single-process output, and a killed actor's shard resumes without duplicates."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import SubprocessServer, parse_metrics, wait_until
from .test_data_parallel import _ask

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'qiao[ray]'")

MODEL_DIR = Path(__file__).resolve().parents[2] / "qiao" / "demo_model"
MODEL = "demo_model"
RAY = str(Path(sys.executable).with_name("ray"))

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="two replicas need two cores"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    port = _free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run(
        [
            RAY,
            "start",
            "--head",
            "--node-ip-address",
            "127.0.0.1",
            "--port",
            str(port),
            "--num-cpus",
            "4",
            "--object-store-memory",
            str(200 * 2**20),
            "--include-dashboard",
            "false",
            "--disable-usage-stats",
        ],
        check=True,
        env=env,
        capture_output=True,
    )
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)


def _serve(address: str, folder: Path, *extra: str) -> SubprocessServer:
    args = [
        "--model",
        str(MODEL_DIR),
        "--data-dir",
        str(folder / "data"),
        "--log-interval",
        "0",
        "--ray",
        address,
        "--ray-health-check-period",
        "1",
        *extra,
    ]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    return SubprocessServer(args, folder / "server.log", env=env).wait_ready(timeout=300)


@pytest.fixture(scope="module")
def server(
    ray_address: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SubprocessServer]:
    folder = tmp_path_factory.mktemp("ray")
    running = _serve(ray_address, folder, "--replicas", "2")
    try:
        yield running
    finally:
        running.stop()


def _replica_pids() -> list[int]:
    out = subprocess.run(
        ["pgrep", "-f", "ServeReplica:"], capture_output=True, text=True
    ).stdout.split()
    return sorted(int(pid) for pid in out)


def _replicas(client: httpx.Client, name: str) -> list[float]:
    metrics = parse_metrics(client.get("/metrics").text)
    series = sorted(
        (labels, value)
        for (sample, labels), value in metrics.items()
        if sample == name and labels and labels[0][0] == "replica"
    )
    return [value for _, value in series]


def _delta(after: list[float], before: list[float]) -> list[float]:
    return [a - b for a, b in zip(after, before, strict=True)]


def test_two_replicas_share_the_work_and_a_shared_prefix_meets_one(
    server: SubprocessServer,
) -> None:
    assert len(_replica_pids()) == 2
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        before = _replicas(client, "qiao:replica_requests_routed_total")
        assert _ask(server.base_url, [f"Short question {i}" for i in range(24)]) == [200] * 24
        spread = _delta(_replicas(client, "qiao:replica_requests_routed_total"), before)
        assert sum(spread) == 24 and min(spread) > 0, spread

        affine_before = _replicas(client, "qiao:replica_requests_routed_by_affinity_total")
        routed_before = _replicas(client, "qiao:replica_requests_routed_total")
        prefix = " ".join(["the king said to his son and the queen"] * 12)  # > 64 tokens
        assert _ask(server.base_url, [f"{prefix} question {i}" for i in range(8)]) == [200] * 8
        affine = _delta(
            _replicas(client, "qiao:replica_requests_routed_by_affinity_total"), affine_before
        )
        routed = _delta(_replicas(client, "qiao:replica_requests_routed_total"), routed_before)
        assert sorted(affine) == [0, 8] and routed == affine  # all on one replica


def test_a_killed_replica_answers_its_requests_and_is_replaced(server: SubprocessServer) -> None:
    victim = _replica_pids()[0]
    timings: list[tuple[int, float]] = []

    def one(i: int) -> None:
        body = {"model": MODEL, "prompt": f"Story {i}:", "max_tokens": 32, "temperature": 0}
        with httpx.Client(base_url=server.base_url, timeout=60) as c:
            code = c.post("/v1/completions", json=body).status_code
        timings.append((code, time.monotonic()))

    with ThreadPoolExecutor(8) as pool, httpx.Client(base_url=server.base_url) as client:
        futures = [pool.submit(one, i) for i in range(40)]
        wait_until(
            lambda: (
                sum(_replicas(client, "qiao:replica_requests_unfinished")) > 0
                or any(f.done() for f in futures)
            ),
            60,
            "the load to reach the replicas",
            interval=0.02,
        )
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        for future in futures:
            future.result(timeout=120)
    codes = [code for code, _ in timings]
    assert set(codes) <= {200, 503}, codes
    assert codes.count(200) >= 20, codes  # the other replica kept serving
    errors_late = [t - killed_at for code, t in timings if code == 503 and t - killed_at > 5]
    assert not errors_late, errors_late  # an error comes at once, never after a hang
    wait_until(
        lambda: len(_replica_pids()) == 2 and victim not in _replica_pids(),
        120,
        "Ray Serve to replace the killed replica",
        interval=0.2,
    )
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        wait_until(
            lambda: _replicas(client, "qiao:replica_up") == [1.0, 1.0],
            60,
            "the router to see both replicas",
            interval=0.2,
        )
    assert _ask(server.base_url, [f"After {i}" for i in range(8)]) == [200] * 8


def test_autoscaling_adds_a_replica_under_a_burst_and_removes_it_when_idle(
    server: SubprocessServer, ray_address: str, tmp_path: Path
) -> None:
    server.stop()  # two cores: the scaled application alone
    scaled = _serve(
        ray_address,
        tmp_path,
        "--replicas",
        "1",
        "--ray-max-replicas",
        "2",
        "--ray-target-ongoing-requests",
        "1",
        "--ray-upscale-delay",
        "1",
        "--ray-downscale-delay",
        "2",
    )
    try:
        with httpx.Client(base_url=scaled.base_url, timeout=30) as client:
            count = lambda: len(_replicas(client, "qiao:replica_up"))  # noqa: E731
            wait_until(lambda: count() == 1, 60, "one replica to start with", interval=0.2)
            deadline = time.monotonic() + 120
            while count() < 2:
                assert time.monotonic() < deadline, "a burst did not add a replica"
                codes = _ask(scaled.base_url, [f"Burst {i}" for i in range(8)], max_tokens=64)
                assert set(codes) == {200}, codes
            wait_until(lambda: count() == 1, 120, "idleness to remove a replica", interval=0.5)
            assert _ask(scaled.base_url, ["Still there?"]) == [200]
    finally:
        scaled.stop()


def _batch_input(path: Path, count: int) -> None:
    words = ["the", "fox", "king", "river", "small", "dog", "ran", "sun", "girl", "tree"]
    lines = []
    for i in range(count):
        prompt = " ".join(words[(i * 7 + j) % len(words)] for j in range(2 + i % 5))
        body = {"model": "demo", "prompt": prompt, "max_tokens": 8 + i % 17, "temperature": 0}
        lines.append(
            json.dumps(
                {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions", "body": body}
            )
        )
    path.write_text("\n".join(lines) + "\n")


def _records(path: Path) -> list[dict[str, Any]]:
    """The output's records without what differs between runs by design (ids, times)."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for record in records:
        record.pop("id")
        record["response"].pop("request_id")
        record["response"]["body"].pop("id", None)
        record["response"]["body"].pop("created", None)
    return records


def _state_lines(state: Path) -> int:
    try:
        with sqlite3.connect(f"file:{state}?mode=ro", uri=True, timeout=1) as db:
            return int(db.execute("SELECT COUNT(*) FROM results").fetchone()[0])
    except sqlite3.OperationalError:  # not created yet
        return 0


def test_batch_over_two_actors_equals_one_process_and_resumes_a_killed_shard(
    ray_address: str, tmp_path: Path
) -> None:
    source = tmp_path / "in.jsonl"
    _batch_input(source, 60)
    command = [sys.executable, "-m", "qiao.cli", "batch", "run", str(source), "--no-progress"]
    reference = tmp_path / "reference.jsonl"
    done = subprocess.run([*command, "-o", str(reference)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]

    out = tmp_path / "out.jsonl"
    state = tmp_path / "state.sqlite"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    ray_flags = ["--ray", ray_address, "--ray-actors", "2", "--ray-chunk-lines", "3"]
    process = subprocess.Popen(
        [
            *command,
            "-o",
            str(out),
            "--state",
            str(state),
            "--keep-state",
            "--commit-interval",
            "0.05",
            *ray_flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        wait_until(
            lambda: _state_lines(state) > 0 or process.poll() is not None,
            180,
            "the first chunk to be saved",
            interval=0.05,
        )
        assert process.poll() is None, "the run ended before an actor could be killed"
        workers = subprocess.run(
            ["pgrep", "-f", "ShardWorker"], capture_output=True, text=True
        ).stdout.split()
        assert len(workers) == 2, workers
        os.kill(int(workers[0]), signal.SIGKILL)
        log, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, log[-3000:]
    assert "60 lines over 2 Ray actors" in log
    assert "actor lost, resuming with a new one" in log, log[-3000:]
    assert _state_lines(state) == 60  # each line recorded once
    got = _records(out)
    assert [r["custom_id"] for r in got] == [f"req-{i}" for i in range(60)]
    assert got == _records(reference)


def _app_replicas(version: str) -> int:
    """Running replica processes of the demo model's `version` (named in their title)."""
    out = subprocess.run(
        ["pgrep", "-f", f"ServeReplica:qiao-.*-demo-{version}:"], capture_output=True, text=True
    )
    return len(out.stdout.split())


def test_a_repository_version_runs_on_ray_and_a_new_version_replaces_it(
    ray_address: str, tmp_path: Path
) -> None:
    root = tmp_path / "repo"
    (root / "demo").mkdir(parents=True)
    (root / "demo" / "config.yaml").write_text("backend: llm\n")
    shutil.copytree(MODEL_DIR, root / "demo" / "1")
    args = [
        "--model-repository",
        str(root),
        "--model-control-mode",
        "poll",
        "--repository-poll-interval",
        "0.5",
        "--log-interval",
        "0",
        "--ray",
        ray_address,
        "--replicas",
        "2",
    ]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    server = SubprocessServer(args, tmp_path / "server.log", env=env).wait_ready(timeout=300)
    body = {"model": "demo", "prompt": "Once upon", "max_tokens": 8, "temperature": 0}
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            first = client.post("/v1/completions", json=body)
            assert first.status_code == 200, first.text
            assert _app_replicas("1") == 2
            shutil.copytree(MODEL_DIR, tmp_path / "staging")
            (tmp_path / "staging").rename(root / "demo" / "2")  # a new version: loaded, then served
            wait_until(
                lambda: _app_replicas("2") == 2 and _app_replicas("1") == 0,
                180,
                "version 2's replicas to replace version 1's",
                interval=0.5,
            )
            again = client.post("/v1/completions", json=body)
            assert again.status_code == 200, again.text
            # The same weights: the same greedy answer, from the new version's replicas.
            assert again.json()["choices"] == first.json()["choices"]
    finally:
        server.stop()
    wait_until(lambda: _app_replicas("2") == 0, 60, "the server's applications to be deleted")
