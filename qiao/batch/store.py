"""The server's durable store for the Files API (and, on it, the Batch API): SQLite metadata in
`DATA_DIR/qiao.sqlite`, file contents in `DATA_DIR/files/<id>`.

A file's content is written to a temporary sibling, fsynced and renamed before its row is
committed, so a listed file always has its whole content; a deleted file's row goes first, then
its content. Every file has an owner (the API key's name; "" without keys): a key sees only its
own files, as an OpenAI project sees only its own.
"""

from __future__ import annotations

import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from qiao.errors import ConfigError

SCHEMA_VERSION = "1"
FILE_PURPOSES = ("batch", "batch_output")
_CHUNK = 1 << 20


class FileTooLargeError(ConfigError):
    """An upload past the store's size limit."""


@dataclass(frozen=True)
class StoredFile:
    id: str
    owner: str
    purpose: str
    filename: str
    bytes: int
    created_at: int

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's FileObject."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": None,
        }


class Store:
    """Files (and the tables later APIs add) in one data directory. Thread-safe: one
    connection, serialized by a lock (the API calls it from worker threads)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.files_dir = data_dir / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            data_dir / "qiao.sqlite", isolation_level=None, check_same_thread=False
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
        schema = self._db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
        if schema is None:
            self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
        elif schema[0] != SCHEMA_VERSION:
            raise ConfigError(
                f"{data_dir}: written by another qiao version (schema {schema[0]}); use another "
                "--data-dir"
            )
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS files (id TEXT PRIMARY KEY, owner TEXT NOT NULL, "
            "purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL, "
            "created_at INTEGER NOT NULL, seq INTEGER NOT NULL)"
        )
        self._remove_orphans()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # --- files -------------------------------------------------------------------------------

    def add_file(
        self, owner: str, purpose: str, filename: str, source: BinaryIO, max_bytes: int
    ) -> StoredFile:
        """Store `source`'s content; FileTooLargeError past `max_bytes` (nothing is kept)."""
        if purpose not in FILE_PURPOSES:
            raise ConfigError(
                f"purpose: {purpose!r} is not supported; this server takes 'batch'",
                param="purpose",
            )
        file_id = f"file-{secrets.token_hex(12)}"
        path = self.files_dir / file_id
        temporary = path.with_name(f".{file_id}.tmp")
        size = 0
        try:
            with temporary.open("wb") as out:
                while block := source.read(_CHUNK):
                    size += len(block)
                    if size > max_bytes:
                        raise FileTooLargeError(
                            f"file: larger than this server's limit of {max_bytes} bytes "
                            "(--max-file-bytes)",
                            param="file",
                        )
                    out.write(block)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
        stored = StoredFile(file_id, owner, purpose, filename, size, int(time.time()))
        self._insert_file(stored)
        return stored

    def add_file_from_lines(
        self, owner: str, purpose: str, filename: str, lines: Iterator[str]
    ) -> StoredFile:
        """A file written by the server itself (a batch's output), one JSON line each."""
        file_id = f"file-{secrets.token_hex(12)}"
        path = self.files_dir / file_id
        temporary = path.with_name(f".{file_id}.tmp")
        try:
            with temporary.open("w", encoding="utf-8") as out:
                for line in lines:
                    out.write(line)
                    out.write("\n")
                out.flush()
                os.fsync(out.fileno())
            size = temporary.stat().st_size
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
        stored = StoredFile(file_id, owner, purpose, filename, size, int(time.time()))
        self._insert_file(stored)
        return stored

    def _insert_file(self, stored: StoredFile) -> None:
        with self._lock:
            seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM files").fetchone()[0]
            self._db.execute(
                "INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    stored.id,
                    stored.owner,
                    stored.purpose,
                    stored.filename,
                    stored.bytes,
                    stored.created_at,
                    seq,
                ),
            )

    def get_file(self, owner: str, file_id: str) -> StoredFile | None:
        with self._lock:
            row = self._db.execute(
                "SELECT id, owner, purpose, filename, bytes, created_at FROM files "
                "WHERE id = ? AND owner = ?",
                (file_id, owner),
            ).fetchone()
        return StoredFile(*row) if row else None

    def file_path(self, stored: StoredFile) -> Path:
        return self.files_dir / stored.id

    def list_files(
        self,
        owner: str,
        *,
        purpose: str | None = None,
        limit: int = 10000,
        order: str = "desc",
        after: str | None = None,
    ) -> tuple[list[StoredFile], bool]:
        """(a page of files, whether more follow) newest first (`order="desc"`) or oldest first;
        `after`: the last id of the previous page."""
        if order not in ("asc", "desc"):
            raise ConfigError(f"order: must be 'asc' or 'desc', got {order!r}", param="order")
        if not 1 <= limit <= 10000:
            raise ConfigError(f"limit: must be in 1..10000, got {limit}", param="limit")
        compare = "<" if order == "desc" else ">"
        where, args = ["owner = ?"], [owner]
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        with self._lock:
            if after is not None:
                row = self._db.execute(
                    "SELECT seq FROM files WHERE id = ? AND owner = ?", (after, owner)
                ).fetchone()
                if row is None:
                    raise ConfigError(f"after: no file {after!r}", param="after")
                where.append(f"seq {compare} ?")
                args.append(row[0])
            rows = self._db.execute(
                "SELECT id, owner, purpose, filename, bytes, created_at FROM files WHERE "
                f"{' AND '.join(where)} ORDER BY seq {order.upper()} LIMIT ?",
                (*args, limit + 1),
            ).fetchall()
        files = [StoredFile(*row) for row in rows]
        return files[:limit], len(files) > limit

    def delete_file(self, owner: str, file_id: str) -> bool:
        with self._lock:
            deleted = self._db.execute(
                "DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)
            ).rowcount
        if deleted:
            (self.files_dir / file_id).unlink(missing_ok=True)
        return bool(deleted)

    def _remove_orphans(self) -> None:
        """Contents without a row: an upload or a delete cut off by a kill."""
        known = {row[0] for row in self._db.execute("SELECT id FROM files")}
        for path in self.files_dir.iterdir():
            if path.name not in known:
                path.unlink(missing_ok=True)
