"""The schema: migrations replay to exactly schema.sql, migrate is idempotent
and safe to run concurrently, and CHECK constraints hold the invariants."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any, LiteralString

import psycopg
import pytest
from psycopg import sql as pgsql

from tenantq.store.db import Database
from tenantq.store.migrate import MigrateReport, apply_migrations_only, migrate
from tenantq.store.queries import migration_files
from tests.integration.helpers import fetch_all


def _normalise(text: Any, schema: str) -> Any:
    return text.replace(f"{schema}.", "SCHEMA.") if isinstance(text, str) else text


def _describe(db: Database) -> dict[str, Any]:
    """Everything that makes up the schema, with the schema name taken out."""
    params = {"schema": db.schema}
    columns = fetch_all(
        db,
        """
        SELECT table_name, column_name, data_type, udt_name, is_nullable, column_default,
               is_identity, identity_generation, character_maximum_length, numeric_precision
        FROM information_schema.columns
        WHERE table_schema = %(schema)s
        ORDER BY table_name, column_name
        """,
        params,
    )
    constraints = fetch_all(
        db,
        """
        SELECT cl.relname AS table_name, co.conname, co.contype::text AS contype,
               pg_get_constraintdef(co.oid) AS definition
        FROM pg_constraint co
        JOIN pg_class cl ON cl.oid = co.conrelid
        JOIN pg_namespace n ON n.oid = cl.relnamespace
        WHERE n.nspname = %(schema)s
        ORDER BY cl.relname, co.conname
        """,
        params,
    )
    indexes = fetch_all(
        db,
        """
        SELECT tablename, indexname, indexdef FROM pg_indexes
        WHERE schemaname = %(schema)s ORDER BY tablename, indexname
        """,
        params,
    )
    tables = fetch_all(
        db,
        "SELECT tablename FROM pg_tables WHERE schemaname = %(schema)s ORDER BY tablename",
        params,
    )
    functions = fetch_all(
        db,
        """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid) AS arguments,
               pg_get_functiondef(p.oid) AS definition
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = %(schema)s ORDER BY p.proname, arguments
        """,
        params,
    )
    # storage parameters (the churning tables' autovacuum settings)
    storage = fetch_all(
        db,
        "SELECT c.relname, c.reloptions FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %(schema)s AND c.reloptions IS NOT NULL ORDER BY c.relname",
        params,
    )
    toast_storage = fetch_all(
        db,
        "SELECT c.relname, t.reloptions FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " JOIN pg_class t ON t.oid = c.reltoastrelid"
        " WHERE n.nspname = %(schema)s AND t.reloptions IS NOT NULL ORDER BY c.relname",
        params,
    )
    scheduler = fetch_all(db, "SELECT * FROM scheduler ORDER BY priority")
    migrations = fetch_all(db, "SELECT version, name FROM migrations ORDER BY version")
    return {
        "tables": tables,
        "columns": columns,
        "constraints": [{k: _normalise(v, db.schema) for k, v in r.items()} for r in constraints],
        "indexes": [{k: _normalise(v, db.schema) for k, v in r.items()} for r in indexes],
        "functions": [{k: _normalise(v, db.schema) for k, v in r.items()} for r in functions],
        "storage": storage,
        "toast_storage": toast_storage,
        "scheduler": scheduler,
        "migrations": migrations,
    }


@pytest.fixture
def other_schema(server_dsn: str) -> Iterator[Database]:
    db = Database(dsn=server_dsn, schema=f"tq_{uuid.uuid4().hex[:12]}")
    try:
        yield db
    finally:
        _drop(db)


def _drop(db: Database) -> None:
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(pgsql.Identifier(db.schema)))


def test_migrations_replay_to_exactly_schema_sql(fresh_schema: Database, other_schema: Database) -> None:
    apply_migrations_only(fresh_schema)
    report = migrate(other_schema)
    assert report.installed_fresh

    replayed, installed = _describe(fresh_schema), _describe(other_schema)
    assert replayed["tables"], "migrations created no tables"
    assert [f["proname"] for f in replayed["functions"]] == ["queue_kinds"]
    # compare part by part so a failure names what drifted
    assert {r["relname"] for r in installed["storage"]} == {"attempts", "batches", "jobs", "wakes"}
    for part in ("tables", "columns", "constraints", "indexes", "functions", "storage", "toast_storage",
                 "scheduler", "migrations"):
        assert replayed[part] == installed[part], f"{part} differ between migrations and schema.sql"
    # vacuum never truncates the churning tables (migrations 0012, 0014): the
    # truncation's ACCESS EXCLUSIVE lock would stop every claim (every
    # enqueue, for wakes, whose rows are too small for TOAST)
    for part, tables in (("storage", {"attempts", "batches", "jobs", "wakes"}),
                         ("toast_storage", {"attempts", "batches", "jobs"})):
        assert {r["relname"] for r in installed[part]} == tables, part
        for row in installed[part]:
            assert "vacuum_truncate=false" in row["reloptions"], (part, row["relname"])
    assert [r["version"] for r in installed["migrations"]] == [v for v, _, _ in migration_files()]
    assert {r["priority"] for r in installed["scheduler"]} == {"interactive", "default", "bulk"}


def test_migrate_twice_is_a_no_op(fresh_schema: Database) -> None:
    first = migrate(fresh_schema)
    assert first.installed_fresh and first.applied == []
    before = fetch_all(fresh_schema, "SELECT version, name, applied_at FROM migrations ORDER BY version")
    shape = _describe(fresh_schema)

    second = migrate(fresh_schema)
    assert not second.installed_fresh
    assert second.applied == []
    assert "up to date" in second.summary()
    after = fetch_all(fresh_schema, "SELECT version, name, applied_at FROM migrations ORDER BY version")
    assert after == before
    assert _describe(fresh_schema) == shape


def test_migrate_applies_only_missing_migrations(fresh_schema: Database) -> None:
    """An install at version 1 gets the later migrations, and ends equal to a fresh install."""
    files = migration_files()
    if len(files) < 2:
        pytest.skip("needs at least two migrations")
    version, name, text = files[0]
    with fresh_schema.connect(autocommit=False) as conn, conn.transaction():
        conn.execute(pgsql.SQL("CREATE SCHEMA {}").format(pgsql.Identifier(fresh_schema.schema)))
        conn.execute(pgsql.SQL("SET LOCAL search_path = {}").format(pgsql.Identifier(fresh_schema.schema)))
        conn.execute("CREATE TABLE migrations (version integer PRIMARY KEY, name text NOT NULL, "
                     "applied_at timestamptz NOT NULL DEFAULT now())")
        conn.execute(text)
        conn.execute("INSERT INTO migrations (version, name) VALUES (%s, %s)", (version, name))
    report = migrate(fresh_schema)
    assert not report.installed_fresh
    assert report.applied == [f"{v:04d}_{n}" for v, n, _ in files[1:]]


def _race_migrate(db: Database, threads: int) -> list[MigrateReport]:
    """`threads` migrate() calls released at the same instant."""
    barrier = threading.Barrier(threads)
    reports: list[MigrateReport] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            barrier.wait(timeout=10)
            reports.append(migrate(db))
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(30)
    assert not any(t.is_alive() for t in workers)
    assert errors == []
    return reports


@pytest.mark.parametrize("threads", [2, 4])
def test_concurrent_migrate_on_a_fresh_schema(server_dsn: str, threads: int) -> None:
    for _ in range(3):
        db = Database(dsn=server_dsn, schema=f"tq_{uuid.uuid4().hex[:12]}")
        try:
            reports = _race_migrate(db, threads)
            assert len(reports) == threads
            assert sum(r.installed_fresh for r in reports) == 1
            assert all(r.applied == [] for r in reports)
            rows = fetch_all(db, "SELECT version, name FROM migrations ORDER BY version")
            assert [(r["version"], r["name"]) for r in rows] == [(v, n) for v, n, _ in migration_files()]
            assert len(fetch_all(db, "SELECT * FROM scheduler")) == 3
        finally:
            _drop(db)


# -- CHECK constraints ------------------------------------------------------

def _insert_job(conn: psycopg.Connection[Any], **overrides: Any) -> None:
    row: dict[str, Any] = {
        "tenant_id": "acme", "kind": "demo.noop", "payload": "{}", "priority": "default",
        "status": "pending", "attempts": 0, "max_attempts": 3, "batch_id": None,
        "last_error": None, "started_at": None, "finished_at": None,
    }
    row.update(overrides)
    conn.execute(
        """
        INSERT INTO jobs (tenant_id, kind, payload, priority, status, attempts, max_attempts, batch_id,
                          last_error, started_at, finished_at, run_after, created_at)
        VALUES (%(tenant_id)s, %(kind)s, %(payload)s::jsonb, %(priority)s, %(status)s, %(attempts)s,
                %(max_attempts)s, %(batch_id)s, %(last_error)s, %(started_at)s, %(finished_at)s,
                now(), now())
        """,
        row,
    )


@pytest.mark.parametrize(
    ("overrides", "constraint"),
    [
        ({"attempts": 4, "max_attempts": 3}, "attempts_in_range"),
        ({"attempts": -1}, "attempts_in_range"),
        ({"max_attempts": 0}, "max_attempts_positive"),
        ({"status": "running", "attempts": 1, "started_at": "now"}, "running_has_lease"),
        ({"status": "bogus"}, "status_known"),
        ({"priority": "urgent"}, "job_priority_known"),
        ({"kind": "has space"}, "kind_format"),
        ({"status": "done"}, "finished_iff_final"),
        ({"status": "dead", "finished_at": "2024-01-01T00:00:00Z"}, "dead_has_error"),
        ({"payload": '"' + "x" * 262144 + '"'}, "payload_size"),
    ],
)
def test_check_constraints_reject_bad_job_rows(
    db: Database, overrides: dict[str, Any], constraint: str
) -> None:
    with db.connect() as conn:
        conn.execute("INSERT INTO tenants (tenant_id) VALUES ('acme')")
        _insert_job(conn)  # the baseline row is valid
        with pytest.raises(psycopg.errors.CheckViolation) as info:
            _insert_job(conn, **overrides)
        assert info.value.diag.constraint_name == constraint
        assert conn.execute("SELECT count(*) AS n FROM jobs").fetchone() == {"n": 1}


def test_running_job_needs_an_attempt(db: Database) -> None:
    with db.connect() as conn:
        conn.execute("INSERT INTO tenants (tenant_id) VALUES ('acme')")
        batch = conn.execute(
            "INSERT INTO batches (tenant_id, priority, worker_id, sandbox_driver, job_count, "
            "lease_expires_at, created_at, heartbeat_at) "
            "VALUES ('acme', 'default', 'w', 'inline', 1, now() + interval '1 minute', now(), now()) "
            "RETURNING batch_id"
        ).fetchone()
        assert batch is not None
        with pytest.raises(psycopg.errors.CheckViolation) as info:
            _insert_job(conn, status="running", attempts=0, batch_id=batch["batch_id"], started_at="now")
        assert info.value.diag.constraint_name == "running_was_attempted"
        _insert_job(conn, status="running", attempts=1, batch_id=batch["batch_id"], started_at="now")


@pytest.mark.parametrize(
    ("tenant", "constraint"),
    [("has space", "tenant_id_format"), ("", "tenant_id_format"), ("-leading-dash", "tenant_id_format"),
     ("x" * 129, "tenant_id_format")],
)
def test_check_constraints_reject_bad_tenant_ids(db: Database, tenant: str, constraint: str) -> None:
    with db.connect() as conn:
        with pytest.raises(psycopg.errors.CheckViolation) as info:
            conn.execute("INSERT INTO tenants (tenant_id) VALUES (%s)", (tenant,))
        assert info.value.diag.constraint_name == constraint
        conn.execute("INSERT INTO tenants (tenant_id) VALUES (%s)", ("x" * 128,))


def test_check_constraints_on_tenants_queues_and_batches(db: Database) -> None:
    with db.connect() as conn:
        conn.execute("INSERT INTO tenants (tenant_id) VALUES ('acme')")
        cases: list[tuple[LiteralString, str]] = [
            ("UPDATE tenants SET weight = 0", "weight_range"),
            ("UPDATE tenants SET max_sandboxes = 0", "max_sandboxes_positive"),
            ("INSERT INTO queues (tenant_id, priority) VALUES ('acme', 'urgent')", "queue_priority_known"),
            ("INSERT INTO batches (tenant_id, priority, worker_id, sandbox_driver, job_count, "
             "lease_expires_at, created_at, heartbeat_at) "
             "VALUES ('acme', 'default', '', 'inline', 1, now(), now(), now())", "worker_id_nonempty"),
            ("INSERT INTO batches (tenant_id, priority, worker_id, sandbox_driver, job_count, "
             "lease_expires_at, created_at, heartbeat_at) "
             "VALUES ('acme', 'default', 'w', 'inline', 0, now(), now(), now())", "job_count_positive"),
            ("INSERT INTO batches (tenant_id, priority, worker_id, sandbox_driver, job_count, "
             "lease_expires_at, created_at, heartbeat_at, ended_at) "
             "VALUES ('acme', 'default', 'w', 'inline', 1, now(), now(), now(), now())", "ended_has_outcome"),
            ("INSERT INTO batches (tenant_id, priority, worker_id, sandbox_driver, job_count, "
             "lease_expires_at, created_at, heartbeat_at) "
             "VALUES ('acme', 'default', 'w', 'inline', 1, now() - interval '1 s', now(), now())",
             "lease_after_creation"),
        ]
        for statement, constraint in cases:
            with pytest.raises(psycopg.errors.CheckViolation) as info:
                conn.execute(statement)
            assert info.value.diag.constraint_name == constraint, statement
