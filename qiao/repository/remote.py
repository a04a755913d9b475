"""A model repository at any fsspec URL: `s3://bucket/repo`, `gs://...`, `memory://...`, or a
local folder.

`open_repository(location, cache_dir)` picks how the server reads it. A local folder (a plain
path or `file://`) is scanned by `scan.scan_repository` and versions load in place, as always.
Any other URL is listed through fsspec (models, config files, version folders, every file's
size and ETag or mtime) with the same name rules, config schema and version policy, and a
version is copied into the local cache (`cache.VersionCache`) just before it loads. Credentials
come from fsspec's usual places (the store's environment variables and config files).

Polling works as on a local folder: a version's fingerprint is the signature of its remote
listing, so a new, removed or replaced remote version, or a changed config, reloads exactly as
it would locally.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qiao.errors import ConfigError
from qiao.repository.cache import Lease, RemoteFile, RemoteVersion, VersionCache, signature
from qiao.repository.cache_gc import ServedCopies, collect_garbage
from qiao.repository.config import (
    CONFIG_FILE_NAMES,
    MAX_CONFIG_FILE_BYTES,
    LatestPolicy,
    ModelConfigFile,
    VersionPolicy,
    parse_config_bytes,
)
from qiao.repository.manager import ModelManager, RepositoryScan, Served, VersionLoader
from qiao.repository.scan import (
    MAX_FILES_PER_VERSION,
    NAME_RULE,
    VERSION_RULE,
    ModelEntry,
    VersionDir,
    Warn,
    classify_version,
    is_model_name,
    is_version_name,
    quoted,
)

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

logger = logging.getLogger("qiao.repository")

GC_INTERVAL_S = 3600.0  # the server's own cache collection, at most this often

# Listing fields that change when an object is replaced, by store: S3 (ETag, LastModified), GCS
# (generation, md5Hash, updated), Azure (etag, last_modified), memory (created), local (mtime).
_TOKEN_KEYS = (
    "ETag",
    "etag",
    "generation",
    "VersionId",
    "md5Hash",
    "LastModified",
    "last_modified",
    "updated",
    "mtime",
    "created",
)


@dataclass
class Repository:
    """The repository a server serves. `root`: the folder versions load from (the repository
    itself, or the cache root of a remote one). `scan` and `cache` are None for a local one."""

    location: str
    root: Path
    scan: RepositoryScan | None = None
    cache: VersionCache | None = None

    @property
    def is_remote(self) -> bool:
        return self.cache is not None

    def manager(self, loader: VersionLoader, **kwargs: Any) -> ModelManager:
        """The model manager over this repository (kwargs: ModelManager's)."""
        if self.cache is None:
            return ModelManager(loader, self.root, **kwargs)
        cached = CachedLoader(loader, self.cache)
        return ModelManager(cached, self.root, scan=self.scan, on_stopped=cached.release, **kwargs)


def open_repository(location: str, cache_dir: Path, *, gc_days: float | None = None) -> Repository:
    """The repository at `location` (a local path or an fsspec URL); a remote one's versions
    are copied under `cache_dir`. With `gc_days`, a scan also collects this repository's cache
    (at most once per GC_INTERVAL_S; the rules of `qiao repository gc --unused-days`). Raises
    ConfigError for a missing local folder, an unknown protocol or a store whose fsspec package
    is not installed."""
    fs, path = _filesystem(location)
    if _is_local(fs):
        root = Path(path)
        if not root.is_dir():
            raise ConfigError(f"model_repository {location} is not a directory")
        return Repository(location, root)
    cache = VersionCache(cache_dir, location)
    scan: RepositoryScan = RemoteScanner(fs, path, cache)
    if gc_days is not None:
        scan = CollectingScan(scan, cache.root, gc_days)
    return Repository(location, cache.root, scan, cache)


def _filesystem(location: str) -> tuple[AbstractFileSystem, str]:
    import fsspec

    try:
        return fsspec.core.url_to_fs(location)
    except ImportError as exc:  # e.g. s3:// without s3fs
        raise ConfigError(f"model_repository {location}: {exc}") from None
    except ValueError as exc:  # an unknown protocol
        raise ConfigError(f"model_repository {location}: {exc}") from None


def _is_local(fs: AbstractFileSystem) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


class CachedLoader:
    """A version loader that first makes (or reuses) the local copy of a remote version and
    leases it for as long as the instance built from it runs."""

    def __init__(self, inner: VersionLoader, cache: VersionCache) -> None:
        self.inner = inner
        self.cache = cache
        self._leases: dict[int, tuple[Served, Lease]] = {}
        self._lock = threading.Lock()

    def __call__(self, entry: ModelEntry, vdir: VersionDir) -> Served:
        if vdir.source is None:
            return self.inner(entry, vdir)
        lease = self.cache.acquire(entry.name, vdir.version, vdir.source)
        try:
            served = self.inner(entry, vdir)
        except BaseException:
            self.cache.release(lease)
            raise
        with self._lock:
            self._leases[id(served)] = (served, lease)
        return served

    def release(self, served: Served) -> None:
        """The manager's `on_stopped`: the instance no longer uses its copy."""
        with self._lock:
            held = self._leases.pop(id(served), None)
        if held is not None:
            self.cache.release(held[1])

    def num_leases(self) -> int:
        with self._lock:
            return len(self._leases)


class CollectingScan:
    """A scan that then removes the cached copies its result no longer serves, and those unused
    for `unused_days`, at most once per GC_INTERVAL_S (the first scan included)."""

    def __init__(self, scan: RepositoryScan, root: Path, unused_days: float) -> None:
        self.scan = scan
        self.root = root
        self.unused_days = unused_days
        self._next = 0.0

    def __call__(self, warn: Warn) -> dict[str, ModelEntry]:
        entries = self.scan(warn)
        if time.monotonic() >= self._next:
            self._next = time.monotonic() + GC_INTERVAL_S
            report = collect_garbage(
                self.root, served_versions(entries), unused_days=self.unused_days
            )
            for item in report.removed:
                logger.info(
                    "repository cache: removed %s (%s), %d bytes",
                    item.label,
                    item.reason,
                    item.size,
                )
        return entries


def served_versions(entries: dict[str, ModelEntry]) -> ServedCopies:
    """(model, version) -> the signature of the copy a scan's result serves."""
    return {
        (name, version): vdir.fingerprint
        for name, entry in entries.items()
        for version, vdir in entry.versions.items()
    }


class RemoteScanner:
    """`scan_repository` for a repository on object storage (see the module docstring)."""

    def __init__(self, fs: AbstractFileSystem, path: str, cache: VersionCache) -> None:
        self.fs = fs
        self.path = path.rstrip("/")
        self.cache = cache
        self.name = self.path.rsplit("/", 1)[-1] or self.path

    def __call__(self, warn: Warn) -> dict[str, ModelEntry]:
        """Every model of the repository, by name. A missing repository is a ConfigError, never
        an empty repository (which would unload every model)."""
        self.fs.invalidate_cache()  # listings must be fresh: polling is how changes are seen
        if not self.fs.isdir(self.path):
            raise ConfigError(f"model repository {self.name} does not exist or is not a folder")
        entries = {}
        for child in sorted(self._ls(self.path), key=lambda info: info["name"]):
            name = _basename(child["name"])
            if name.startswith(".") or child["type"] != "directory":
                continue
            if not is_model_name(name):
                warn(f"model repository: skipping {quoted(name)}: a model name is {NAME_RULE}")
                continue
            entries[name] = self._scan_model(name, warn)
        return entries

    def _ls(self, path: str) -> list[dict[str, Any]]:
        return self.fs.ls(path, detail=True)

    def _scan_model(self, name: str, warn: Warn) -> ModelEntry:
        display = f"{self.name}/{name}"
        children = self._ls(f"{self.path}/{name}")
        config: ModelConfigFile | None = None
        error = ""
        try:
            config = self._read_config(display, children)
        except ConfigError as exc:
            error = str(exc)
        policy = (
            config.version_policy if config is not None else VersionPolicy(latest=LatestPolicy())
        )
        candidates = []
        for child in children:
            version = _basename(child["name"])
            if child["type"] != "directory" or not (version.isascii() and version.isdigit()):
                continue
            if not is_version_name(version):
                warn(f"{display}: skipping version folder {version!r}: a version is {VERSION_RULE}")
                continue
            candidates.append(version)
        versions = {
            v: self._inspect_version(name, v, f"{display}/{v}", config)
            for v in policy.select(candidates)
        }
        return ModelEntry(name, self.cache.root / name, config, error, versions)

    def _read_config(self, display: str, children: list[dict[str, Any]]) -> ModelConfigFile:
        found = [
            c for c in children if c["type"] == "file" and _basename(c["name"]) in CONFIG_FILE_NAMES
        ]
        if not found:
            raise ConfigError(f"{display}: no config.yaml, config.yml or config.json")
        if len(found) > 1:
            names = " and ".join(sorted(_basename(c["name"]) for c in found))
            raise ConfigError(f"{display}: {names} both exist; keep exactly one")
        info = found[0]
        shown = f"{display}/{_basename(info['name'])}"
        if (info.get("size") or 0) > MAX_CONFIG_FILE_BYTES:
            raise ConfigError(f"{shown}: larger than {MAX_CONFIG_FILE_BYTES} bytes")
        try:
            raw = self.fs.cat_file(info["name"], start=0, end=MAX_CONFIG_FILE_BYTES + 1)
        except OSError as exc:
            raise ConfigError(f"{shown}: cannot be read ({type(exc).__name__})") from None
        return parse_config_bytes(raw, Path(info["name"]).suffix, shown)

    def _inspect_version(
        self, model: str, version: str, display: str, config: ModelConfigFile | None
    ) -> VersionDir:
        vpath = f"{self.path}/{model}/{version}"
        try:
            remote = self._list_version(vpath)
        except ConfigError as exc:
            path = self.cache.copy_path(model, version, "unlisted")
            return VersionDir(version, path, None, "", error=f"{display}: {exc}")
        sig = signature(remote.files)
        path = self.cache.copy_path(model, version, sig)
        names = [f.name for f in remote.files]
        return classify_version(display, version, path, sig, names, config, source=remote)

    def _list_version(self, vpath: str) -> RemoteVersion:
        files = []
        for name, info in sorted(self.fs.find(vpath, detail=True).items()):
            if info.get("type") != "file":
                continue
            rel = name[len(vpath) + 1 :]
            check_relative_name(rel)
            files.append(RemoteFile(rel, int(info.get("size") or 0), _token(info)))
            if len(files) > MAX_FILES_PER_VERSION:
                raise ConfigError(f"more than {MAX_FILES_PER_VERSION} files")

        def relist() -> RemoteVersion:
            self.fs.invalidate_cache(vpath)
            return self._list_version(vpath)

        return RemoteVersion(self.fs, vpath, tuple(files), relist)


def check_relative_name(rel: str) -> None:
    """A remote object's name inside a version folder must be a plain relative path: object
    stores allow keys such as `a/../../b`, which must never name a place outside the copy."""
    parts = rel.split("/")
    if any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts):
        raise ConfigError(f"file name {quoted(rel)} is not a plain relative path")


def _basename(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1]


def _token(info: dict[str, Any]) -> str:
    return "|".join(str(info[key]) for key in _TOKEN_KEYS if info.get(key) is not None)
