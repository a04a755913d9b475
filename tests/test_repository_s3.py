"""The remote repository against a real S3 API: moto's S3 server on a local port, read through
s3fs, configured as an operator would (fsspec's config for the endpoint, AWS variables for the
keys). Skipped where moto or s3fs is not installed (`pip install "moto[server]" s3fs`).

The memory-store tests (test_repository_remote.py) cover the rules; this one shows that S3's
listings (prefixes as folders, ETags) drive them the same way.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

import fsspec  # noqa: E402

from qiao.cli import main as qiao_main  # noqa: E402
from qiao.repository.remote import open_repository  # noqa: E402
from qiao.repository.scan import ModelEntry, VersionDir  # noqa: E402


@pytest.fixture
def s3_url(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": f"http://127.0.0.1:{port}"})
    fsspec.filesystem("s3").clear_instance_cache()
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir("models")
    try:
        yield "s3://models/prod"
    finally:
        server.stop()
        fsspec.filesystem("s3").clear_instance_cache()


class Version:
    def __init__(self, model: str, version: str, files: dict[str, bytes]) -> None:
        self.model, self.version, self.files = model, version, files

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def num_unfinished(self) -> int:
        return 0

    def is_healthy(self) -> tuple[bool, str]:
        return True, "ok"


def loader(entry: ModelEntry, vdir: VersionDir) -> Version:
    files = {p.name: p.read_bytes() for p in vdir.path.iterdir() if p.is_file()}
    return Version(entry.name, vdir.version, files)


def test_a_repository_on_s3_loads_reloads_and_is_collected(
    s3_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fs, root = fsspec.core.url_to_fs(s3_url)

    def upload(version: str, weights: bytes) -> None:
        fs.pipe(
            {
                f"{root}/embed/{version}/model.safetensors": weights,
                f"{root}/embed/{version}/config.json": b"{}",
            }
        )

    fs.pipe_file(f"{root}/embed/config.yaml", b"backend: embedding\nversion_policy: all\n")
    upload("1", b"one" * 100)
    cache_dir = tmp_path / "cache"
    repository = open_repository(s3_url, cache_dir)
    manager = repository.manager(loader, mode="poll", poll_interval=3600)

    async def scenario() -> None:
        await manager.start()
        try:
            assert manager.get("embed").files["model.safetensors"] == b"one" * 100
            upload("2", b"two" * 100)
            await manager.rescan()
            assert manager.ready_versions("embed") == ["1", "2"]
            upload("2", b"TWO" * 100)  # same size, new ETag: a new copy, a reload
            await manager.rescan()
            assert manager.get("embed", "2").files["model.safetensors"] == b"TWO" * 100
            fs.rm(f"{root}/embed/1", recursive=True)
            await manager.rescan()
            assert manager.ready_versions("embed") == ["2"]
        finally:
            await manager.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), 60))
    copies = sorted(p.parent.name for p in repository.root.glob("embed/*/*.json"))
    assert copies == ["1", "2", "2"]
    # A second start finds its copy: nothing written anew.
    (weights,) = [
        p
        for p in repository.root.glob("embed/2/*/model.safetensors")
        if p.read_bytes()[:3] == b"TWO"
    ]
    before = weights.stat()
    again = open_repository(s3_url, cache_dir)
    assert again.scan is not None and again.cache is not None
    vdir = again.scan(lambda message: None)["embed"].versions["2"]
    assert vdir.source is not None and vdir.path == weights.parent
    again.cache.acquire("embed", "2", vdir.source)
    assert weights.stat().st_mtime_ns == before.st_mtime_ns
    # gc: version 1 left the bucket, version 2's first copy was replaced.
    args = ["repository", "gc", "--repository", s3_url, "--cache-dir", str(cache_dir)]
    assert qiao_main(args) == 0
    out = capsys.readouterr().out
    assert out.count("  removed  ") == 2 and "total: removed 2 item(s)" in out
    assert sorted(p.parent.name for p in repository.root.glob("embed/*/*.json")) == ["2"]
