"""The model repository on object storage, without a server: fsspec's `memory://` store as the
remote, a real cache folder on disk, the real manager over a fake loader.

Checked: the remote scan follows the local scan's rules; copies are complete, atomic, reused
while the remote version is unchanged (no second download, same inode) and leased while
loaded; an interrupted download never serves and is retried; hot reload on the remote
(new, removed, replaced versions, changed configs); `qiao repository gc` removes exactly the
unused copies (and nothing with --dry-run); the cache metric is the folder's real size; a local
repository is loaded in place with no cache.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from qiao.api.metrics import ServerMetrics
from qiao.cli import main as qiao_main
from qiao.errors import ConfigError
from qiao.repository.cache import CacheError, VersionCache, disk_usage, tree_size
from qiao.repository.cache_gc import collect_garbage
from qiao.repository.manager import ModelManager
from qiao.repository.remote import CachedLoader, open_repository
from qiao.repository.scan import ModelEntry, VersionDir, scan_repository
from qiao.repository.types import TensorSpec, VersionState

ALL = "backend: embedding\nversion_policy: all\n"
READY, UNAVAILABLE = VersionState.READY, VersionState.UNAVAILABLE


def checkpoint(tag: str, size: int = 3000) -> dict[str, bytes]:
    """A minimal HF version folder; `tag` makes each version's bytes its own."""
    return {
        "config.json": json.dumps({"tag": tag}).encode(),
        "model.safetensors": (tag.encode() * size)[:size],
        "tokenizer/vocab.txt": b"a\nb\n" + tag.encode(),
    }


class Remote:
    """A repository in fsspec's memory store (process-wide), removed when the test ends."""

    def __init__(self) -> None:
        self.url = f"memory://qiao-test-{uuid.uuid4().hex[:8]}/repo"
        self.fs, self.path = fsspec.core.url_to_fs(self.url)

    def config(self, model: str, text: str) -> None:
        self.fs.pipe_file(f"{self.path}/{model}/config.yaml", text.encode())

    def add(self, model: str, version: str, files: dict[str, bytes]) -> None:
        for name, data in files.items():
            self.fs.pipe_file(f"{self.path}/{model}/{version}/{name}", data)

    def remove(self, model: str, version: str) -> None:
        self.fs.rm(f"{self.path}/{model}/{version}", recursive=True)

    def write_local(self, root: Path) -> None:
        """The same tree as a local folder (for the local-scan parity check)."""
        for name in self.fs.find(self.path):
            target = root / name[len(self.path) + 1 :]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(self.fs.cat_file(name))

    def cleanup(self) -> None:
        if self.fs.exists(self.path):
            self.fs.rm(self.path, recursive=True)


@pytest.fixture
def remote() -> Iterator[Remote]:
    repo = Remote()
    yield repo
    repo.cleanup()


@pytest.fixture
def downloads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every remote file copied (fsspec's get_file of the memory store), in order."""
    calls: list[str] = []
    real = MemoryFileSystem.get_file

    def counting(self: MemoryFileSystem, rpath: str, lpath: str, **kwargs: Any) -> None:
        calls.append(rpath)
        real(self, rpath, lpath, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "get_file", counting)
    return calls


def interrupt_downloads(monkeypatch: pytest.MonkeyPatch, match: str) -> list[str]:
    """From now on, copying a remote file whose name contains `match` writes half of it and
    fails as a dropped connection does. Returns the interrupted names."""
    interrupted: list[str] = []
    real = MemoryFileSystem.get_file

    def failing(self: MemoryFileSystem, rpath: str, lpath: str, **kwargs: Any) -> None:
        if match not in rpath:
            return real(self, rpath, lpath, **kwargs)
        interrupted.append(rpath)
        data = self.cat_file(rpath)
        Path(lpath).write_bytes(data[: len(data) // 2])
        raise ConnectionResetError("connection reset by peer")

    monkeypatch.setattr(MemoryFileSystem, "get_file", failing)
    return interrupted


def scan(url: str, cache_dir: Path) -> dict[str, ModelEntry]:
    repository = open_repository(url, cache_dir)
    assert repository.scan is not None
    return repository.scan(lambda message: None)


def files_of(path: Path) -> dict[str, bytes]:
    return {
        p.relative_to(path).as_posix(): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


# --- the scan --------------------------------------------------------------------------------


def test_remote_scan_follows_the_local_rules(remote: Remote, tmp_path: Path) -> None:
    remote.config("embed", "backend: embedding\nversion_policy: {latest: {num_versions: 2}}\n")
    for version in ("1", "2", "3"):
        remote.add("embed", version, checkpoint(f"embed-{version}"))
    remote.add("embed", "01", checkpoint("leading zero"))  # skipped: not a version
    remote.add("embed", "4", {"notes.txt": b"no weights"})  # selected? no: latest 2 of 1-4
    remote.config("onnx", "backend: onnx\n")
    remote.add("onnx", "1", {"model.onnx": b"graph", "tokenizer.json": b"{}"})
    remote.add("noconfig", "1", checkpoint("x"))
    remote.config("broken", "backend: embedding\nmax_batch_size: '8'\n")
    remote.add("bad name", "1", checkpoint("x"))
    remote.add(".hidden", "1", checkpoint("x"))
    local = tmp_path / "repo"
    remote.write_local(local)

    warnings: list[str] = []
    repository = open_repository(remote.url, tmp_path / "cache")
    assert repository.is_remote and repository.scan is not None
    entries = repository.scan(warnings.append)
    expected = scan_repository(local, warn=lambda message: None)

    assert sorted(entries) == sorted(expected) == ["broken", "embed", "noconfig", "onnx"]
    for name, entry in entries.items():
        assert entry.error == expected[name].error
        assert entry.config == expected[name].config
        got = {v: (d.kind, d.error) for v, d in entry.versions.items()}
        assert got == {v: (d.kind, d.error) for v, d in expected[name].versions.items()}
    assert list(entries["embed"].versions) == ["3", "4"]
    assert entries["embed"].versions["4"].error == "repo/embed/4: no config.json and *.safetensors"
    assert entries["onnx"].versions["1"].model_file.name == "model.onnx"
    assert any("'bad name'" in w for w in warnings) and any("'01'" in w for w in warnings)
    # A version loads from its place in the cache, named by the signature of its listing.
    v3 = entries["embed"].versions["3"]
    assert v3.source is not None
    assert v3.path == repository.root / "embed" / "3" / v3.fingerprint
    assert sorted(f.name for f in v3.source.files) == sorted(checkpoint("x"))


def test_the_fingerprint_changes_only_when_remote_files_do(remote: Remote, tmp_path: Path) -> None:
    remote.config("embed", ALL)
    remote.add("embed", "1", checkpoint("a"))
    remote.add("embed", "2", checkpoint("b"))
    before = {v: d.fingerprint for v, d in scan(remote.url, tmp_path)["embed"].versions.items()}
    assert before == {
        v: d.fingerprint for v, d in scan(remote.url, tmp_path)["embed"].versions.items()
    }
    remote.add("embed", "2", {"model.safetensors": b"replaced"})
    after = {v: d.fingerprint for v, d in scan(remote.url, tmp_path)["embed"].versions.items()}
    assert after["1"] == before["1"] and after["2"] != before["2"]


def test_a_missing_repository_is_an_error_not_an_empty_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        scan(f"memory://qiao-test-{uuid.uuid4().hex[:8]}/none", tmp_path)
    with pytest.raises(ConfigError, match="not a directory"):
        open_repository(str(tmp_path / "none"), tmp_path)
    with pytest.raises(ConfigError, match="model_repository nosuchproto://x"):
        open_repository("nosuchproto://x/repo", tmp_path)


def test_remote_names_that_would_leave_the_copy_are_refused(remote: Remote, tmp_path: Path) -> None:
    remote.config("embed", ALL)
    remote.add("embed", "1", {**checkpoint("a"), "sub/../../../escape": b"x"})
    vdir = scan(remote.url, tmp_path)["embed"].versions["1"]
    assert "not a plain relative path" in vdir.error and vdir.kind is None


# --- copies ----------------------------------------------------------------------------------


def test_a_copy_is_complete_and_reused_while_the_remote_is_unchanged(
    remote: Remote, tmp_path: Path, downloads: list[str]
) -> None:
    remote.config("embed", ALL)
    remote.add("embed", "1", checkpoint("a"))
    cache_dir = tmp_path / "cache"
    vdir = scan(remote.url, cache_dir)["embed"].versions["1"]
    assert vdir.source is not None
    cache = VersionCache(cache_dir, remote.url)

    lease = cache.acquire("embed", "1", vdir.source)
    assert files_of(vdir.path) == checkpoint("a")
    assert len(downloads) == 3
    manifest = json.loads((vdir.path.parent / f"{vdir.fingerprint}.json").read_text())
    assert manifest["url"] == remote.url and manifest["files"]["model.safetensors"] == 3000
    assert lease.path.exists()
    cache.release(lease)
    assert not lease.path.exists()
    stat = (vdir.path / "model.safetensors").stat()

    # A second server (a new cache object, a new scan) reuses the copy: nothing is fetched.
    again = scan(remote.url, cache_dir)["embed"].versions["1"]
    assert again.path == vdir.path and again.source is not None
    VersionCache(cache_dir, remote.url).acquire("embed", "1", again.source)
    assert len(downloads) == 3
    same = (vdir.path / "model.safetensors").stat()
    assert (same.st_ino, same.st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)
    used = json.loads((vdir.path.parent / f"{vdir.fingerprint}.json").read_text())["last_used"]
    assert used >= manifest["last_used"]

    # Replaced remotely: a new copy beside the old one, which stays for whoever still uses it.
    remote.add("embed", "1", {"model.safetensors": b"new weights"})
    new = scan(remote.url, cache_dir)["embed"].versions["1"]
    assert new.source is not None and new.path != vdir.path
    cache.acquire("embed", "1", new.source)
    assert (new.path / "model.safetensors").read_bytes() == b"new weights"
    assert vdir.path.is_dir()
    assert len(downloads) == 6


def test_an_interrupted_download_leaves_nothing_that_loads(
    remote: Remote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    remote.config("embed", ALL)
    remote.add("embed", "1", checkpoint("a"))
    cache_dir = tmp_path / "cache"
    vdir = scan(remote.url, cache_dir)["embed"].versions["1"]
    assert vdir.source is not None
    cache = VersionCache(cache_dir, remote.url)
    with monkeypatch.context() as patch:
        interrupted = interrupt_downloads(patch, "model.safetensors")
        with pytest.raises(CacheError, match=r"copy failed .*ConnectionResetError"):
            cache.acquire("embed", "1", vdir.source)
    assert interrupted
    assert sorted(p.name for p in vdir.path.parent.iterdir()) == [".lock"]

    # A crash mid-copy leaves its temporary folder: never loaded, cleared by the next copy.
    crashed = vdir.path.parent / f".tmp-{vdir.fingerprint}-999999-dead"
    crashed.mkdir()
    (crashed / "model.safetensors").write_bytes(b"half")
    cache.acquire("embed", "1", vdir.source)
    assert files_of(vdir.path) == checkpoint("a")
    assert not crashed.exists()


def test_a_version_changed_while_copied_is_refused(remote: Remote, tmp_path: Path) -> None:
    remote.config("embed", ALL)
    remote.add("embed", "1", checkpoint("a"))
    cache = VersionCache(tmp_path / "cache", remote.url)
    listed = scan(remote.url, tmp_path / "cache")["embed"].versions["1"].source
    assert listed is not None
    # Replaced after the listing, with another size: the copy does not match the listing.
    remote.add("embed", "1", {"model.safetensors": b"short"})
    with pytest.raises(CacheError, match=r"model\.safetensors has 5 bytes, the listing says 3000"):
        cache.acquire("embed", "1", listed)
    # Replaced with the same size: the second listing tells.
    listed = scan(remote.url, tmp_path / "cache")["embed"].versions["1"].source
    assert listed is not None
    remote.add("embed", "1", {"model.safetensors": b"SHORT"})
    with pytest.raises(CacheError, match="changed while it was copied"):
        cache.acquire("embed", "1", listed)
    assert not any(p.is_dir() for p in cache.version_dir("embed", "1").iterdir())


# --- the manager over a remote repository ------------------------------------------------------


class FakeVersion:
    backend = "embedding"
    platform = "fake"
    inputs = (TensorSpec("x", "FP32", (-1,)),)
    outputs = (TensorSpec("y", "FP32", (-1,)),)

    def __init__(self, model: str, version: str, files: dict[str, bytes]) -> None:
        self.model, self.version, self.files = model, version, files
        self.stopped = False

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        self.stopped = True

    def num_unfinished(self) -> int:
        return 0

    def is_healthy(self) -> tuple[bool, str]:
        return True, "ok"

    async def infer(self, inputs: dict[str, np.ndarray], **_: Any) -> dict[str, np.ndarray]:
        return {"y": np.zeros(1, np.float32)}


def fake_loader(entry: ModelEntry, vdir: VersionDir) -> FakeVersion:
    """Reads the version's files where the manager says they are, as a real loader does."""
    return FakeVersion(entry.name, vdir.version, files_of(vdir.path))


def run(coro: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(coro(), 30))


def leases(cache_root: Path) -> list[str]:
    return sorted(p.parent.name for p in cache_root.glob("*/*/*.lease-*"))


def test_hot_reload_and_canary_on_a_remote_repository(
    remote: Remote, tmp_path: Path, downloads: list[str]
) -> None:
    remote.config("embed", ALL + "traffic: {1: 90, 2: 10}\n")
    remote.add("embed", "1", checkpoint("v1"))
    repository = open_repository(remote.url, tmp_path / "cache")
    manager = repository.manager(fake_loader, mode="poll", poll_interval=3600)
    root = repository.root

    async def scenario() -> None:
        await manager.start()
        try:
            assert manager.ready_versions("embed") == ["1"]
            assert manager.get("embed").files == checkpoint("v1")
            assert leases(root) == ["1"]
            # A new version uploaded: copied, loaded, and it takes its 10 %.
            remote.add("embed", "2", checkpoint("v2"))
            await manager.rescan()
            assert manager.ready_versions("embed") == ["1", "2"]
            picks = [manager.get("embed").version for _ in range(100)]
            assert (picks.count("1"), picks.count("2")) == (90, 10)
            assert manager.get("embed", "2").files == checkpoint("v2")
            assert leases(root) == ["1", "2"]
            # A changed config reloads both versions from their copies: nothing is fetched.
            fetched = len(downloads)
            remote.config("embed", ALL + "max_batch_size: 8\ntraffic: {1: 90, 2: 10}\n")
            old = manager.get("embed", "1")
            await manager.rescan()
            assert old.stopped and manager.get("embed", "1") is not old
            assert len(downloads) == fetched
            assert leases(root) == ["1", "2"]
            # The old version removed remotely: unloaded, its lease released, its copy kept.
            remote.remove("embed", "1")
            await manager.rescan()
            assert manager.ready_versions("embed") == ["2"]
            assert leases(root) == ["2"]
            assert len(list(root.glob("embed/1/*.json"))) == 1
        finally:
            await manager.shutdown()
        assert leases(root) == []

    run(scenario)


def test_a_failed_copy_is_unavailable_then_retried_at_the_next_scan(
    remote: Remote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    remote.config("embed", ALL)
    remote.add("embed", "1", checkpoint("v1"))
    remote.add("embed", "2", checkpoint("v2"))
    repository = open_repository(remote.url, tmp_path / "cache")
    manager = repository.manager(fake_loader, mode="poll", poll_interval=3600)

    async def scenario() -> None:
        with monkeypatch.context() as patch:
            interrupt_downloads(patch, "/embed/2/model.safetensors")
            await manager.start()
        try:
            states = {row.version: (row.state, row.reason) for row in manager.index()}
            assert states["1"] == (READY, "")
            assert states["2"][0] is UNAVAILABLE and "copy failed" in states["2"][1]
            assert manager.ready_versions("embed") == ["1"]
            await manager.rescan()  # the store answers again: copied and loaded
            assert manager.ready_versions("embed") == ["1", "2"]
            assert manager.get("embed", "2").files == checkpoint("v2")
        finally:
            await manager.shutdown()

    run(scenario)


async def serve_once(manager: ModelManager) -> None:
    await manager.start()
    try:
        assert manager.get("embed").files == checkpoint("a")
    finally:
        await manager.shutdown()


def test_a_local_repository_loads_in_place_without_a_cache(tmp_path: Path) -> None:
    local = tmp_path / "repo"
    (local / "embed" / "1").mkdir(parents=True)
    (local / "embed" / "config.yaml").write_text(ALL)
    for name, data in checkpoint("a").items():
        (local / "embed" / "1" / name).parent.mkdir(parents=True, exist_ok=True)
        (local / "embed" / "1" / name).write_bytes(data)
    cache_dir = tmp_path / "cache"
    for location in (str(local), f"file://{local}"):
        repository = open_repository(location, cache_dir)
        assert not repository.is_remote and repository.root == local
        manager = repository.manager(fake_loader)
        assert not isinstance(manager.loader, CachedLoader)
        run(lambda manager=manager: serve_once(manager))
        assert manager.root == local.resolve()
    assert not cache_dir.exists()


# --- garbage collection ----------------------------------------------------------------------


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture
def populated(remote: Remote, tmp_path: Path) -> tuple[Remote, Path, dict[str, Path]]:
    """A cache with one copy of each kind gc tells apart (see the test)."""
    cache_dir = tmp_path / "cache"
    remote.config("embed", ALL)
    remote.config("latest", "backend: embedding\n")  # latest 1
    for model, version in (("embed", "1"), ("embed", "2"), ("embed", "3"), ("latest", "1")):
        remote.add(model, version, checkpoint(f"{model}-{version}"))
    cache = VersionCache(cache_dir, remote.url)

    def copy(model: str, version: str) -> tuple[Path, Any]:
        vdir = scan(remote.url, cache_dir)[model].versions[version]
        assert vdir.source is not None
        return vdir.path, cache.acquire(model, version, vdir.source)

    paths: dict[str, Path] = {}
    paths["in use"], _ = copy("embed", "1")  # this process keeps its lease
    paths["served"], lease = copy("embed", "2")
    cache.release(lease)
    paths["replaced"], lease = copy("embed", "3")
    cache.release(lease)
    remote.add("embed", "3", {"model.safetensors": b"new"})
    paths["served 3"], lease = copy("embed", "3")
    cache.release(lease)
    paths["outside policy"], lease = copy("latest", "1")
    cache.release(lease)
    remote.add("latest", "2", checkpoint("latest-2"))
    # A version removed from the repository, its copy leased by a process that died.
    remote.add("embed", "9", checkpoint("embed-9"))
    paths["gone"], lease = copy("embed", "9")
    data = json.loads(lease.path.read_text())
    lease.path.write_text(json.dumps({**data, "pid": dead_pid()}))
    remote.remove("embed", "9")
    # An interrupted download of a crashed process.
    crashed = paths["served"].parent / ".tmp-abc-999999-dead"
    crashed.mkdir()
    (crashed / "model.safetensors").write_bytes(b"x" * 100)
    paths["interrupted"] = crashed
    return remote, cache_dir, paths


def test_gc_removes_exactly_the_copies_no_longer_served(
    populated: tuple[Remote, Path, dict[str, Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    remote, cache_dir, paths = populated
    doomed = ("replaced", "outside policy", "gone", "interrupted")
    sizes = {k: tree_size(p) + tree_size(p.with_name(p.name + ".json")) for k, p in paths.items()}
    args = ["repository", "gc", "--repository", remote.url, "--cache-dir", str(cache_dir)]
    before = {p: files_of(p) for p in paths.values()}

    assert qiao_main([*args, "--dry-run"]) == 0
    dry = capsys.readouterr().out
    assert {p: files_of(p) for p in paths.values()} == before  # nothing removed
    assert dry.count("would remove") == len(doomed) + 1  # the total line too

    assert qiao_main(args) == 0
    out = capsys.readouterr().out
    assert out.replace("removed", "would remove") == dry
    for key, path in paths.items():
        assert path.exists() == (key not in doomed), key
    total = sum(sizes[k] for k in doomed)
    assert f"total: removed 4 item(s), {total / 1024:.1f} KiB ({total} bytes)" in out
    assert "(in use by pid" in out and "(replaced: the remote version changed)" in out
    assert "(no longer served (gone from the repository or outside its version_policy))" in out
    assert "(interrupted download)" in out
    assert not list(paths["gone"].parent.glob("*.lease-*"))  # the dead process's lease too
    # What is left is served or in use: a second run removes nothing.
    assert qiao_main(args) == 0
    assert "total: removed 0 item(s)" in capsys.readouterr().out


def test_gc_by_age_never_removes_a_copy_in_use(
    populated: tuple[Remote, Path, dict[str, Path]],
) -> None:
    _, _, paths = populated
    root = paths["served"].parents[2]
    later = time.time() + 8 * 86400
    report = collect_garbage(root, None, unused_days=7, now=later, dry_run=True)
    removed = {r.label.split()[0] + " " + r.reason for r in report.removed}
    assert "embed/2 unused for 7 days" in removed
    assert not any(r.label.startswith("embed/1 ") for r in report.removed)  # leased
    # Without a listing, served copies used recently stay.
    report = collect_garbage(root, None, unused_days=7, dry_run=True)
    assert {r.reason for r in report.removed} == {"interrupted download"}


def test_gc_skips_a_version_being_copied(populated: tuple[Remote, Path, dict[str, Path]]) -> None:
    from qiao.repository.cache import version_lock

    _, _, paths = populated
    root = paths["gone"].parents[2]
    with version_lock(paths["gone"].parent, blocking=True):
        report = collect_garbage(root, {}, dry_run=False)
    assert ("embed/9", "busy: a server is copying it") in report.kept
    assert paths["gone"].exists()


def test_gc_of_every_cached_repository_and_an_unlistable_one(
    populated: tuple[Remote, Path, dict[str, Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    remote, cache_dir, paths = populated
    remote.cleanup()  # the repository is gone: gc must not take that as "serves nothing"
    assert qiao_main(["repository", "gc", "--cache-dir", str(cache_dir)]) == 1
    captured = capsys.readouterr()
    assert f"cannot list {remote.url}" in captured.err
    assert [k for k, p in paths.items() if not p.exists()] == ["interrupted"]


def test_a_server_collects_its_own_cache_after_a_scan(
    populated: tuple[Remote, Path, dict[str, Path]],
) -> None:
    remote, cache_dir, paths = populated
    repository = open_repository(remote.url, cache_dir, gc_days=30)
    assert repository.scan is not None
    entries = repository.scan(lambda message: None)
    assert sorted(entries) == ["embed", "latest"]
    gone = [k for k, p in paths.items() if not p.exists()]
    assert sorted(gone) == ["gone", "interrupted", "outside policy", "replaced"]
    # Once per interval: a copy left behind now stays until the next collection.
    crashed = paths["served"].parent / ".tmp-def-999999-dead"
    crashed.mkdir()
    repository.scan(lambda message: None)
    assert crashed.exists()


# --- the metric ------------------------------------------------------------------------------


def test_the_cache_metric_is_the_folders_real_size(
    populated: tuple[Remote, Path, dict[str, Path]],
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    _, _, paths = populated
    root = paths["served"].parents[2]
    metrics = ServerMetrics(lambda: [])
    text = metrics.render().decode()
    assert "qiao:repository_cache_bytes" not in text  # a local repository: no series
    metrics.repository_cache_root = root
    values = {
        s.name: s.value
        for f in text_string_to_metric_families(metrics.render().decode())
        for s in f.samples
    }
    on_disk = sum(
        os.lstat(os.path.join(d, n)).st_size for d, _, names in os.walk(root) for n in names
    )
    assert values["qiao:repository_cache_bytes"] == on_disk == disk_usage(root)[0]
    # Complete copies: embed 1, 2, 3 (twice), 9 and latest 1.
    assert values["qiao:repository_cache_versions"] == 6
