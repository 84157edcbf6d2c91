"""Shared fixtures. Every test that touches Postgres gets a schema of its own
in the real database (TENANTQ_DATABASE_URL, or the embedded server when it is
unset), migrated fresh and dropped afterwards.

The session's data dir: TENANTQ_DATA_DIR if it is set (honoured, left as
found but for what the session started), else a temporary one made here, so
a test run never writes the machine's /var/lib/tenantq or ~/.local/share;
at the end an embedded Postgres started in the temporary one is stopped and
the directory removed (nothing of a run outlives it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
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
_SESSION_DATA_DIR: list[Path] = []


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get("TENANTQ_DATA_DIR"):
        made = Path(tempfile.mkdtemp(prefix="tenantq-tests-"))
        os.environ["TENANTQ_DATA_DIR"] = str(made)  # subprocesses (the CLI, workers) inherit it
        _SESSION_DATA_DIR.append(made)


def pytest_unconfigure(config: pytest.Config) -> None:
    for made in _SESSION_DATA_DIR:
        remove_data_dir(made)
    _SESSION_DATA_DIR.clear()


def remove_data_dir(made: Path) -> None:
    """A data dir the tests made (here, or `./run test` for both halves):
    its embedded Postgres stopped, what sandboxes left mounted unmounted, then removed."""
    from tenantq.store.embedded import embedded_pgdata, stop_embedded

    if (embedded_pgdata(made) / "PG_VERSION").exists():
        stop_embedded(made)
    _unmount_under(made)
    shutil.rmtree(made, ignore_errors=True)


def _unmount_under(path: Path) -> None:
    """Lazily unmount whatever a sandbox left mounted under `path` (a work
    dir's quota mount), deepest first, so removing the tree removes nothing else."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return
    inside = [line.split()[1] for line in mounts if line.split()[1].startswith(f"{path}/")]
    for target in sorted(inside, key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True, check=False)


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
