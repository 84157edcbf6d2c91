"""The demo's "application" database for scene 3: an `orders` table under
FORCE ROW LEVEL SECURITY, in a schema of its own on the Postgres the demo
already uses, read through a NOLOGIN role that is neither owner nor
superuser (the worker's `SET LOCAL ROLE`, like `--app-db-role`). Recreated
on every run; docs/tenant-data.md is the recipe it follows."""

from __future__ import annotations

import re
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from tenantq.demo import workload
from tenantq.errors import TenantqError
from tenantq.tenant_data import AppDatabaseConfig

# the month every report asks for; each tenant also has orders in other
# months, so a report that ignored the month would be visibly wrong
MONTH = 9
# (month, amount) per tenant: what the reports must add up to
ORDERS: dict[str, tuple[tuple[int, int], ...]] = {
    "acme": ((9, 250), (9, 400), (9, 600), (8, 120)),
    "globex": ((9, 75), (9, 125), (10, 990)),
    "initech": ((9, 3000), (8, 700)),
    workload.HOSTILE: ((9, 40), (8, 15)),
}
# the tenant whose orders mallory's job goes after
VICTIM = "acme"
# `-c search_path=...` in the URL and role names: plain identifiers only
_PLAIN = re.compile(r"^[a-z_][a-z0-9_]{0,55}$")


def expected(tenant: str, month: int = MONTH) -> tuple[int, int]:
    """(orders, total) of a tenant's month, from the seed."""
    amounts = [amount for m, amount in ORDERS.get(tenant, ()) if m == month]
    return len(amounts), sum(amounts)


def names(schema: str) -> tuple[str, str]:
    """The app's schema and its reader role, derived from the demo's schema
    so that two demos in different schemas (the acceptance test's) never
    share them."""
    return f"{schema}_app", f"{schema}_reader"


def create(dsn: str, schema: str) -> AppDatabaseConfig:
    """(Re)create the app's schema and seed it; the config a worker needs.
    The demo's own user creates everything and logs in; its transactions run
    as the reader role, so the policy applies even where that user is a
    superuser. One-line TenantqError when that user may not do it."""
    if not _PLAIN.match(schema):
        raise TenantqError(f"scene 3 needs a plain schema name (a-z, 0-9, _; at most 56), got {schema!r}")
    app, reader = names(schema)
    ident = sql.Identifier
    try:
        with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(ident(app)))
            # roles are per cluster, not per database: kept from an earlier
            # run (maybe against another database of the cluster, where it
            # still holds grants and could not be dropped from here)
            if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (reader,)).fetchone() is None:
                conn.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(ident(reader)))
            # SET ROLE needs membership; a superuser has it anyway, a CREATEROLE user does not
            conn.execute(sql.SQL("GRANT {} TO CURRENT_USER").format(ident(reader)))
            for statement in _schema_sql(app, reader):
                conn.execute(statement)
            conn.cursor().executemany(
                sql.SQL("INSERT INTO {}.orders (tenant_id, month, amount) VALUES (%s, %s, %s)"
                        ).format(ident(app)),
                [(tenant, month, amount) for tenant, rows in ORDERS.items() for month, amount in rows])
            # after the seed: with FORCE the owner's own INSERTs are checked too
            for statement in _rls_sql(app):
                conn.execute(statement)
    except psycopg.Error as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TenantqError(f"cannot create the demo's app schema {app} and role {reader}: {first}") from None
    # the search_path is a startup option, so the pool's DISCARD ALL keeps it:
    # the host function's SQL says `orders`, as an app's would
    return AppDatabaseConfig(url=make_conninfo(dsn, options=f"-c search_path={app}"), role=reader,
                             pool_size=4)


def _schema_sql(app: str, reader: str) -> list[Any]:
    ident = sql.Identifier
    return [
        sql.SQL("CREATE SCHEMA {}").format(ident(app)),
        sql.SQL("CREATE TABLE {}.orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
                "tenant_id text NOT NULL, month integer NOT NULL CHECK (month BETWEEN 1 AND 12), "
                "amount integer NOT NULL)").format(ident(app)),
        # tenant_id first: every query the policy touches filters on it
        sql.SQL("CREATE INDEX ON {}.orders (tenant_id, month)").format(ident(app)),
        sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(ident(app), ident(reader)),
        # the reports only read: the role gets nothing more
        sql.SQL("GRANT SELECT ON {}.orders TO {}").format(ident(app), ident(reader)),
    ]


def _rls_sql(app: str) -> list[Any]:
    ident = sql.Identifier
    return [
        sql.SQL("ALTER TABLE {}.orders ENABLE ROW LEVEL SECURITY").format(ident(app)),
        # without FORCE the table's owner would be exempt from the policy
        sql.SQL("ALTER TABLE {}.orders FORCE ROW LEVEL SECURITY").format(ident(app)),
        sql.SQL("CREATE POLICY tenant_rows ON {}.orders "
                "USING (tenant_id = current_setting('app.current_tenant_id', true)) "
                "WITH CHECK (tenant_id = current_setting('app.current_tenant_id', true))").format(ident(app)),
    ]
