"""`ctx.db()`: the application's database, in the job's tenant context.

An inline handler (one that runs in the dispatcher: `--sandbox inline` or
`isolation="inline"`) gets a connection to the *application's* database
(`TENANTQ_APP_DATABASE_URL` or `worker --app-db URL`; not tenantq's store,
even where both live in one Postgres) from a pool the worker owns, inside
a transaction that begins with

    SELECT set_config('app.current_tenant_id', <tenant>, true),
           set_config('app.current_actor', <actor or ''>, true)
    SET LOCAL ROLE <role>                -- with --app-db-role

`set_config(..., true)` is `SET LOCAL` with bound parameters: the values
are data, never SQL. Row-level-security policies on the app's tables check
those settings (docs/tenant-data.md). The transaction commits when the
`with` block ends normally and rolls back when it raises; the settings end
with it. A connection goes back to the pool through `DISCARD ALL`, so
nothing a handler set for its session (`SET ROLE`, a plain `SET` of the
tenant setting, temp tables, prepared statements) reaches the next job.

Sandboxed code never gets a database connection (docs/security.md): in a
sandbox, and on a worker without an application database, `ctx.db()`
raises `NoAppDatabase` (tenantq.errors).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import psycopg
from psycopg import sql
from psycopg_pool import ConnectionPool, PoolTimeout

from tenantq.errors import InvalidInput, TenantqError

log = logging.getLogger("tenantq.tenant_data")

# a custom setting's name: "prefix.name" (Postgres wants the dot for
# settings it does not know); a role: an SQL identifier
_SETTING = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*$")
_ROLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]{0,62}$")
T = TypeVar("T")
# how the pool's connections show in pg_stat_activity
APPLICATION_NAME = "tenantq-app-db"


@dataclass(frozen=True)
class AppDatabaseConfig:
    url: str
    role: str | None = None
    tenant_setting: str = "app.current_tenant_id"
    actor_setting: str = "app.current_actor"
    pool_size: int = 10
    # how long ctx.db() waits for a free connection before it raises
    pool_timeout: float = 30.0

    def __post_init__(self) -> None:
        if not self.url.strip():
            raise InvalidInput("the application database URL is empty")
        for what, name in (("tenant", self.tenant_setting), ("actor", self.actor_setting)):
            if not _SETTING.match(name):
                raise InvalidInput(f"the {what} setting name must look like prefix.name "
                                   f"(letters, digits, _), got {name!r}")
        if self.tenant_setting == self.actor_setting:
            raise InvalidInput(f"the tenant and actor settings must differ, both are {self.tenant_setting!r}")
        if self.role is not None and not _ROLE.match(self.role):
            raise InvalidInput(f"--app-db-role must be an SQL identifier (letters, digits, _, $), "
                               f"got {self.role!r}")
        if not 1 <= self.pool_size <= 1000:
            raise InvalidInput(f"the application database pool size must be 1-1000, got {self.pool_size}")
        if not 0 < self.pool_timeout <= 3600:
            raise InvalidInput(f"the pool timeout must be more than 0 and at most 3600 s, "
                               f"got {self.pool_timeout:g}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _reset(conn: psycopg.Connection[Any]) -> None:
    # back in the pool, outside any transaction: forget the session's state
    conn.execute("DISCARD ALL")


class AppDatabase:
    """The worker's pool on the application's database."""

    def __init__(self, config: AppDatabaseConfig) -> None:
        self.config = config
        # autocommit: the session's transaction is the explicit one
        # session() opens, and DISCARD ALL (which cannot run in one) resets
        # between them; prepare_threshold=None: DISCARD ALL drops server-side
        # prepared statements, which psycopg would otherwise believe still exist
        self.pool: ConnectionPool[psycopg.Connection[Any]] = ConnectionPool(
            config.url, min_size=1, max_size=config.pool_size, open=False, name="tenantq-app-db",
            timeout=config.pool_timeout, reset=_reset,
            kwargs={"autocommit": True, "prepare_threshold": None, "application_name": APPLICATION_NAME})
        self.bypasses_rls: bool | None = None

    def open(self, timeout: float = 10.0) -> AppDatabase:
        """Connect (one line if it cannot), and say once when the effective
        role bypasses row-level security (superuser or BYPASSRLS): then the
        policies protect nothing and isolation rests on the queries alone."""
        try:
            # one connection first: its error is the reason, in one line (the
            # pool would retry it in the background, logging each attempt)
            psycopg.connect(self.config.url, connect_timeout=max(1, round(timeout))).close()
            self.pool.open(wait=True, timeout=timeout)
        except (psycopg.Error, PoolTimeout) as exc:
            self.pool.close()
            raise TenantqError(f"cannot connect to the application database (TENANTQ_APP_DATABASE_URL / "
                               f"--app-db): {_first_line(exc)}") from None
        try:
            with self.session("", None) as conn:
                row = conn.execute("SELECT rolsuper OR rolbypassrls, current_user FROM pg_roles "
                                   "WHERE rolname = current_user").fetchone()
        except psycopg.Error as exc:
            self.pool.close()
            raise TenantqError(f"the application database refused the tenant context: {_first_line(exc)}"
                               ) from None
        self.bypasses_rls = bool(row and row[0])
        if self.bypasses_rls:
            log.warning("ctx.db(): role %s bypasses row-level security (superuser or BYPASSRLS); "
                        "use --app-db-role with a role that does not (docs/tenant-data.md)",
                        row[1] if row else "?")
        return self

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> AppDatabase:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def session(self, tenant: str, actor: str | None) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection in a transaction scoped to `tenant` and `actor`."""
        cfg = self.config
        with self.pool.connection() as conn, conn.transaction():
            conn.execute("SELECT set_config(%s, %s, true), set_config(%s, %s, true)",
                         (cfg.tenant_setting, tenant, cfg.actor_setting, actor or ""))
            if cfg.role is not None:
                conn.execute(sql.SQL("SET LOCAL ROLE {}").format(sql.Identifier(cfg.role)))
            yield conn


class TenantDb:
    """What `ctx.db()` returns: `with ctx.db() as conn:` (a psycopg
    `Connection`) or, in an `async def` handler, `async with ctx.db() as
    conn:` (an `AsyncTenantConnection`: the same pooled connection, its
    calls run in a thread so the event loop is not blocked)."""

    def __init__(self, database: AppDatabase, tenant: str, actor: str | None) -> None:
        self._database = database
        self._tenant, self._actor = tenant, actor
        self._session: Any = None

    def _open(self) -> psycopg.Connection[Any]:
        if self._session is not None:
            raise TenantqError("ctx.db() was entered twice; call ctx.db() once per `with` block")
        self._session = self._database.session(self._tenant, self._actor)
        conn: psycopg.Connection[Any] = self._session.__enter__()
        return conn

    def _close(self, kind: type[BaseException] | None, exc: BaseException | None,
               tb: TracebackType | None) -> None:
        session, self._session = self._session, None
        session.__exit__(kind, exc, tb)

    def __enter__(self) -> psycopg.Connection[Any]:
        return self._open()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._close(kind, exc, tb)

    async def __aenter__(self) -> AsyncTenantConnection:
        return AsyncTenantConnection(await asyncio.to_thread(self._open))

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await asyncio.to_thread(self._close, kind, exc, tb)


class AsyncTenantConnection:
    """The tenant-scoped connection for `async def` handlers. `execute`
    returns a psycopg `Cursor` whose rows are already fetched (`fetchall()`
    does no I/O); `run(fn)` runs `fn(connection)` in a thread for anything
    else (copy, pipelines)."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.connection = conn

    async def execute(self, query: Any, params: Any = None) -> psycopg.Cursor[Any]:
        return await asyncio.to_thread(self.connection.execute, query, params)

    async def run(self, fn: Callable[[psycopg.Connection[Any]], T]) -> T:
        return await asyncio.to_thread(fn, self.connection)
