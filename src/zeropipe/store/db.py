"""The embedded SQLite database of runs and of the processes the UI started.

One connection per ``Database`` guarded by a lock: the web server's request handlers, its
refresh thread and the CLI all go through here, and SQLite's WAL mode lets another process
(a second ``zeropipe ui``, ``zeropipe runs ls``) read while we write.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from zeropipe.errors import ZeroPipeError
from zeropipe.store.migrations import MIGRATIONS

RUN_COLUMNS = (
    "id", "path", "name", "root", "origin", "state", "created_at", "started_at", "ended_at", "updated_at", "step",
    "total_steps", "first_loss", "last_loss", "step_time_s", "world_size", "zero_stage", "accelerator", "supervisor_pid",
    "pids", "diagnosis", "loss_preview", "missing", "stop_requested_at", "has_samples", "first_started_at",
)  # fmt: skip
JSON_COLUMNS = {"pids", "loss_preview", "command", "detail", "diagnosis"}
LAUNCH_COLUMNS = ("id", "run_id", "action", "pid", "command", "log_path", "config_path", "out_path", "detail", "started_at", "ended_at", "exit_code")


class StoreError(ZeroPipeError):
    """The run database cannot be used (newer schema, unreadable file)."""


def migrate(conn: sqlite3.Connection, migrations: list[tuple[str, list[str]]] = MIGRATIONS) -> list[str]:
    """Apply the migrations this database lacks, in order; return the names applied.

    Raises:
        StoreError: the database records migrations this code does not know (a newer zeropipe wrote it).
    """
    conn.execute("CREATE TABLE IF NOT EXISTS schema_migrations (seq INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, applied_at REAL NOT NULL)")
    # BEGIN IMMEDIATE takes the write lock first: two processes opening a fresh database at
    # once must not both apply 0001.
    conn.execute("BEGIN IMMEDIATE")
    try:
        applied = [row[0] for row in conn.execute("SELECT name FROM schema_migrations ORDER BY seq")]
        known = [name for name, _ in migrations]
        if applied != known[: len(applied)]:
            unknown = [name for name in applied if name not in known]
            raise StoreError(
                f"the run database records migrations this zeropipe does not know ({', '.join(unknown) or 'a different order'}): "
                "it was written by a newer version; upgrade zeropipe or point --db at another file"
            )
        done = []
        for seq, (name, statements) in enumerate(migrations, start=1):
            if seq <= len(applied):
                continue
            for statement in statements:
                conn.execute(statement)
            conn.execute("INSERT INTO schema_migrations (seq, name, applied_at) VALUES (?, ?, ?)", (seq, name, time.time()))
            done.append(name)
        conn.execute("COMMIT")
        return done
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def decode(row: sqlite3.Row | None) -> dict[str, Any] | None:
    if row is None:
        return None
    out = dict(row)
    for key in JSON_COLUMNS & out.keys():
        if out[key] is not None:
            try:
                out[key] = json.loads(out[key])
            except json.JSONDecodeError:
                out[key] = None
    return out


SQLITE_INT = 2**63 - 1


def encode(fields: dict[str, Any]) -> dict[str, Any]:
    """Fields as SQLite stores them: JSON columns as text, an integer beyond SQLite's 64 bits as a float.

    A run directory is anyone's file (``train.max_steps: 1e20`` in a copied run's ``run.json``):
    such a number is kept approximately rather than breaking every later write of the row.
    """
    out = {}
    for key, value in fields.items():
        if key in JSON_COLUMNS and value is not None:
            value = json.dumps(value)
        elif isinstance(value, int) and not isinstance(value, bool) and not -SQLITE_INT <= value <= SQLITE_INT:
            value = float(value)
        out[key] = value
    return out


# How long opening the database waits for another process that holds it.
OPEN_TIMEOUT_SECONDS = 10


class Database:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + OPEN_TIMEOUT_SECONDS
        while True:
            try:
                # isolation_level=None: we issue BEGIN/COMMIT ourselves (migrations) and every other
                # statement commits on its own.
                self.conn = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None, timeout=OPEN_TIMEOUT_SECONDS)
                self.conn.row_factory = sqlite3.Row
                # Switching a new file to WAL needs it alone; SQLite's busy timeout does not wait
                # for that, so another process opening the same new database at the same moment
                # is waited out here.
                self.conn.execute("PRAGMA journal_mode=WAL")
                self.conn.execute("PRAGMA foreign_keys=ON")
                break
            except sqlite3.OperationalError as err:
                if "locked" not in str(err) or time.monotonic() > deadline:
                    raise StoreError(f"cannot open the run database {self.path}: {err}; point --db at another file") from None
                self.conn.close()
                time.sleep(0.05)
            except sqlite3.DatabaseError as err:
                raise StoreError(f"cannot open the run database {self.path}: {err}; point --db at another file") from None
        self.lock = threading.RLock()
        with self.lock:
            self.applied = migrate(self.conn)

    def close(self) -> None:
        with self.lock:
            self.conn.close()

    def migrations(self) -> list[str]:
        with self.lock:
            return [row[0] for row in self.conn.execute("SELECT name FROM schema_migrations ORDER BY seq")]

    # ------------------------------------------------------------------ runs
    def insert_run(self, **fields: Any) -> int:
        """A new run's row; its id is past every id ever issued (a deleted run's id is never given again)."""
        fields = encode(fields)
        names = ", ".join(fields)
        marks = ", ".join("?" for _ in fields)
        with self.lock:
            cursor = self.conn.execute(
                f"INSERT INTO runs (id, {names}) VALUES ((SELECT last + 1 FROM run_id_high_water), {marks})", tuple(fields.values())
            )
            return int(cursor.lastrowid)

    def update_run(self, run_id: int, **fields: Any) -> None:
        if not fields:
            return
        unknown = set(fields) - set(RUN_COLUMNS)
        if unknown:
            raise ValueError(f"unknown run columns {sorted(unknown)}")
        fields = encode(fields)
        assignments = ", ".join(f"{name} = ?" for name in fields)
        with self.lock:
            self.conn.execute(f"UPDATE runs SET {assignments} WHERE id = ?", (*fields.values(), run_id))

    def run(self, run_id: int) -> dict[str, Any] | None:
        with self.lock:
            return decode(self.conn.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone())

    def run_by_path(self, path: str | Path) -> dict[str, Any] | None:
        with self.lock:
            return decode(self.conn.execute("SELECT * FROM runs WHERE path = ?", (str(path),)).fetchone())

    def runs_named(self, name: str) -> list[dict[str, Any]]:
        with self.lock:
            return [decode(row) for row in self.conn.execute("SELECT * FROM runs WHERE name = ? AND missing = 0 ORDER BY id DESC", (name,))]

    def runs(self, include_missing: bool = False) -> list[dict[str, Any]]:
        where = "" if include_missing else "WHERE missing = 0"
        with self.lock:
            return [decode(row) for row in self.conn.execute(f"SELECT * FROM runs {where} ORDER BY COALESCE(started_at, created_at) DESC, id DESC")]

    def delete_run(self, run_id: int) -> None:
        with self.lock:
            self.conn.execute("BEGIN")
            try:
                self.conn.execute("DELETE FROM launches WHERE run_id = ?", (run_id,))
                self.conn.execute("DELETE FROM runs WHERE id = ?", (run_id,))
                self.conn.execute("COMMIT")
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise

    # -------------------------------------------------------------- launches
    def insert_launch(self, **fields: Any) -> int:
        fields = encode(fields)
        names = ", ".join(fields)
        marks = ", ".join("?" for _ in fields)
        with self.lock:
            return int(self.conn.execute(f"INSERT INTO launches ({names}) VALUES ({marks})", tuple(fields.values())).lastrowid)

    def update_launch(self, launch_id: int, **fields: Any) -> None:
        fields = encode(fields)
        assignments = ", ".join(f"{name} = ?" for name in fields)
        with self.lock:
            self.conn.execute(f"UPDATE launches SET {assignments} WHERE id = ?", (*fields.values(), launch_id))

    def launches(self, run_id: int | None = None, action: str | None = None, open_only: bool = False) -> list[dict[str, Any]]:
        clauses, params = [], []
        if run_id is not None:
            clauses.append("run_id = ?")
            params.append(run_id)
        if action is not None:
            clauses.append("action = ?")
            params.append(action)
        if open_only:
            clauses.append("ended_at IS NULL")
        where = ("WHERE " + " AND ".join(clauses)) if clauses else ""
        with self.lock:
            return [decode(row) for row in self.conn.execute(f"SELECT * FROM launches {where} ORDER BY id DESC", params)]

    def launch(self, launch_id: int) -> dict[str, Any] | None:
        with self.lock:
            return decode(self.conn.execute("SELECT * FROM launches WHERE id = ?", (launch_id,)).fetchone())

