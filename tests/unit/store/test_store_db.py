"""The run database: ordered, named migrations, and refusing a database from a newer zeropipe."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from zeropipe.store.db import Database, StoreError, migrate
from zeropipe.store.migrations import MIGRATIONS


def test_a_new_database_gets_every_migration_in_order(tmp_path):
    db = Database(tmp_path / "runs.sqlite3")
    assert db.migrations() == [name for name, _ in MIGRATIONS]
    assert db.applied == [name for name, _ in MIGRATIONS]
    # Reopening applies nothing again.
    db.close()
    assert Database(tmp_path / "runs.sqlite3").applied == []


def test_migration_names_are_ordered_and_unique():
    names = [name for name, _ in MIGRATIONS]
    assert names == sorted(names) and len(set(names)) == len(names)
    assert all(name[:4].isdigit() and name[4] == "_" for name in names)


def test_an_older_database_is_upgraded_and_keeps_its_rows(tmp_path):
    path = tmp_path / "runs.sqlite3"
    conn = sqlite3.connect(path, isolation_level=None)
    migrate(conn, MIGRATIONS[:1])  # what the first release wrote
    conn.execute("INSERT INTO runs (path, name, root, state) VALUES ('/r/a', 'a', '/r', 'completed')")
    conn.close()

    db = Database(path)
    assert db.applied == [name for name, _ in MIGRATIONS[1:]]
    row = db.run_by_path("/r/a")
    assert row["name"] == "a" and row["state"] == "completed"
    assert row["has_samples"] == 0 and row["stop_requested_at"] is None  # columns added by 0003


def test_a_database_from_a_newer_zeropipe_is_refused(tmp_path):
    path = tmp_path / "runs.sqlite3"
    Database(path).close()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("INSERT INTO schema_migrations (seq, name, applied_at) VALUES (99, '0099_from_the_future', 0)")
    conn.close()
    with pytest.raises(StoreError, match="0099_from_the_future.*newer version"):
        Database(path)


def test_a_failing_migration_leaves_the_database_as_it_was(tmp_path):
    path = tmp_path / "runs.sqlite3"
    conn = sqlite3.connect(path, isolation_level=None)
    broken = [*MIGRATIONS[:1], ("0002_broken", ["CREATE TABLE launches (id INTEGER PRIMARY KEY)", "THIS IS NOT SQL"])]
    with pytest.raises(sqlite3.OperationalError):
        migrate(conn, broken)
    tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert "runs" not in tables and "launches" not in tables  # 0001 rolled back with 0002
    conn.close()
    assert Database(path).migrations() == [name for name, _ in MIGRATIONS]


def test_two_processes_opening_a_new_database_at_once_apply_each_migration_once(tmp_path):
    path = tmp_path / "runs.sqlite3"
    errors = []

    def open_it():
        try:
            Database(path).close()
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=open_it) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert Database(path).migrations() == [name for name, _ in MIGRATIONS]


def test_json_columns_round_trip(tmp_path):
    db = Database(tmp_path / "runs.sqlite3")
    run_id = db.insert_run(path="/r/x", name="x", root="/r", state="failed", pids=[1, 2], diagnosis={"text": "rank 0 died"})
    row = db.run(run_id)
    assert row["pids"] == [1, 2] and row["diagnosis"] == {"text": "rank 0 died"}
    with pytest.raises(ValueError, match="unknown run columns"):
        db.update_run(run_id, **{"state = 'x'; --": 1})


def test_a_deleted_runs_id_is_never_given_again(tmp_path):
    """Deleting the newest run handed its id to the next one: an old link showed another run."""
    db = Database(tmp_path / "runs.sqlite3")
    first = db.insert_run(path="/r/a", name="a", root="/r", state="completed")
    second = db.insert_run(path="/r/b", name="b", root="/r", state="completed")
    db.delete_run(second)
    third = db.insert_run(path="/r/c", name="c", root="/r", state="completed")
    assert third > second > first
    db.close()
    assert Database(tmp_path / "runs.sqlite3").insert_run(path="/r/d", name="d", root="/r", state="completed") == third + 1


def test_a_database_from_before_the_high_water_mark_never_reuses_its_ids_either(tmp_path):
    path = tmp_path / "runs.sqlite3"
    conn = sqlite3.connect(path, isolation_level=None)
    migrate(conn, MIGRATIONS[:3])  # a database written before run ids were kept
    for n in (1, 2, 3):
        conn.execute("INSERT INTO runs (path, name, root, state) VALUES (?, ?, '/r', 'completed')", (f"/r/{n}", str(n)))
    conn.close()
    db = Database(path)
    assert "0004_run_ids_never_reused" in db.applied
    db.delete_run(3)
    assert db.insert_run(path="/r/new", name="new", root="/r", state="completed") == 4
