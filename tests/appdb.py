"""The application's database for tests of ctx.db() and host functions:
an orders table under FORCE ROW LEVEL SECURITY in a schema of the test's
own, a NOLOGIN reader role (for --app-db-role) and a LOGIN role, neither
superuser nor owner; all dropped afterwards."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from tenantq.tenant_data import AppDatabaseConfig

ROWS = {"acme": [1, 2, 3], "globex": [10, 11]}


@dataclass(frozen=True)
class AppSchema:
    schema: str
    reader: str  # NOLOGIN, neither superuser nor owner: for SET LOCAL ROLE
    login: str   # LOGIN, neither superuser nor owner: connects itself
    superuser_url: str
    login_url: str

    def config(self, **kwargs: Any) -> AppDatabaseConfig:
        return AppDatabaseConfig(**{"url": self.login_url, **kwargs})


@pytest.fixture
def app_schema(server_dsn: str) -> Iterator[AppSchema]:
    """The app's orders table under RLS, in a schema and with roles of this
    test's own (dropped afterwards)."""
    tag = uuid.uuid4().hex[:10]
    schema, reader, login = f"tqapp_{tag}", f"tqapp_reader_{tag}", f"tqapp_login_{tag}"
    ident = sql.Identifier
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        for statement in (
            sql.SQL("CREATE SCHEMA {}").format(ident(schema)),
            sql.SQL("CREATE TABLE {}.orders (id integer PRIMARY KEY, tenant_id text NOT NULL, "
                    "amount integer NOT NULL)").format(ident(schema)),
            sql.SQL("ALTER TABLE {}.orders ENABLE ROW LEVEL SECURITY").format(ident(schema)),
            sql.SQL("ALTER TABLE {}.orders FORCE ROW LEVEL SECURITY").format(ident(schema)),
            sql.SQL("CREATE POLICY tenant_rows ON {}.orders "
                    "USING (tenant_id = current_setting('app.current_tenant_id', true)) "
                    "WITH CHECK (tenant_id = current_setting('app.current_tenant_id', true))"
                    ).format(ident(schema)),
            sql.SQL("CREATE ROLE {} NOLOGIN").format(ident(reader)),
            sql.SQL("CREATE ROLE {} LOGIN").format(ident(login)),
        ):
            conn.execute(statement)
        for role in (reader, login):
            conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(ident(schema), ident(role)))
            conn.execute(sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON {}.orders TO {}").format(
                ident(schema), ident(role)))
        for tenant, ids in ROWS.items():
            for order_id in ids:
                conn.execute(sql.SQL("INSERT INTO {}.orders VALUES (%s, %s, %s)").format(ident(schema)),
                             (order_id, tenant, order_id * 100))
    try:
        yield AppSchema(schema, reader, login, server_dsn, make_conninfo(server_dsn, user=login))
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(ident(schema)))
            for role in (reader, login):
                conn.execute(sql.SQL("DROP OWNED BY {}").format(ident(role)))
                conn.execute(sql.SQL("DROP ROLE {}").format(ident(role)))
