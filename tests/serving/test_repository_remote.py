"""`qiao serve --model-repository memory://...`: a repository on object storage, served.

The app is the one `qiao serve` builds (`build_app`), with the management listener beside it,
both on one event loop in a thread of this process: fsspec's memory store is per process. Each
encoder version is a different tiny random BERT, so a vector says which version served it.

The remote changes between two scans, as an atomic publish does: a test's uploads and removals
and the server's scans take turns (`Remote.lock`), so a poll never sees half a version.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import httpx
import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from qiao.cli import main as qiao_main
from qiao.repository.remote import RemoteScanner

from .conftest import STOP_TIMEOUT_S, parse_metrics, wait_until

TOKEN = "management-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TEXT = "hello there"
CANARY = "backend: embedding\nversion_policy: all\ntraffic: {1: 90, 2: 10}\n"


class Remote:
    """A model repository in fsspec's memory store, removed when the test ends."""

    def __init__(self) -> None:
        self.url = f"memory://qiao-serve-{uuid.uuid4().hex[:8]}/repo"
        self.fs, self.path = fsspec.core.url_to_fs(self.url)
        self.lock = threading.Lock()

    def config(self, model: str, text: str) -> None:
        with self.lock:
            self.fs.pipe_file(f"{self.path}/{model}/config.yaml", text.encode())

    def upload(self, model: str, version: str, checkpoint: Path) -> None:
        with self.lock:
            for item in sorted(checkpoint.rglob("*")):
                if item.is_file():
                    rel = item.relative_to(checkpoint).as_posix()
                    self.fs.pipe_file(f"{self.path}/{model}/{version}/{rel}", item.read_bytes())

    def remove(self, model: str, version: str) -> None:
        with self.lock:
            self.fs.rm(f"{self.path}/{model}/{version}", recursive=True)


@pytest.fixture
def remote(monkeypatch: pytest.MonkeyPatch) -> Iterator[Remote]:
    repo = Remote()
    scan = RemoteScanner.__call__

    def scan_between_changes(self: RemoteScanner, warn: Callable[[str], None]) -> Any:
        with repo.lock:
            return scan(self, warn)

    monkeypatch.setattr(RemoteScanner, "__call__", scan_between_changes)
    yield repo
    if repo.fs.exists(repo.path):
        repo.fs.rm(repo.path, recursive=True)


class RepositoryServer:
    """`build_app(settings)` and its management app, served on one event loop in a thread."""

    def __init__(self, url: str, cache_dir: Path) -> None:
        import uvicorn

        from qiao.api.management import create_management_app
        from qiao.api.server import build_app
        from qiao.api.settings import ServeSettings

        settings = ServeSettings(
            model_repository=url,
            repository_cache_dir=cache_dir,
            model_control_mode="poll",
            repository_poll_interval=0.1,
            in_process_engine=True,
            log_interval=0,
            drain_timeout=2,
        )
        self.app = build_app(settings)
        self.manager = self.app.state.router
        management = create_management_app(self.manager, token=TOKEN)
        self._sockets = [socket.socket(), socket.socket()]
        for sock in self._sockets:
            sock.bind(("127.0.0.1", 0))
        self.base_url, self.mgmt_url = (
            f"http://127.0.0.1:{s.getsockname()[1]}" for s in self._sockets
        )
        self._servers = [
            uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False))
            for app in (self.app, management)
        ]
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)
        self._thread.start()
        wait_until(
            lambda: all(s.started for s in self._servers) or not self._thread.is_alive(),
            60,
            "the server to start",
        )
        assert self._thread.is_alive(), "the server failed to start"

    async def _serve(self) -> None:
        await asyncio.gather(
            *(s.serve(sockets=[sock]) for s, sock in zip(self._servers, self._sockets, strict=True))
        )

    def index(self) -> dict[str, tuple[str, str]]:
        rows = httpx.get(self.mgmt_url + "/v1/repository", headers=AUTH).json()["models"]
        return {r["version"]: (r["state"], r["reason"]) for r in rows if r["name"] == "embed"}

    def stop(self) -> None:
        for server in self._servers:
            server.should_exit = True
        self._thread.join(STOP_TIMEOUT_S)
        for sock in self._sockets:
            sock.close()
        assert not self._thread.is_alive(), "the server did not stop"


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[[str], RepositoryServer]]:
    servers: list[RepositoryServer] = []

    def make(url: str) -> RepositoryServer:
        servers.append(RepositoryServer(url, tmp_path / "cache"))
        return servers[-1]

    yield make
    for server in servers:
        if server._thread.is_alive():
            server.stop()


@pytest.fixture
def checkpoints(tiny_bert_checkpoint: Callable[[str], Path]) -> dict[str, Path]:
    return {"1": tiny_bert_checkpoint("bert-model"), "2": tiny_bert_checkpoint("bert-mlm")}


@pytest.fixture
def reference(checkpoints: dict[str, Path]) -> dict[str, np.ndarray]:
    from qiao.runner.encoder import TorchEncoder

    out = {}
    for version, path in checkpoints.items():
        encoder = TorchEncoder(path)
        out[version] = encoder.embed(encoder.tokenize([TEXT]))[0]
    return out


def served_by(client: httpx.Client, reference: dict[str, np.ndarray], model: str = "embed") -> str:
    """The version that answered one /v1/embeddings request."""
    response = client.post("/v1/embeddings", json={"model": model, "input": TEXT})
    assert response.status_code == 200, response.text
    vector = np.array(response.json()["data"][0]["embedding"], np.float32)
    matches = [v for v, ref in reference.items() if np.allclose(vector, ref, atol=1e-4)]
    assert len(matches) == 1, matches
    return matches[0]


def disk_bytes(root: Path) -> int:
    return sum(os.lstat(os.path.join(d, n)).st_size for d, _, names in os.walk(root) for n in names)


def cache_metrics(client: httpx.Client) -> tuple[float, float]:
    metrics = parse_metrics(client.get("/metrics").text)
    return metrics[("qiao:repository_cache_bytes", ())], metrics[
        ("qiao:repository_cache_versions", ())
    ]


def test_hot_reload_canary_metric_and_gc_on_a_remote_repository(
    remote: Remote,
    checkpoints: dict[str, Path],
    reference: dict[str, np.ndarray],
    start: Callable[[str], RepositoryServer],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    remote.config("embed", CANARY)
    remote.upload("embed", "1", checkpoints["1"])
    server = start(remote.url)
    root = server.app.state.metrics.repository_cache_root
    assert root is not None and root.is_relative_to(tmp_path / "cache")
    gc = ["repository", "gc", "--repository", remote.url, "--cache-dir", str(tmp_path / "cache")]
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        assert served_by(client, reference) == "1"
        # A new version uploaded: fetched, loaded, then it takes its 10 %.
        remote.upload("embed", "2", checkpoints["2"])
        wait_until(lambda: server.index().get("2", ("",))[0] == "ready", 60, "v2 ready")
        split = Counter(served_by(client, reference) for _ in range(100))
        assert split == {"1": 90, "2": 10}
        answer = httpx.put(
            server.mgmt_url + "/v1/repository/models/embed/traffic",
            headers=AUTH,
            json={"weights": {"2": 100}},
        )
        assert answer.status_code == 200, answer.text
        assert {served_by(client, reference) for _ in range(20)} == {"2"}
        # The metric is the cache's real size: two complete copies.
        size, copies = cache_metrics(client)
        assert size == disk_bytes(root) and copies == 2
        # gc never removes what a running server uses, however old.
        assert qiao_main([*gc, "--unused-days", "0"]) == 0
        out = capsys.readouterr().out
        assert out.count("(in use by pid") == 2 and "total: removed 0 item(s)" in out
        # The old version removed remotely: unloaded; then gc removes exactly its copy.
        remote.remove("embed", "1")
        wait_until(lambda: "1" not in server.index(), 60, "v1 unloaded")
        assert qiao_main(gc) == 0
        out = capsys.readouterr().out
        assert "removed  embed/1 " in out and "total: removed 1 item(s)" in out
        assert not any((root / "embed" / "1").glob("*.json"))
        assert len(list((root / "embed" / "2").glob("*.json"))) == 1
        size, copies = cache_metrics(client)
        assert size == disk_bytes(root) and copies == 1
        # A changed config is picked up: the split comes back, nothing is copied again.
        remote.config("embed", CANARY.replace("{1: 90, 2: 10}", "{2: 100}") + "max_batch_size: 8\n")
        wait_until(
            lambda: (
                httpx.get(server.base_url + "/v2/models/embed/config").json()["max_batch_size"] == 8
            ),
            60,
            "the new config",
        )
        assert served_by(client, reference) == "2"
        assert cache_metrics(client)[1] == 1


@pytest.mark.logs_errors  # the interrupted copy is logged as the error it is
def test_a_second_start_reuses_the_cache_and_an_interrupted_copy_never_serves(
    remote: Remote,
    checkpoints: dict[str, Path],
    reference: dict[str, np.ndarray],
    start: Callable[[str], RepositoryServer],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    remote.config("embed", "backend: embedding\nversion_policy: all\n")
    remote.upload("embed", "1", checkpoints["1"])
    first = start(remote.url)
    with httpx.Client(base_url=first.base_url, timeout=30) as client:
        assert served_by(client, reference) == "1"
    first.stop()
    (weights,) = (tmp_path / "cache").glob("*/embed/1/*/model.safetensors")
    before = weights.stat()

    fetched: list[str] = []
    copy = MemoryFileSystem.get_file

    def counting(self: MemoryFileSystem, rpath: str, lpath: str, **kwargs: Any) -> None:
        fetched.append(rpath)
        copy(self, rpath, lpath, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "get_file", counting)
    second = start(remote.url)
    assert fetched == []  # nothing downloaded again
    after = weights.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)

    def interrupted(self: MemoryFileSystem, rpath: str, lpath: str, **kwargs: Any) -> None:
        if "/embed/2/" not in rpath or not rpath.endswith(".safetensors"):
            return counting(self, rpath, lpath, **kwargs)
        data = self.cat_file(rpath)
        Path(lpath).write_bytes(data[: len(data) // 2])
        raise ConnectionResetError("connection reset by peer")

    with httpx.Client(base_url=second.base_url, timeout=30) as client:
        assert served_by(client, reference) == "1"
        with monkeypatch.context() as patch:
            patch.setattr(MemoryFileSystem, "get_file", interrupted)
            remote.upload("embed", "2", checkpoints["2"])
            wait_until(lambda: "2" in second.index(), 60, "v2 in the index")
            state, reason = second.index()["2"]
            assert state == "unavailable" and "copy failed" in reason, (state, reason)
            # Version 1 serves everything; nothing of version 2 is there to load.
            assert {served_by(client, reference) for _ in range(10)} == {"1"}
            pinned = client.post("/v1/embeddings", json={"model": "embed@2", "input": TEXT})
            assert pinned.status_code == 503
            version_dir = next((tmp_path / "cache").glob("*/embed/2"))
            assert not [p for p in version_dir.iterdir() if not p.name.startswith(".")]
        # The store answers again: the next poll copies and loads it.
        wait_until(lambda: second.index()["2"][0] == "ready", 60, "v2 ready")
        assert served_by(client, reference, "embed@2") == "2"
