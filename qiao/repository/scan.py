"""Reading the model repository tree: name rules, contained paths, and the scan.

Layout (Triton's): `DIR/<model>/config.yaml|.yml|.json` and `DIR/<model>/<version>/`, a version
folder holding an HF checkpoint (config.json + *.safetensors) or an ONNX model (*.onnx).

Safety: every name taken from a request or the tree must pass `check_model_name` /
`check_version` (ASCII only, no separators, no dots-only names), and every path is resolved with
its symlinks and must stay inside the resolved repository. Links that stay inside are followed;
links that leave it are never followed, by `resolve_inside` (ConfigError) nor by
`scan_repository` (skipped with a warning).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from qiao.errors import ConfigError
from qiao.repository.config import (
    LatestPolicy,
    ModelConfigFile,
    VersionPolicy,
    find_config_file,
    read_model_config,
)

if TYPE_CHECKING:
    from qiao.repository.cache import RemoteVersion

logger = logging.getLogger("qiao.repository")

MAX_NAME_LENGTH = 128
MAX_VERSION_LENGTH = 18  # every such number fits in an int64
MAX_FILES_PER_VERSION = 10_000  # bounds the cost of one fingerprint
NAME_RULE = (
    f"1-{MAX_NAME_LENGTH} ASCII letters, digits, '.', '_' or '-', starting with a letter or digit"
)
VERSION_RULE = f"a whole number >= 1 without leading zeros, at most {MAX_VERSION_LENGTH} digits"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*", re.ASCII)
_VERSION = re.compile(r"[1-9][0-9]*", re.ASCII)

VersionKind = Literal["hf", "onnx"]
Warn = Callable[[str], None]


def is_model_name(name: str) -> bool:
    """Whether a folder named `name` may hold a model (see NAME_RULE)."""
    return len(name) <= MAX_NAME_LENGTH and _NAME.fullmatch(name) is not None


def is_version_name(name: str) -> bool:
    """Whether a folder named `name` may hold a version (see VERSION_RULE)."""
    return len(name) <= MAX_VERSION_LENGTH and _VERSION.fullmatch(name) is not None


def check_model_name(name: Any) -> str:
    """`name` if it is a valid model (or file) name; else ConfigError saying what is allowed.

    fullmatch, not match: `$` would accept a trailing newline."""
    if not isinstance(name, str) or len(name) > MAX_NAME_LENGTH or not _NAME.fullmatch(name):
        raise ConfigError(f"model name {quoted(name)} is not allowed: use {NAME_RULE}")
    return name


def check_version(version: Any) -> str:
    """The canonical version string ("3") of a version given as a str or an int.

    Leading zeros are refused, so "1" and "01" cannot name two folders of one version."""
    if isinstance(version, int) and not isinstance(version, bool):
        version = str(version)
    if (
        not isinstance(version, str)
        or len(version) > MAX_VERSION_LENGTH
        or not _VERSION.fullmatch(version)
    ):
        raise ConfigError(f"version {quoted(version)} is not allowed: use {VERSION_RULE}")
    return version


def resolve_inside(root: Path, *parts: str) -> Path:
    """`root/part/...` with every symlink resolved, checked to exist inside the resolved root.

    Each part must pass the name rules (so no "..", "/", "\\", "%", NUL or whitespace); a link
    that stays inside the repository is fine, one that leaves it is a ConfigError."""
    for part in parts:
        if not isinstance(part, str) or len(part) > MAX_NAME_LENGTH or not _NAME.fullmatch(part):
            raise ConfigError(f"path part {quoted(part)} is not allowed: use {NAME_RULE}")
    shown = "/".join(parts) or "."
    try:
        base = root.resolve(strict=True)
        target = base.joinpath(*parts).resolve(strict=True)
    except (OSError, RuntimeError):  # missing, unreadable, or a symlink loop
        raise ConfigError(f"{shown} does not exist in the model repository") from None
    if not target.is_relative_to(base):
        raise ConfigError(f"{shown} leads outside the model repository")
    return target


@dataclass(frozen=True)
class VersionDir:
    """One version folder. `error` is set (and `kind` may be None) when it cannot be served."""

    version: str
    path: Path  # resolved, inside the repository
    kind: VersionKind | None
    # Changes when the folder's files are replaced: names, sizes, mtimes and inodes, not bytes.
    fingerprint: str
    model_file: Path | None = None  # the .onnx file of an onnx version
    error: str = ""
    # A version on object storage: its remote files, copied to `path` (a local cache entry)
    # before it loads. None: `path` is the version's own folder.
    source: RemoteVersion | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ModelEntry:
    """One model folder: its config (or why there is none) and its versions per the policy."""

    name: str
    path: Path  # resolved, inside the repository
    config: ModelConfigFile | None
    error: str = ""
    versions: dict[str, VersionDir] = field(default_factory=dict)  # ascending


def scan_repository(root: Path, *, warn: Warn | None = None) -> dict[str, ModelEntry]:
    """Every model folder of the repository at `root`, by name (sorted).

    A model whose config is missing or invalid is reported with `error`, not dropped; its
    versions follow the default policy (latest 1). Names failing the rules and links leaving the
    repository are skipped and reported through `warn` (default: a logged warning; the poll loop
    may pass a deduplicating one). A missing root is a ConfigError, never an empty repository
    (which would unload every model)."""
    warn = logger.warning if warn is None else warn
    try:
        base = root.resolve(strict=True)
    except (OSError, RuntimeError):
        raise ConfigError(f"model repository {root.name or root} does not exist") from None
    if not base.is_dir():
        raise ConfigError(f"model repository {root.name or root} is not a directory")
    entries = {}
    for child in sorted(base.iterdir()):
        if child.name.startswith("."):
            continue  # .git, .DS_Store, editor files: not models, not worth a warning
        if not is_model_name(child.name):
            warn(f"model repository: skipping {quoted(child.name)}: a model name is {NAME_RULE}")
            continue
        model_dir = _contained(base, child, warn)
        if model_dir is not None and model_dir.is_dir():
            entries[child.name] = _scan_model(base, child.name, model_dir, warn)
    return entries


def _scan_model(base: Path, name: str, model_dir: Path, warn: Warn) -> ModelEntry:
    display = f"{base.name}/{name}"
    config: ModelConfigFile | None = None
    error = ""
    try:
        config = _read_config(base, name, model_dir, warn)
    except ConfigError as exc:
        error = str(exc)
    policy = config.version_policy if config is not None else VersionPolicy(latest=LatestPolicy())
    candidates = _version_dirs(base, display, model_dir, warn)
    versions = {
        v: _inspect_version(base, f"{display}/{v}", v, candidates[v], config)
        for v in policy.select(candidates)
    }
    return ModelEntry(name, model_dir, config, error, versions)


def _read_config(base: Path, name: str, model_dir: Path, warn: Warn) -> ModelConfigFile:
    display = f"{base.name}/{name}"
    path = find_config_file(model_dir, display)
    if path is None:
        raise ConfigError(f"{display}: no config.yaml, config.yml or config.json")
    if _contained(base, path, warn) is None:
        raise ConfigError(f"{display}/{path.name} links outside the repository; not followed")
    return read_model_config(path.resolve(), f"{display}/{path.name}")


def _version_dirs(base: Path, display: str, model_dir: Path, warn: Warn) -> dict[str, Path]:
    """Numeric subfolders (resolved) by canonical version; other subfolders are ignored."""
    found = {}
    for child in sorted(model_dir.iterdir()):
        if not (child.name.isascii() and child.name.isdigit()):
            continue
        if not is_version_name(child.name):
            warn(f"{display}: skipping version folder {child.name!r}: a version is {VERSION_RULE}")
            continue
        path = _contained(base, child, warn)
        if path is not None and path.is_dir():
            found[child.name] = path
    return found


def _inspect_version(
    base: Path, display: str, version: str, path: Path, config: ModelConfigFile | None
) -> VersionDir:
    try:
        files, escapes = _walk(base, path)
    except ConfigError as exc:
        return VersionDir(version, path, None, "", error=f"{display}: {exc}")
    fingerprint = _fingerprint(files)
    if escapes:
        error = f"{display}: {', '.join(escapes)} link(s) outside the repository; not followed"
        return VersionDir(version, path, None, fingerprint, error=error)
    return classify_version(display, version, path, fingerprint, files, config)


def classify_version(
    display: str,
    version: str,
    path: Path,
    fingerprint: str,
    files: Iterable[str],
    config: ModelConfigFile | None,
    **extra: Any,
) -> VersionDir:
    """The version folder at `path` whose files (relative POSIX names) are `files`: an HF
    checkpoint, an ONNX model, or an error saying what is missing. `extra`: more VersionDir
    fields (a remote version's `source`)."""
    top = [rel for rel in files if "/" not in rel]
    has_hf = "config.json" in top and any(rel.endswith(".safetensors") for rel in top)
    onnx = sorted(rel for rel in top if rel.endswith(".onnx"))
    backend = config.backend if config is not None else None

    def unservable(error: str) -> VersionDir:
        return VersionDir(version, path, None, fingerprint, error=f"{display}: {error}", **extra)

    if backend == "onnx" or (backend is None and onnx):
        if not onnx:
            return unservable("no .onnx file")
        if len(onnx) > 1 and "model.onnx" not in onnx:
            return unservable(f"several .onnx files ({', '.join(onnx)}); name one model.onnx")
        model_file = path / ("model.onnx" if "model.onnx" in onnx else onnx[0])
        return VersionDir(version, path, "onnx", fingerprint, model_file=model_file, **extra)
    dummy = config is not None and config.llm is not None and config.llm.load_format == "dummy"
    if has_hf or (dummy and "config.json" in top):
        return VersionDir(version, path, "hf", fingerprint, **extra)
    want = "config.json" if dummy else "config.json and *.safetensors"
    if backend is None:
        want += ", or a .onnx file"
    return unservable(f"no {want}")


def _walk(base: Path, path: Path) -> tuple[dict[str, tuple[int, int, int]], list[str]]:
    """Files under `path` (relative name -> size, mtime_ns, inode) and the links in it that
    leave the repository. Links inside it are stat'ed through but not descended into."""
    files: dict[str, tuple[int, int, int]] = {}
    escapes: list[str] = []
    for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
        for name in sorted(dirnames + filenames):
            entry = Path(dirpath, name)
            rel = entry.relative_to(path).as_posix()
            if entry.is_symlink() and not _link_stays_inside(base, entry):
                escapes.append(rel)
                continue
            if name not in filenames:
                continue
            try:
                st = entry.stat()
            except OSError:  # a dangling link, or removed while we looked
                continue
            files[rel] = (st.st_size, st.st_mtime_ns, st.st_ino)
            if len(files) > MAX_FILES_PER_VERSION:
                raise ConfigError(f"more than {MAX_FILES_PER_VERSION} files")
    return files, escapes


def _link_stays_inside(base: Path, link: Path) -> bool:
    try:
        return link.resolve().is_relative_to(base)
    except (OSError, RuntimeError):  # a symlink loop: nothing to follow, and nothing to serve
        return False


def _fingerprint(files: dict[str, tuple[int, int, int]]) -> str:
    digest = hashlib.sha256()
    for rel in sorted(files):
        digest.update(f"{rel}\0{files[rel]}\n".encode())
    return digest.hexdigest()[:32]


def _contained(base: Path, path: Path, warn: Warn) -> Path | None:
    """`path` resolved if it stays inside `base`; else None, with a warning."""
    try:
        target = path.resolve(strict=True)
    except (OSError, RuntimeError):
        warn(f"model repository: skipping {path.relative_to(base)}: broken link")
        return None
    if not target.is_relative_to(base):
        warn(f"model repository: skipping {path.relative_to(base)}: links outside the repository")
        return None
    return target


def quoted(value: Any) -> str:
    """A name as quoted in an error: ascii() (so NUL and look-alikes show), at most 64 chars."""
    text = ascii(value)
    return text if len(text) <= 64 else text[:60] + "...'"
