"""The run database's schema, as an ordered list of named migrations.

A migration is applied once, in order, and recorded in ``schema_migrations`` by its name.
Never edit or reorder a migration that has shipped: add a new one at the end. A database
that records a migration this code does not know was written by a newer zeropipe and is
refused rather than silently misread.
"""

from __future__ import annotations

MIGRATIONS: list[tuple[str, list[str]]] = [
    (
        "0001_create_runs",
        [
            """
            CREATE TABLE runs (
                id INTEGER PRIMARY KEY,
                path TEXT NOT NULL UNIQUE,          -- absolute run directory
                name TEXT NOT NULL,
                root TEXT NOT NULL,                 -- the runs root it lives under
                origin TEXT NOT NULL DEFAULT 'cli', -- 'cli' (found by the indexer) or 'ui' (launched from the browser)
                state TEXT NOT NULL,                -- starting, running, completed, failed, stopped, lost
                created_at REAL,
                started_at REAL,
                ended_at REAL,
                updated_at REAL,
                step INTEGER,
                total_steps INTEGER,
                first_loss REAL,
                last_loss REAL,
                step_time_s REAL,                   -- recent mean, for the ETA
                world_size INTEGER,
                zero_stage INTEGER,
                accelerator TEXT,
                supervisor_pid INTEGER,
                pids TEXT,                          -- JSON list of rank pids
                diagnosis TEXT,                     -- JSON: the failure diagnosis (its "text" in words)
                loss_preview TEXT,                  -- JSON [[step...], [loss...]] for the runs list
                missing INTEGER NOT NULL DEFAULT 0  -- the directory is gone
            )
            """,
        ],
    ),
    (
        "0002_create_launches",
        [
            # Every process the UI started: training, resume and export launchers. A pid is
            # only ever signalled when it is recorded here (or in the run's status.json) for that run.
            """
            CREATE TABLE launches (
                id INTEGER PRIMARY KEY,
                run_id INTEGER NOT NULL REFERENCES runs(id),
                action TEXT NOT NULL,               -- train, resume, export
                pid INTEGER NOT NULL,
                command TEXT NOT NULL,              -- JSON argv
                log_path TEXT NOT NULL,
                config_path TEXT,
                out_path TEXT,                      -- export destination
                detail TEXT,                        -- JSON: checkpoint, merge, dtype
                started_at REAL NOT NULL,
                ended_at REAL,
                exit_code INTEGER
            )
            """,
            "CREATE INDEX launches_by_run ON launches(run_id)",
        ],
    ),
    (
        "0003_runs_stop_requests_and_samples",
        [
            "ALTER TABLE runs ADD COLUMN stop_requested_at REAL",
            "ALTER TABLE runs ADD COLUMN has_samples INTEGER NOT NULL DEFAULT 0",
            "CREATE INDEX runs_by_state ON runs(state)",
        ],
    ),
    (
        "0004_run_ids_never_reused",
        [
            # SQLite gives a new row max(id) + 1, so deleting the newest run handed its id to the
            # next one and old links showed another run. The highest id ever issued is kept
            # here (and raised by every insert), and new runs are numbered past it. (Instead of
            # AUTOINCREMENT: that needs the table rebuilt, which launches' foreign key forbids
            # inside a migration.)
            "CREATE TABLE run_id_high_water (last INTEGER NOT NULL)",
            "INSERT INTO run_id_high_water (last) SELECT COALESCE(MAX(id), 0) FROM runs",
            """
            CREATE TRIGGER runs_raise_high_water AFTER INSERT ON runs
            BEGIN
                UPDATE run_id_high_water SET last = MAX(last, NEW.id);
            END
            """,
        ],
    ),
    (
        "0005_runs_first_started_at",
        [
            # started_at is the last launch's (a resume's); the runs list shows when the run first
            # started and how long it has been going.
            "ALTER TABLE runs ADD COLUMN first_started_at REAL",
        ],
    ),
]
