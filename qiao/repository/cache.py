"""Local copies of the versions of a model repository on object storage.

A remote version loads from a local copy, made once and reused while the remote files stay the
same. Layout, under `<cache_dir>/<hash of the repository URL>/` (the cache's `root`):

    repository.json                    {"url": ...}: which repository this root caches
    <model>/<version>/.lock            flock'ed while a copy is checked, made, leased or removed
    <model>/<version>/<sig>/           the copy: the version's files, as listed remotely
    <model>/<version>/<sig>.json       its manifest: the files' sizes, when it was fetched and
                                       last used; written after the copy is in place, so a
                                       copy without one is incomplete and never loads
    <model>/<version>/<sig>.lease-*    one per loaded instance: the process using the copy
    <model>/<version>/.tmp-*           a copy being made (left behind only by a crash)

`<sig>` is the signature of the remote listing (names, sizes, ETags or mtimes): a changed remote
version is a new signature, copied beside the old one, which its instance keeps using until it
stops. A copy is made in a temporary folder, checked against the listing (every file, every
size) and against a second listing (the version did not change meanwhile), then renamed into
place: a download that is interrupted never serves.

Safety rule of garbage collection: a copy with a live lease is never removed. A lease names the
process (PID, its start time, the host); it is live while that process runs (checked with
signal 0 and /proc's start time, so a reused PID does not count). A lease from another host
cannot be checked and counts as live.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import json
import logging
import os
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qiao.errors import QiaoError

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

logger = logging.getLogger("qiao.repository")

CACHE_DIR_NAME = "repository-cache"  # the cache folder's default name, under qiao's data dir
ROOT_FILE = "repository.json"
LOCK_FILE = ".lock"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
NEW_PREFIX = ".new-"  # a small file being written (write_json)
LEASE_MARK = ".lease-"
MANIFEST_SUFFIX = ".json"


class CacheError(QiaoError):
    """A remote version could not be copied completely; it is not served, and the next rescan
    tries again."""

    retry_on_rescan = True


@dataclass(frozen=True)
class RemoteFile:
    name: str  # relative POSIX path inside the version folder, checked safe
    size: int
    token: str  # ETag, generation or mtime: changes when the object is replaced


@dataclass(frozen=True)
class RemoteVersion:
    """A version folder on object storage, as one listing saw it."""

    fs: AbstractFileSystem = field(compare=False, repr=False)
    path: str  # the folder, in `fs`'s own form (no protocol)
    files: tuple[RemoteFile, ...]
    relist: Callable[[], RemoteVersion] = field(compare=False, repr=False)

    @property
    def signature(self) -> str:
        return signature(self.files)


def signature(files: Iterable[RemoteFile]) -> str:
    digest = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.name):
        digest.update(f"{f.name}\0{f.size}\0{f.token}\n".encode())
    return digest.hexdigest()[:16]


def cache_root(cache_dir: Path, url: str) -> Path:
    """The folder under `cache_dir` that holds the copies of the repository at `url`."""
    return cache_dir / hashlib.sha256(normalize_url(url).encode()).hexdigest()[:16]


def normalize_url(url: str) -> str:
    return url.rstrip("/") or url


@dataclass(frozen=True)
class Lease:
    """One loaded instance's claim on a copy; its file exists until `release`."""

    path: Path
    manifest: Path


class VersionCache:
    """The local copies of one remote repository's versions (see the module docstring)."""

    _counter = itertools.count()

    def __init__(self, cache_dir: Path, url: str) -> None:
        self.url = normalize_url(url)
        self.root = cache_root(cache_dir, url)

    def version_dir(self, model: str, version: str) -> Path:
        return self.root / model / version

    def copy_path(self, model: str, version: str, sig: str) -> Path:
        return self.version_dir(model, version) / sig

    def acquire(self, model: str, version: str, remote: RemoteVersion) -> Lease:
        """Copy `remote` (unless a complete copy of the same signature is here) and lease the
        copy for this process. Blocks while another process copies the same version."""
        sig = remote.signature
        vdir = self.version_dir(model, version)
        self._write_root_file()
        with version_lock(vdir, blocking=True):
            for stale in vdir.glob(TMP_PREFIX + "*"):
                # Under the lock no copy is being made: these are a crashed writer's.
                remove_tree(stale)
            manifest = vdir / (sig + MANIFEST_SUFFIX)
            if read_complete_manifest(vdir / sig, manifest) is None:
                self._fetch(model, version, remote, vdir)
            else:
                logger.info("%s version %s: reusing the cached copy %s", model, version, sig)
            update_manifest(manifest, last_used=time.time())
            lease = vdir / f"{sig}{LEASE_MARK}{os.getpid()}-{next(self._counter)}"
            write_json(lease, {**process_identity(), "since": time.time()})
        return Lease(lease, manifest)

    def release(self, lease: Lease) -> None:
        """The instance stopped: record the last use, then drop the lease (in that order, so gc
        never removes the copy while its manifest is being written)."""
        with contextlib.suppress(OSError):
            update_manifest(lease.manifest, last_used=time.time())
        with contextlib.suppress(FileNotFoundError):
            lease.path.unlink()

    def _fetch(self, model: str, version: str, remote: RemoteVersion, vdir: Path) -> None:
        sig = remote.signature
        final = vdir / sig
        if final.exists():  # a copy whose manifest never got written: incomplete
            remove_tree(final)
        tmp = vdir / f"{TMP_PREFIX}{sig}-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir(parents=True)
        started = time.monotonic()
        try:
            try:
                download(remote, tmp)
            except OSError as exc:  # the store's errors: connection, permission, throttling
                raise CacheError(
                    f"{model}/{version}: copy failed ({type(exc).__name__}: {exc}); it is "
                    "copied again at the next scan"
                ) from exc
            check_copy(tmp, remote)
            if remote.relist().signature != sig:
                raise CacheError(
                    f"{model}/{version} changed while it was copied; it is copied again at the "
                    "next scan"
                )
            tmp.rename(final)
        except BaseException:
            remove_tree(tmp)
            raise
        total = sum(f.size for f in remote.files)
        write_json(
            vdir / (sig + MANIFEST_SUFFIX),
            {
                "url": self.url,
                "model": model,
                "version": version,
                "signature": sig,
                "files": {f.name: f.size for f in remote.files},
                "fetched_at": time.time(),
                "last_used": time.time(),
            },
        )
        logger.info(
            "%s version %s: copied %d files (%d bytes) in %.1f s",
            model,
            version,
            len(remote.files),
            total,
            time.monotonic() - started,
        )

    def _write_root_file(self) -> None:
        path = self.root / ROOT_FILE
        if not path.exists():
            self.root.mkdir(parents=True, exist_ok=True)
            write_json(path, {"url": self.url})


def download(remote: RemoteVersion, dest: Path) -> None:
    """Every file of `remote` into `dest` (fsspec's `get`: concurrent on async stores)."""
    rpaths, lpaths = [], []
    for f in remote.files:
        local = dest.joinpath(*f.name.split("/"))
        local.parent.mkdir(parents=True, exist_ok=True)
        rpaths.append(f"{remote.path}/{f.name}")
        lpaths.append(str(local))
    if rpaths:
        remote.fs.get(rpaths, lpaths)


def check_copy(dest: Path, remote: RemoteVersion) -> None:
    """Raise CacheError unless `dest` holds every listed file at its listed size."""
    for f in remote.files:
        try:
            size = dest.joinpath(*f.name.split("/")).stat().st_size
        except FileNotFoundError:
            raise CacheError(f"incomplete copy: {f.name} is missing") from None
        if size != f.size:
            raise CacheError(
                f"incomplete copy: {f.name} has {size} bytes, the listing says {f.size}; it is "
                "copied again at the next scan"
            )


def read_complete_manifest(copy: Path, manifest: Path) -> dict[str, Any] | None:
    """The manifest of `copy` when the copy is complete (every file at its recorded size)."""
    try:
        data = json.loads(manifest.read_text())
        files = data["files"]
        for name, size in files.items():
            if copy.joinpath(*name.split("/")).stat().st_size != size:
                return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return data


def update_manifest(manifest: Path, **values: Any) -> None:
    data = json.loads(manifest.read_text())
    write_json(manifest, {**data, **values})


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write `path` atomically (a reader sees the old file or the new one, never a part)."""
    tmp = path.with_name(f"{NEW_PREFIX}{path.name}-{secrets.token_hex(4)}")
    tmp.write_text(json.dumps(data, sort_keys=True))
    os.replace(tmp, path)


def remove_tree(path: Path) -> None:
    """Remove a copy: renamed away first (atomic), so nothing sees a half-deleted folder."""
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}-{secrets.token_hex(4)}")
    try:
        path.rename(trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


@contextlib.contextmanager
def version_lock(vdir: Path, *, blocking: bool) -> Iterator[bool]:
    """Hold the version folder's lock; yields False (lock not taken) when `blocking` is False
    and another process holds it."""
    vdir.mkdir(parents=True, exist_ok=True)
    fd = os.open(vdir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the flock


# --- leases ---------------------------------------------------------------------------------


def process_identity(pid: int | None = None) -> dict[str, Any]:
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "start": process_start(pid), "host": socket.gethostname()}


def process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc), or None without /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ")".
    return stat.rsplit(")", 1)[1].split()[19]


def lease_holder(path: Path) -> int | None:
    """The PID of a live lease, or None when the lease is stale (its process is gone)."""
    try:
        data = json.loads(path.read_text())
        pid = int(data["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        # Unreadable: being written right now (write_json is atomic, so rather a foreign
        # file); count it as live, the safe side.
        return -1
    if data.get("host") != socket.gethostname():
        return pid  # another machine's process: cannot be checked
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # exists, another user's
    start = data.get("start")
    if start is not None and process_start(pid) not in (None, start):
        return None  # the PID was reused by a newer process
    return pid


# --- disk usage -----------------------------------------------------------------------------


def tree_size(path: Path) -> int:
    """Bytes of the file `path`, or of every file under the folder `path` (links not
    followed)."""
    if not path.is_dir():
        try:
            return path.lstat().st_size
        except OSError:
            return 0
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def disk_usage(root: Path) -> tuple[int, int]:
    """(bytes of every file under `root`, complete copies under it)."""
    total = tree_size(root)
    copies = 0
    for manifest in root.glob("*/*/*" + MANIFEST_SUFFIX):
        if manifest.name.startswith("."):
            continue
        copy = manifest.with_suffix("")
        if read_complete_manifest(copy, manifest) is not None:
            copies += 1
    return total, copies


class CacheUsageCollector:
    """`qiao:repository_cache_bytes` and `qiao:repository_cache_versions` of the repository
    cache root `root()` (no series while it is None: a local repository), read at scrape time.
    A Prometheus collector (prometheus_client is imported only when scraped)."""

    def __init__(self, root: Callable[[], Path | None]) -> None:
        self.root = root
        self._lock = threading.Lock()

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        root = self.root()
        if root is None:
            return
        with self._lock:
            size, copies = disk_usage(root) if root.exists() else (0, 0)
        yield GaugeMetricFamily(
            "qiao:repository_cache_bytes",
            "Bytes of the local copies of the remote model repository's versions (all files of "
            "the cache folder, copies being made included).",
            value=size,
        )
        yield GaugeMetricFamily(
            "qiao:repository_cache_versions",
            "Complete local copies of remote repository versions in the cache.",
            value=copies,
        )
