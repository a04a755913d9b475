"""Result files written atomically: the complete file appears under its final name, or nothing
does.

A target is a local path or an fsspec URL (`s3://bucket/key`, `gs://...`, `file:///...`,
`memory://...`; the protocol's package, such as s3fs or gcsfs, must be installed). Locally, and
on file systems with a rename, the lines go to a temporary sibling that is renamed over the
final name once complete (locally fsynced, the directory too). Object stores have no rename but
need none: an object becomes visible only when its upload completes, so it is written in place.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from qiao.errors import ConfigError

# Stores where an object is visible only once its upload is complete (no partial reads).
OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"})


def is_url(target: str | Path) -> bool:
    """Whether `target` names an fsspec URL rather than a local path."""
    return isinstance(target, str) and "://" in target


def local_path(target: str | Path) -> Path | None:
    """The local path of a plain path or a `file://` URL; None for other URLs."""
    if not is_url(target):
        return Path(target)
    text = str(target)
    if text.startswith("file://"):
        return Path(text.removeprefix("file://"))
    return None


def _filesystem(url: str) -> tuple[Any, str]:
    import fsspec

    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:  # unknown protocol, or its package is missing
        raise ConfigError(f"cannot write to {url}: {exc}") from exc


def target_exists(target: str | Path) -> bool:
    path = local_path(target)
    if path is not None:
        return path.exists()
    fs, where = _filesystem(str(target))
    return bool(fs.exists(where))


def sibling(target: str | Path, name: str) -> str | Path:
    """`target`'s neighbour called `name` (same directory, prefix or bucket)."""
    if not is_url(target):
        return Path(target).with_name(name)
    head, _, _ = str(target).rpartition("/")
    return f"{head}/{name}"


def target_name(target: str | Path) -> str:
    return Path(target).name if not is_url(target) else str(target).rpartition("/")[2]


def write_lines_atomically(target: str | Path, lines: Iterable[str]) -> int:
    """Write `lines` (each without its newline) to `target`; returns how many were written."""
    path = local_path(target)
    if path is not None:
        return _write_local(path, lines)
    fs, where = _filesystem(str(target))
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    if protocols & OBJECT_STORES:
        return _write(fs, where, lines)
    head, _, name = where.rpartition("/")
    temporary = f"{head}/.{name}.{os.getpid()}.tmp" if head else f".{name}.{os.getpid()}.tmp"
    try:
        count = _write(fs, temporary, lines)
        fs.mv(temporary, where)
    except BaseException:
        if fs.exists(temporary):
            fs.rm(temporary)
        raise
    return count


def _write(fs: Any, where: str, lines: Iterable[str]) -> int:
    head = where.rpartition("/")[0]
    if head:
        fs.makedirs(head, exist_ok=True)
    count = 0
    with fs.open(where, "w", encoding="utf-8") as file:
        for line in lines:
            file.write(line)
            file.write("\n")
            count += 1
    return count


def _write_local(path: Path, lines: Iterable[str]) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    count = 0
    try:
        with temporary.open("w", encoding="utf-8") as file:
            for line in lines:
                file.write(line)
                file.write("\n")
                count += 1
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a crash
    finally:
        os.close(directory)
    return count
