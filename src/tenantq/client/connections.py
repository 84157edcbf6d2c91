"""The caller's connection, for `enqueue(..., conn=...)`: the psycopg
connection under whatever the app holds, so that tenantq's statements run
inside the app's open transaction and commit or roll back with it.

Accepted: psycopg 3 `Connection` / `AsyncConnection`; SQLAlchemy
`Connection` / `Session` / `AsyncConnection` / `AsyncSession` on the
psycopg driver; Django's `django.db.connection` (or `connections[alias]`)
on its psycopg 3 backend. tenantq never commits, rolls back or changes a
setting of these connections: its statements name their schema instead of
relying on search_path (store/queries.py `qualified`). A SQLAlchemy
connection that has not begun a transaction begins one, as any statement
executed through SQLAlchemy would (its autobegin); commit it as usual.

SQLAlchemy and Django are looked up in sys.modules, never imported here:
an object cannot be theirs if its library was never imported.
"""

from __future__ import annotations

import sys
from typing import Any

import psycopg

from tenantq.errors import InvalidInput

ACCEPTED = ("a psycopg Connection, a SQLAlchemy Connection or Session (psycopg driver), "
            "or Django's connection (psycopg 3 backend)")
ACCEPTED_ASYNC = ("a psycopg AsyncConnection, or a SQLAlchemy AsyncConnection or AsyncSession "
                  "(postgresql+psycopg)")


def _is(obj: object, module: str, name: str) -> bool:
    found = sys.modules.get(module)
    cls = getattr(found, name, None) if found is not None else None
    return isinstance(cls, type) and isinstance(obj, cls)


def _driver(raw: Any, what: str) -> Any:
    """The DB-API connection under a SQLAlchemy pool proxy."""
    driver = getattr(raw, "driver_connection", raw)
    if not isinstance(driver, psycopg.Connection | psycopg.AsyncConnection):
        raise InvalidInput(f"{what} is not on the psycopg (3) driver: use a postgresql+psycopg:// URL "
                           f"(got a {type(driver).__module__}.{type(driver).__name__} connection)")
    return driver


def sync_connection(conn: object) -> psycopg.Connection[Any]:
    """The psycopg connection to run tenantq's statements on, in the caller's transaction."""
    if isinstance(conn, psycopg.Connection):
        return conn
    if isinstance(conn, psycopg.AsyncConnection) or _is(conn, "sqlalchemy.ext.asyncio", "AsyncConnection") \
            or _is(conn, "sqlalchemy.ext.asyncio", "AsyncSession"):
        raise InvalidInput(f"conn is an async connection ({type(conn).__name__}): use tenantq.AsyncQueue")
    if _is(conn, "sqlalchemy.orm", "Session"):
        conn = conn.connection()  # type: ignore[attr-defined]  # the session's transaction, begun if need be
    if _is(conn, "sqlalchemy.engine", "Connection"):
        if not conn.in_transaction():  # type: ignore[attr-defined]
            conn.begin()  # type: ignore[attr-defined]  # SQLAlchemy's autobegin, as for its own statements
        driver = _driver(conn.connection, "the SQLAlchemy connection")  # type: ignore[attr-defined]
        if not isinstance(driver, psycopg.Connection):
            raise InvalidInput("conn is an async connection: use tenantq.AsyncQueue")
        return driver
    if _is_django(conn):
        return _django(conn)
    raise InvalidInput(f"conn must be {ACCEPTED}; got {type(conn).__module__}.{type(conn).__name__}")


async def async_connection(conn: object) -> psycopg.AsyncConnection[Any]:
    """`sync_connection` for `AsyncQueue`."""
    if isinstance(conn, psycopg.AsyncConnection):
        return conn
    if _is(conn, "sqlalchemy.ext.asyncio", "AsyncSession"):
        conn = await conn.connection()  # type: ignore[attr-defined]
    if _is(conn, "sqlalchemy.ext.asyncio", "AsyncConnection"):
        if not conn.in_transaction():  # type: ignore[attr-defined]
            await conn.begin()  # type: ignore[attr-defined]
        raw = await conn.get_raw_connection()  # type: ignore[attr-defined]
        driver = _driver(raw, "the SQLAlchemy connection")
        if not isinstance(driver, psycopg.AsyncConnection):
            raise InvalidInput("conn is a sync connection: use tenantq.Queue")
        return driver
    if isinstance(conn, psycopg.Connection) or _is(conn, "sqlalchemy.engine", "Connection") \
            or _is(conn, "sqlalchemy.orm", "Session") or _is_django(conn):
        raise InvalidInput(f"conn is a sync connection ({type(conn).__name__}): use tenantq.Queue")
    raise InvalidInput(f"conn must be {ACCEPTED_ASYNC}; got {type(conn).__module__}.{type(conn).__name__}")


def _is_django(conn: object) -> bool:
    base = sys.modules.get("django.db.backends.base.base")
    if base is None:
        return False
    # django.db.connection is a ConnectionProxy: it forwards attribute access
    # to the alias's wrapper, but is not one itself
    wrapper = getattr(conn, "_connections", None)
    if wrapper is not None and hasattr(conn, "_alias"):
        conn = wrapper[getattr(conn, "_alias")]  # noqa: B009 - a proxy attribute
    return isinstance(conn, base.BaseDatabaseWrapper)


def _django(conn: Any) -> psycopg.Connection[Any]:
    if getattr(conn, "vendor", None) != "postgresql":
        raise InvalidInput(f"conn is Django's {conn.vendor} connection: tenantq needs PostgreSQL")
    # a broken atomic block (an error inside it) refuses every statement, as Django's own would
    conn.validate_no_broken_transaction()
    conn.ensure_connection()
    raw = conn.connection
    if not isinstance(raw, psycopg.Connection):
        raise InvalidInput("conn is Django's psycopg2 connection: tenantq needs the psycopg (3) backend "
                           "(pip install 'psycopg[binary]'; Django 4.2+ picks it up)")
    return raw
