"""Helpers for testing code that uses tenantq (shipped to users, like
Oban.Testing): drain a queue synchronously, wait on a condition with a
deadline instead of sleeping, and the pytest fixtures `tenantq_db` (a
fresh, migrated schema of its own on the configured database, dropped
afterwards) and `tenantq_queue` (a Queue on it).

This module is a pytest plugin that installing tenantq registers (the
`pytest11` entry point `tenantq.testing` in pyproject.toml): the fixtures
are there in every test, with no `pytest_plugins` line (which is still
accepted). `pytest -p no:tenantq.testing` turns it off. It imports the
queue and the worker only when a fixture or `drain()` is used, so pytest
starts as fast with it as without.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from tenantq.dispatch.outcome import Backoff
    from tenantq.dispatch.worker import WorkerStats
    from tenantq.queue import Queue
    from tenantq.registry import Registry
    from tenantq.store.db import Database
    from tenantq.tenant_data import AppDatabase

T = TypeVar("T")


def drain(
    db: Database,
    registry: Registry | None = None,
    *,
    concurrency: int = 1,
    batch_size: int = 10,
    backoff: Backoff | None = None,
    app_db: AppDatabase | None = None,
) -> WorkerStats:
    """Run every runnable job inline until none is left, then return.

    Retries are scheduled with `backoff` (default: no delay at all, so a
    failing job is retried within the same drain until it is dead).
    `app_db`: an open `tenantq.tenant_data.AppDatabase` for handlers'
    `ctx.db()`; without it, the configured application database is used as
    `tenantq worker` uses it (TENANTQ_APP_DATABASE_URL, with
    TENANTQ_APP_DB_ROLE and the other TENANTQ_APP_DB_* settings), opened
    for this drain and closed after it; with neither, `ctx.db()` raises
    `NoAppDatabase`.
    """
    from tenantq.dispatch.build import build_worker
    from tenantq.dispatch.outcome import Backoff
    from tenantq.dispatch.worker import WorkerConfig
    from tenantq.settings import Settings
    from tenantq.tenant_data import AppDatabase

    config = WorkerConfig(
        concurrency=concurrency, batch_size=batch_size, once=True,
        backoff=backoff or Backoff(base_seconds=0.0, cap_seconds=0.0),
    )
    owned = None
    if app_db is None:
        configured = Settings().app_database()
        owned = app_db = AppDatabase(configured).open() if configured is not None else None
    try:
        return build_worker(db, sandbox="inline", registry=registry, config=config, app_db=app_db).run()
    finally:
        if owned is not None:
            owned.close()


def wait_until(
    predicate: Callable[[], T | bool | None],
    *,
    timeout: float = 10.0,
    interval: float = 0.02,
    message: str = "condition",
) -> T:
    """Poll `predicate` until it returns something truthy; fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)


def isolated_schema(prefix: str = "tq_test") -> Database:
    """A new, migrated schema on the configured database (TENANTQ_DATABASE_URL,
    or the embedded Postgres); drop it with `drop_schema`."""
    from tenantq.store.db import Database
    from tenantq.store.migrate import migrate

    base = Database.resolve()
    db = Database(dsn=base.dsn, schema=f"{prefix}_{uuid.uuid4().hex[:12]}")
    migrate(db)
    return db


def drop_schema(db: Database) -> None:
    import psycopg
    from psycopg import sql as pgsql

    with psycopg.connect(db.dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(pgsql.Identifier(db.schema)))


try:  # the pytest plugin: only where pytest is installed (it is not a dependency)
    import pytest
except ImportError:  # pragma: no cover
    pass
else:
    @pytest.fixture
    def tenantq_db() -> Iterator[Database]:
        """A fresh, migrated tenantq schema of this test's own, dropped afterwards."""
        db = isolated_schema()
        try:
            yield db
        finally:
            drop_schema(db)

    @pytest.fixture
    def tenantq_queue(tenantq_db: Database) -> Iterator[Queue]:
        """A Queue on `tenantq_db`."""
        from tenantq.queue import Queue

        queue = Queue(tenantq_db.dsn, schema=tenantq_db.schema)
        try:
            yield queue
        finally:
            queue.close()
