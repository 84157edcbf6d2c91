"""`tenantq migrate`: install or upgrade the schema, safe to run concurrently."""

from __future__ import annotations

from dataclasses import dataclass

from psycopg import sql as pgsql

from tenantq.store.db import Conn, Database
from tenantq.store.queries import migration_files, schema_sql, sql


@dataclass(frozen=True)
class MigrateReport:
    schema: str
    installed_fresh: bool
    applied: list[str]

    def summary(self) -> str:
        if self.installed_fresh:
            return f"installed schema {self.schema!r} at version {len(migration_files())}"
        if self.applied:
            return f"schema {self.schema!r}: applied {', '.join(self.applied)}"
        return f"schema {self.schema!r} is up to date (version {len(migration_files())})"


def migrate(db: Database) -> MigrateReport:
    """Bring db.schema to the latest version in one transaction.

    A fresh schema gets schema.sql (the single source of truth) and every
    migration is recorded as applied; an existing one gets the migrations it
    lacks, in order. The advisory lock makes a second concurrent migrate wait
    and then find nothing to do.
    """
    with db.connect(autocommit=False) as conn, conn.transaction():
        conn.execute(sql("migrate", "lock"), {"schema": db.schema})
        conn.execute(pgsql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(pgsql.Identifier(db.schema)))
        conn.execute(sql("migrate", "create_migrations_table"))
        applied = {int(str(row["version"])) for row in conn.execute(sql("migrate", "applied_versions"))}
        files = migration_files()
        if not applied:
            return _install_fresh(conn, db, files)
        done: list[str] = []
        for version, name, text in files:
            if version not in applied:
                conn.execute(text)
                conn.execute(sql("migrate", "record"), {"version": version, "name": name})
                done.append(f"{version:04d}_{name}")
        return MigrateReport(schema=db.schema, installed_fresh=False, applied=done)


def _install_fresh(conn: Conn, db: Database, files: list[tuple[int, str, str]]) -> MigrateReport:
    row = conn.execute(sql("migrate", "has_tables"), {"schema": db.schema}).fetchone()
    if row and int(str(row["n"])) > 0:
        raise RuntimeError(
            f"schema {db.schema!r} holds tables but no migration record; refusing to install over it"
        )
    conn.execute(schema_sql())
    for version, name, _ in files:
        conn.execute(sql("migrate", "record"), {"version": version, "name": name})
    return MigrateReport(schema=db.schema, installed_fresh=True, applied=[])


def apply_migrations_only(db: Database) -> None:
    """Build the schema by replaying every migration (tests compare the result
    with schema.sql; production always goes through migrate())."""
    with db.connect(autocommit=False) as conn, conn.transaction():
        conn.execute(pgsql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(pgsql.Identifier(db.schema)))
        conn.execute(sql("migrate", "create_migrations_table"))
        for version, name, text in migration_files():
            conn.execute(text)
            conn.execute(sql("migrate", "record"), {"version": version, "name": name})
