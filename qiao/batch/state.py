"""A batch job's durable state: one SQLite file holding the job's identity and its finished
lines, so a run killed at any moment continues where it stopped.

A finished line is written once (its number is the key) inside a transaction; a kill loses at
most the lines of the transaction not yet committed, and those run again. SQLite's WAL journal
keeps a commit across a killed process; `synchronous=NORMAL` spares an fsync per commit (a power
cut may lose the last commits, which again only run again).
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qiao.errors import ConfigError

SCHEMA_VERSION = "1"


class JobState:
    """Open (or create) the state file of a job whose identity is `identity` (the input's
    digest and the settings that shape results). A file made for another identity is refused
    with what differs, unless `restart`, which discards it."""

    def __init__(self, path: Path, identity: dict[str, Any], *, restart: bool = False) -> None:
        self.path = path
        if restart:
            for suffix in ("", "-wal", "-shm"):
                Path(f"{path}{suffix}").unlink(missing_ok=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, isolation_level=None)  # explicit transactions
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS results (number INTEGER PRIMARY KEY, "
            "custom_id TEXT, ok INTEGER NOT NULL, record TEXT NOT NULL)"
        )
        meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        if not meta:
            self._db.execute("BEGIN")
            self._db.executemany(
                "INSERT INTO meta VALUES (?, ?)",
                [
                    ("schema", SCHEMA_VERSION),
                    ("job_id", uuid.uuid4().hex),
                    ("created_at", str(int(time.time()))),
                    ("identity", json.dumps(identity, sort_keys=True)),
                ],
            )
            self._db.execute("COMMIT")
            meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        elif meta.get("schema") != SCHEMA_VERSION:
            self.close()
            raise ConfigError(
                f"{path} was written by another qiao version (schema {meta.get('schema')}); "
                "pass --restart to discard it"
            )
        else:
            _check_identity(path, json.loads(meta["identity"]), identity, self.num_done())
        self.job_id: str = meta["job_id"]
        self._pending: list[tuple[int, str | None, int, str]] = []

    def num_done(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM results").fetchone()[0]

    def done_numbers(self) -> set[int]:
        return {row[0] for row in self._db.execute("SELECT number FROM results")}

    def add(self, number: int, custom_id: str | None, ok: bool, record: dict[str, Any]) -> None:
        """Queue a finished line; `commit` makes it durable."""
        self._pending.append((number, custom_id, int(ok), json.dumps(record, ensure_ascii=False)))

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def commit(self) -> None:
        if not self._pending:
            return
        self._db.execute("BEGIN")
        self._db.executemany("INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?)", self._pending)
        self._db.execute("COMMIT")
        self._pending.clear()

    def records(self) -> Iterator[tuple[bool, str]]:
        """(answered, JSON line) of every finished line, in input order."""
        for ok, record in self._db.execute("SELECT ok, record FROM results ORDER BY number"):
            yield bool(ok), record

    def counts(self) -> tuple[int, int]:
        """(answered lines, failed lines)."""
        ok, failed = self._db.execute(
            "SELECT COALESCE(SUM(ok), 0), COALESCE(SUM(1 - ok), 0) FROM results"
        ).fetchone()
        return int(ok), int(failed)

    def close(self) -> None:
        self._db.close()

    def remove(self) -> None:
        self.close()
        for suffix in ("", "-wal", "-shm"):
            Path(f"{self.path}{suffix}").unlink(missing_ok=True)


def _check_identity(
    path: Path, stored: dict[str, Any], identity: dict[str, Any], num_done: int
) -> None:
    changed = sorted(k for k in stored.keys() | identity.keys() if stored.get(k) != identity.get(k))
    if changed:
        details = "; ".join(
            f"{k}: {stored.get(k)!r} then, {identity.get(k)!r} now" for k in changed
        )
        raise ConfigError(
            f"{path} holds {num_done} finished lines of a run with other inputs ({details}); "
            "rerun with the same input and settings to continue it, or pass --restart to "
            "discard it"
        )
