"""Result files written atomically: the complete file appears under its final name, or nothing
does (a temporary sibling, fsynced, then renamed over it)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def write_lines_atomically(path: Path, lines: Iterable[str]) -> int:
    """Write `lines` (each without its newline) to `path`; returns how many were written."""
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
