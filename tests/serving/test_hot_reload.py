"""Hot reload and canary on a polled repository, under continuous load, with `qiao serve`.

Encoders are tiny random BERTs, each version a different checkpoint, so the vectors a request
gets back say which version served it.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from .conftest import SubprocessServer, wait_until
from .test_repository_serving import TOKEN, free_port

AUTH = {"Authorization": f"Bearer {TOKEN}"}
TEXT = "hello there"


def start(root: Path, log: Path, *extra: str) -> tuple[SubprocessServer, str]:
    mgmt_port = free_port()
    server = SubprocessServer(
        [
            "--model-repository",
            str(root),
            "--model-control-mode",
            "poll",
            "--repository-poll-interval",
            "0.2",
            "--management-port",
            str(mgmt_port),
            "--management-token",
            TOKEN,
            "--log-interval",
            "0",
            "--drain-timeout",
            "2",
            *extra,
        ],
        log,
    )
    return server.wait_ready(), f"http://127.0.0.1:{mgmt_port}"


def index(mgmt: str) -> dict[str, tuple[str, str]]:
    rows = httpx.get(mgmt + "/v1/repository", headers=AUTH).json()["models"]
    return {r["version"]: (r["state"], r["reason"]) for r in rows if r["name"] == "embed"}


def add_version(root: Path, version: str, checkpoint: Path) -> None:
    # Written beside the repository and moved in, so a poll never sees a half-copied folder.
    staging = root.parent / f"staging-{version}"
    shutil.copytree(checkpoint, staging)
    staging.rename(root / "embed" / version)


@pytest.fixture
def checkpoints(tiny_bert_checkpoint: Callable[[str], Path]) -> dict[str, Path]:
    return {"1": tiny_bert_checkpoint("bert-model"), "2": tiny_bert_checkpoint("bert-mlm")}


@pytest.fixture
def reference(checkpoints: dict[str, Path]) -> dict[str, np.ndarray]:
    """Each version's vector for TEXT, from qiao's encoder on the checkpoint directly."""
    from qiao.runner.encoder import TorchEncoder

    out = {}
    for version, path in checkpoints.items():
        encoder = TorchEncoder(path)
        out[version] = encoder.embed(encoder.tokenize([TEXT]))[0]
    return out


class Load:
    """8 closed-loop clients sending TEXT until stopped; every answer is classified by version."""

    def __init__(self, base_url: str, reference: dict[str, np.ndarray]) -> None:
        self.base_url = base_url
        self.reference = reference
        self.served: Counter[str] = Counter()
        self.sent_at: list[tuple[float, str]] = []  # (monotonic send time, version) per answer
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client) for _ in range(8)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def _client(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=30) as client:
            while not self._stop.is_set():
                sent = time.monotonic()
                response = client.post("/v1/embeddings", json={"model": "embed", "input": TEXT})
                with self._lock:
                    if response.status_code != 200:
                        self.failures.append(f"{response.status_code} {response.text[:200]}")
                        continue
                    vector = np.array(response.json()["data"][0]["embedding"], np.float32)
                    version = next(
                        (
                            v
                            for v, ref in self.reference.items()
                            if np.allclose(vector, ref, atol=1e-4)
                        ),
                        "unknown",
                    )
                    self.served[version] += 1
                    self.sent_at.append((sent, version))

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter(self.served)

    def sent_since(self, start: float) -> Counter[str]:
        """Versions that answered the requests sent at or after `start` (time.monotonic)."""
        with self._lock:
            return Counter(version for sent, version in self.sent_at if sent >= start)

    def wait_for(self, more: int, version: str, timeout: float = 30.0) -> None:
        """Wait until `more` further requests were served by `version`."""
        target = self.snapshot()[version] + more
        wait_until(lambda: self.snapshot()[version] >= target, timeout, f"{more} on v{version}")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "embed").mkdir(parents=True)
    (root / "embed" / "config.yaml").write_text(
        "backend: embedding\nversion_policy: all\ntraffic: {1: 90, 2: 10}\n"
    )
    return root


def test_hot_reload_under_load_loses_no_request(
    repo: Path, checkpoints: dict[str, Path], reference: dict[str, np.ndarray], tmp_path: Path
) -> None:
    add_version(repo, "1", checkpoints["1"])
    server, mgmt = start(repo, tmp_path / "server.log")
    try:
        with Load(server.base_url, reference) as load:
            load.wait_for(20, "1")
            # Version 2 appears: loaded and ready first, then 10 % of the traffic.
            add_version(repo, "2", checkpoints["2"])
            wait_until(lambda: index(mgmt).get("2", ("",))[0] == "ready", 60, "v2 ready")
            before = load.snapshot()
            load.wait_for(10, "2")
            share = load.snapshot() - before
            assert share["2"] / (share["1"] + share["2"]) < 0.3, share
            # All traffic to version 2.
            answer = httpx.put(
                mgmt + "/v1/repository/models/embed/traffic",
                headers=AUTH,
                json={"weights": {"2": 100}},
            )
            assert answer.status_code == 200, answer.text
            # Every request sent once the change is answered goes to version 2 (requests in
            # flight on version 1 before it still finish there, however long that takes).
            changed = time.monotonic()
            load.wait_for(50, "2")
            assert load.sent_since(changed)["1"] == 0
            # Version 1 leaves the repository: unloaded once its requests are done.
            shutil.rmtree(repo / "embed" / "1")
            wait_until(lambda: "1" not in index(mgmt), 60, "v1 unloaded")
            # A broken version 3 is reported with its error; version 2 keeps serving.
            (repo / "embed" / "3").mkdir()
            (repo / "embed" / "3" / "config.json").write_text("{}")
            wait_until(lambda: "3" in index(mgmt), 30, "v3 in the index")
            state, reason = index(mgmt)["3"]
            assert state == "unavailable" and reason, (state, reason)
            load.wait_for(20, "2")
        assert not load.failures, load.failures[:5]
        assert load.served["unknown"] == 0
        assert index(mgmt)["2"][0] == "ready"
    finally:
        server.stop()
    assert "Traceback" not in server.log(), server.log()[-3000:]


def test_canary_weights_split_requests_and_show_in_metrics(
    repo: Path, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    add_version(repo, "1", checkpoints["1"])
    add_version(repo, "2", checkpoints["2"])
    server, _ = start(repo, tmp_path / "server.log")
    try:
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            for _ in range(1000):
                response = client.post("/v1/embeddings", json={"model": "embed", "input": TEXT})
                assert response.status_code == 200
            after_text = client.get("/metrics").text
            # Sticky per user: one user always lands on one version.
            vectors = {
                tuple(
                    client.post(
                        "/v1/embeddings", json={"model": "embed", "input": TEXT, "user": "ada"}
                    ).json()["data"][0]["embedding"]
                )
                for _ in range(20)
            }
            assert len(vectors) == 1
        counts = _per_version(after_text, "qiao:infer_requests_total")
        total = counts["1"] + counts["2"]
        assert total >= 1000
        assert abs(counts["2"] / total - 0.10) <= 0.03, counts
        assert abs(counts["1"] / total - 0.90) <= 0.03, counts
        # The batch-size histogram is per version too.
        assert set(_per_version(after_text, "qiao:batch_size_count")) == {"1", "2"}
    finally:
        server.stop()


def _per_version(text: str, name: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("model_name") == "embed":
                out[sample.labels["version"]] = sample.value
    return out


def test_explicit_mode_loads_what_is_asked_and_never_leaves_the_repository(
    repo: Path, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    add_version(repo, "1", checkpoints["1"])
    # A model folder outside the repository, linked in: valid, but never to be followed.
    outside = tmp_path / "outside"
    shutil.copytree(repo / "embed", outside / "evil")
    (repo / "evil").symlink_to(outside / "evil", target_is_directory=True)
    server, mgmt = start(repo, tmp_path / "server.log", "--model-control-mode", "explicit")
    try:
        assert index(mgmt) == {}  # explicit: nothing loaded without being asked
        assert (
            httpx.post(
                server.base_url + "/v1/embeddings", json={"model": "embed", "input": "x"}
            ).status_code
            == 404
        )
        answer = httpx.post(mgmt + "/v1/repository/models/embed/load", headers=AUTH, timeout=60)
        assert answer.status_code == 200, answer.text
        assert index(mgmt) == {"1": ("ready", "")}
        for name in ["evil", "..", "..%2F..%2Fetc", "%2e%2e", "embed%00", "/etc/passwd", "a b"]:
            answer = httpx.post(f"{mgmt}/v1/repository/models/{name}/load", headers=AUTH)
            assert 400 <= answer.status_code < 500, (name, answer.status_code)
        names = {
            r["name"] for r in httpx.get(mgmt + "/v1/repository", headers=AUTH).json()["models"]
        }
        assert names == {"embed"}
        answer = httpx.post(mgmt + "/v1/repository/models/embed/unload", headers=AUTH, timeout=60)
        assert answer.status_code == 200, answer.text
        assert index(mgmt) == {}
        gone = httpx.post(server.base_url + "/v1/embeddings", json={"model": "embed", "input": "x"})
        assert gone.status_code == 404
    finally:
        server.stop()
    assert "Traceback" not in server.log(), server.log()[-3000:]
