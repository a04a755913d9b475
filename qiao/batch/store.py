"""The server's durable store for the Files API (and, on it, the Batch API): SQLite metadata in
`DATA_DIR/qiao.sqlite`, file contents in `DATA_DIR/files/<id>`.

A file's content is written to a temporary sibling, fsynced and renamed before its row is
committed, so a listed file always has its whole content; a deleted file's row goes first, then
its content. Every file has an owner (the API key's name; "" without keys): a key sees only its
own files, as an OpenAI project sees only its own.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
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
                where.append(f"seq {compare} ?")
                args.append(self._cursor("files", after, owner))
            rows = self._db.execute(
                "SELECT id, owner, purpose, filename, bytes, created_at FROM files WHERE "
                f"{' AND '.join(where)} ORDER BY seq {order.upper()} LIMIT ?",
                (*args, limit + 1),
            ).fetchall()
        files = [StoredFile(*row) for row in rows]
        return files[:limit], len(files) > limit

    def _cursor(self, table: str, after: str, owner: str) -> int:
        """The position of `after` (the last id of the previous page), called under the lock."""
        row = self._db.execute(
            f"SELECT seq FROM {table} WHERE id = ? AND owner = ?", (after, owner)
        ).fetchone()
        if row is None:
            noun = "file" if table == "files" else "batch"
            raise ConfigError(f"after: no {noun} {after!r}", param="after")
        return row[0]

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


# --- batches -------------------------------------------------------------------------------------

# OpenAI's lifecycle: validating → in_progress → finalizing → completed, or failed (the input
# cannot run), expired (the completion window passed), cancelling → cancelled.
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
FINISHED = ("completed", "failed", "expired", "cancelled")
_BATCH_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS batches (id TEXT PRIMARY KEY, owner TEXT NOT NULL, "
    "status TEXT NOT NULL, seq INTEGER NOT NULL, doc TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS batch_results (batch_id TEXT NOT NULL, number INTEGER NOT NULL, "
    "ok INTEGER NOT NULL, record TEXT NOT NULL, PRIMARY KEY (batch_id, number))",
)


class BatchStore(Store):
    """The store with batches: each batch one JSON document (OpenAI's Batch object plus qiao's
    private fields, which start with "_"), its finished lines in `batch_results`."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir)
        for statement in _BATCH_SCHEMA:
            self._db.execute(statement)

    def add_batch(self, owner: str, doc: dict[str, Any]) -> dict[str, Any]:
        doc = {**doc, "id": f"batch_{secrets.token_hex(12)}", "object": "batch"}
        with self._lock:
            seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM batches").fetchone()[0]
            self._db.execute(
                "INSERT INTO batches VALUES (?, ?, ?, ?, ?)",
                (doc["id"], owner, doc["status"], seq, json.dumps(doc)),
            )
        return doc

    def get_batch(self, batch_id: str, owner: str | None = None) -> dict[str, Any] | None:
        """The batch (of `owner`, unless None: the worker's view)."""
        query, args = "SELECT doc FROM batches WHERE id = ?", [batch_id]
        if owner is not None:
            query += " AND owner = ?"
            args.append(owner)
        with self._lock:
            row = self._db.execute(query, args).fetchone()
        return json.loads(row[0]) if row else None

    def batch_owner(self, batch_id: str) -> str:
        with self._lock:
            row = self._db.execute("SELECT owner FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return row[0] if row else ""

    def update_batch(self, batch_id: str, **fields: Any) -> dict[str, Any]:
        """Set `fields` on the batch; returns its document after."""
        after: dict[str, Any] = {}

        def update(doc: dict[str, Any]) -> None:
            doc.update(fields)
            after.update(doc)

        self.change_batch(batch_id, update)
        return after

    def change_batch(self, batch_id: str, change: Callable[[dict[str, Any]], None]) -> None:
        """Apply `change` to the batch's document in place, atomically (no update is lost to
        another one running beside it)."""
        with self._lock:
            (text,) = self._db.execute(
                "SELECT doc FROM batches WHERE id = ?", (batch_id,)
            ).fetchone()
            doc = json.loads(text)
            change(doc)
            self._db.execute(
                "UPDATE batches SET doc = ?, status = ? WHERE id = ?",
                (json.dumps(doc), doc["status"], batch_id),
            )

    def batches_with_pending_webhooks(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT doc FROM batches WHERE "
                "json_array_length(json_extract(doc, '$._webhook_pending')) > 0 ORDER BY seq"
            ).fetchall()
        return [json.loads(row[0]) for row in rows]

    def list_batches(
        self, owner: str, *, limit: int = 20, after: str | None = None
    ) -> tuple[list[dict[str, Any]], bool]:
        """(a page of batches newest first, whether more follow)."""
        if not 1 <= limit <= 100:
            raise ConfigError(f"limit: must be in 1..100, got {limit}", param="limit")
        where, args = "owner = ?", [owner]
        with self._lock:
            if after is not None:
                where += " AND seq < ?"
                args.append(self._cursor("batches", after, owner))
            rows = self._db.execute(
                f"SELECT doc FROM batches WHERE {where} ORDER BY seq DESC LIMIT ?",
                (*args, limit + 1),
            ).fetchall()
        docs = [json.loads(row[0]) for row in rows]
        return docs[:limit], len(docs) > limit

    def batch_counts(self) -> dict[str, int]:
        """Batches per status."""
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) FROM batches GROUP BY status")
            return dict(rows.fetchall())

    def unfinished_batch_ids(self) -> list[str]:
        marks = ", ".join("?" * len(UNFINISHED))
        with self._lock:
            rows = self._db.execute(
                f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY seq", UNFINISHED
            ).fetchall()
        return [row[0] for row in rows]

    def add_results(self, batch_id: str, rows: list[tuple[int, bool, str]]) -> tuple[int, int]:
        """Record finished lines (number, answered?, JSON line) once each; returns the batch's
        (answered, failed) counts after."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.executemany(
                    "INSERT OR IGNORE INTO batch_results VALUES (?, ?, ?, ?)",
                    [(batch_id, number, int(ok), record) for number, ok, record in rows],
                )
                counts = self._result_counts(batch_id)
                (text,) = self._db.execute(
                    "SELECT doc FROM batches WHERE id = ?", (batch_id,)
                ).fetchone()
                doc = json.loads(text)
                doc["request_counts"] = {**doc["request_counts"], **counts}
                self._db.execute(
                    "UPDATE batches SET doc = ? WHERE id = ?", (json.dumps(doc), batch_id)
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return counts["completed"], counts["failed"]

    def _result_counts(self, batch_id: str) -> dict[str, int]:
        ok, failed = self._db.execute(
            "SELECT COALESCE(SUM(ok), 0), COALESCE(SUM(1 - ok), 0) FROM batch_results "
            "WHERE batch_id = ?",
            (batch_id,),
        ).fetchone()
        return {"completed": int(ok), "failed": int(failed)}

    def done_numbers(self, batch_id: str) -> set[int]:
        with self._lock:
            rows = self._db.execute(
                "SELECT number FROM batch_results WHERE batch_id = ?", (batch_id,)
            ).fetchall()
        return {row[0] for row in rows}

    def batch_records(self, batch_id: str, ok: bool) -> list[str]:
        """The JSON lines of the batch's answered (or failed) lines, in input order."""
        with self._lock:
            rows = self._db.execute(
                "SELECT record FROM batch_results WHERE batch_id = ? AND ok = ? ORDER BY number",
                (batch_id, int(ok)),
            ).fetchall()
        return [row[0] for row in rows]
