"""Shared fixtures. Every test that touches Postgres gets a schema of its own
in the real database (TENANTQ_DATABASE_URL, or the embedded server when it is
unset), migrated fresh and dropped afterwards."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql as pgsql

from tenantq import Queue
from tenantq.store.db import Database
from tenantq.store.migrate import migrate
from tests.appdb import app_schema as app_schema  # the fixture, for every suite

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def server_dsn() -> str:
    """The Postgres server the tests use (resolved once per session)."""
    return Database.resolve(schema="public").dsn


def _drop_schema(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(pgsql.Identifier(schema)))


@pytest.fixture
def fresh_schema(server_dsn: str) -> Iterator[Database]:
    """An empty, unmigrated schema."""
    db = Database(dsn=server_dsn, schema=f"tq_{uuid.uuid4().hex[:12]}")
    try:
        yield db
    finally:
        _drop_schema(server_dsn, db.schema)


@pytest.fixture
def db(fresh_schema: Database) -> Database:
    """A migrated schema of this test's own."""
    migrate(fresh_schema)
    return fresh_schema


@pytest.fixture
def queue(db: Database) -> Iterator[Queue]:
    q = Queue(db.dsn, schema=db.schema)
    try:
        yield q
    finally:
        q.close()


@pytest.fixture
def cli_env(db: Database) -> dict[str, str]:
    """Environment for running `tenantq` as a subprocess against this test's schema."""
    env = dict(os.environ)
    env["TENANTQ_DATABASE_URL"] = db.dsn
    env["TENANTQ_SCHEMA"] = db.schema
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="session")
def tenantq_cmd() -> list[str]:
    """How to invoke the CLI in a subprocess with this interpreter."""
    return [sys.executable, "-m", "tenantq.cli"]
