"""`tenantq.Queue` and `tenantq.AsyncQueue`: the producer's and operator's
handle on the store.

Both have the same methods with the same signatures; `AsyncQueue`'s return
coroutines. They are one implementation (client/operations.py) driven on a
sync or an async connection (client/runner.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager, asynccontextmanager
from typing import Any

from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from tenantq.client.finding import Finding
from tenantq.client.operations import JobSpec, Operations
from tenantq.client.runner import AsyncRunner, SyncRunner
from tenantq.client.scheduling import Scheduling
from tenantq.errors import DatabaseUnavailable, TenantqError
from tenantq.store.db import Database, Pool, RecentlyUsed, _first_line, _redact
from tenantq.store.migrate import MigrateReport, migrate

__all__ = ["AsyncQueue", "JobSpec", "Queue"]

POOL_MIN, POOL_MAX = 1, 4


class Queue(SyncRunner, Operations, Finding, Scheduling):
    """Enqueue, wait for and inspect jobs. Thread-safe; holds a small connection pool.

    `Queue()` uses TENANTQ_DATABASE_URL, or the embedded Postgres when unset.
    """

    def __init__(self, dsn: str | None = None, *, schema: str | None = None) -> None:
        self.db = Database.resolve(dsn, schema)
        self._pool: Pool | None = None

    def _pool_connection(self) -> AbstractContextManager[Any]:
        if self._pool is None:
            self._pool = self.db.pool(min_size=POOL_MIN, max_size=POOL_MAX, name="tenantq-queue")
        return self._pool.connection()

    def migrate(self) -> MigrateReport:
        return migrate(self.db)

    def close(self) -> None:
        self._release_listener()
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> Queue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncQueue(AsyncRunner, Operations, Finding, Scheduling):
    """`Queue` for asyncio: the same methods, awaited.

        async with tenantq.AsyncQueue() as q:
            job_id = await q.enqueue("acme", "reports.render", {"month": 9}, conn=aconn)
            info = await q.wait(job_id, timeout=30)

    Its pool belongs to the event loop that first used it: use one
    AsyncQueue per loop.
    """

    def __init__(self, dsn: str | None = None, *, schema: str | None = None) -> None:
        self.db = Database.resolve(dsn, schema)
        self._pool: AsyncConnectionPool[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._recent = RecentlyUsed()

    async def _pool_connection(self) -> AbstractAsyncContextManager[Any]:
        loop = asyncio.get_running_loop()
        if self._pool is None:
            # the first connection fails fast with one line (as Queue's does)
            await asyncio.to_thread(self.db.check)
            pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
                self.db.conninfo, min_size=POOL_MIN, max_size=POOL_MAX, name="tenantq-async-queue",
                kwargs={"autocommit": True, "row_factory": dict_row},
                check=self._recent.acheck, open=False)
            try:
                await pool.open(wait=True, timeout=15)
            except Exception as exc:
                await pool.close()
                raise DatabaseUnavailable(f"cannot connect to Postgres at {self.db.where()} "
                                          f"({self.db.source}): {_redact(_first_line(exc))}") from exc
            self._pool, self._loop = pool, loop
        elif loop is not self._loop:
            raise TenantqError("this AsyncQueue's pool belongs to another event loop: "
                               "make one AsyncQueue per loop")
        return self._stamped(self._pool)

    @asynccontextmanager
    async def _stamped(self, pool: AsyncConnectionPool[Any]) -> AsyncIterator[Any]:
        async with pool.connection() as conn:
            try:
                yield conn
            finally:
                self._recent.stamp(conn)  # its next check is skipped for a while (store/db.py)

    async def migrate(self) -> MigrateReport:
        return await asyncio.to_thread(migrate, self.db)

    async def close(self) -> None:
        self._release_listener()
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def __aenter__(self) -> AsyncQueue:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
