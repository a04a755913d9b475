"""`qiao serve --data-parallel-size 2`: two engine replicas of the demo model, each pinned to
its own core, behind one router. Distinct prompts spread over both; prompts sharing a long
prefix land on one; a replica SIGKILLed under load leaves no request unanswered (200, or a 503
at once) and comes back, while the other keeps serving."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .conftest import SubprocessServer, parse_metrics, wait_until

MODEL = "demo_model"

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="two replicas need two cores"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    folder = tmp_path_factory.mktemp("dp")
    args = ["--data-dir", str(folder / "data"), "--log-interval", "0", "--data-parallel-size", "2"]
    running = SubprocessServer(args, folder / "server.log").wait_ready()
    try:
        yield running
    finally:
        running.stop()


def _replica_pids(server: SubprocessServer) -> list[int]:
    out = subprocess.run(
        ["pgrep", "-P", str(server.proc.pid), "-f", "qiao.engine.engine_worker"],
        capture_output=True,
        text=True,
    ).stdout.split()
    return sorted(int(pid) for pid in out)


def _replicas(client: httpx.Client, name: str) -> list[float]:
    metrics = parse_metrics(client.get("/metrics").text)
    return [metrics.get((name, (("replica", str(i)),)), 0.0) for i in range(2)]


def _ask(base_url: str, prompts: list[str], max_tokens: int = 8) -> list[int]:
    def one(prompt: str) -> int:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        with httpx.Client(base_url=base_url, timeout=60) as client:
            return client.post("/v1/completions", json=body).status_code

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, prompts))


def test_two_pinned_replicas_share_the_work(server: SubprocessServer) -> None:
    pids = _replica_pids(server)
    assert len(pids) == 2
    cores = [os.sched_getaffinity(pid) for pid in pids]
    assert all(len(c) >= 1 for c in cores) and not cores[0] & cores[1]  # disjoint
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        before = _replicas(client, "qiao:replica_requests_routed_total")
        assert _ask(server.base_url, [f"Short question {i}" for i in range(24)]) == [200] * 24
        spread = [
            a - b
            for a, b in zip(
                _replicas(client, "qiao:replica_requests_routed_total"), before, strict=True
            )
        ]
        assert sum(spread) == 24 and min(spread) > 0, spread

        affine_before = _replicas(client, "qiao:replica_requests_routed_by_affinity_total")
        routed_before = _replicas(client, "qiao:replica_requests_routed_total")
        prefix = " ".join(["the king said to his son and the queen"] * 12)  # > 64 tokens
        assert _ask(server.base_url, [f"{prefix} question {i}" for i in range(8)]) == [200] * 8
        affine = [
            a - b
            for a, b in zip(
                _replicas(client, "qiao:replica_requests_routed_by_affinity_total"),
                affine_before,
                strict=True,
            )
        ]
        routed = [
            a - b
            for a, b in zip(
                _replicas(client, "qiao:replica_requests_routed_total"), routed_before, strict=True
            )
        ]
        assert sorted(affine) == [0, 8] and routed == affine  # all on one replica


def test_a_killed_replica_answers_its_requests_and_comes_back(server: SubprocessServer) -> None:
    victim = _replica_pids(server)[0]
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=server.base_url) as client:
        load = pool.submit(_ask, server.base_url, [f"Story {i}:" for i in range(40)], 32)
        wait_until(
            lambda: sum(_replicas(client, "qiao:replica_requests_unfinished")) > 0,
            60,
            "the load to reach the replicas",
            interval=0.02,
        )
        os.kill(victim, signal.SIGKILL)
        codes = load.result(timeout=120)
    assert set(codes) <= {200, 503}, codes
    assert codes.count(200) >= 20, codes  # the other replica kept serving
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        wait_until(
            lambda: (
                _replicas(client, "qiao:replica_engine_restarts_total")[0] >= 1
                and _replicas(client, "qiao:replica_up") == [1.0, 1.0]
            ),
            60,
            "the killed replica to come back",
        )
    pids = _replica_pids(server)
    assert len(pids) == 2 and victim not in pids
    assert _ask(server.base_url, [f"After {i}" for i in range(8)]) == [200] * 8
