"""Connections: DSN resolution (explicit, env, embedded) and the pool.

Every connection sets search_path to the tenantq schema, so SQL files use
unqualified names and tests can isolate themselves in a schema of their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from tenantq.errors import DatabaseUnavailable
from tenantq.settings import Settings
from tenantq.store.embedded import embedded_dsn

Conn = psycopg.Connection[dict[str, object]]


@dataclass(frozen=True)
class Database:
    """Where tenantq's tables live: a server (DSN) and a schema in it."""

    dsn: str
    schema: str

    @classmethod
    def resolve(cls, dsn: str | None = None, schema: str | None = None) -> Database:
        """Explicit DSN, else TENANTQ_DATABASE_URL, else the embedded server."""
        settings = Settings()
        dsn = dsn or settings.database_url or embedded_dsn(settings.data_dir)
        return cls(dsn=dsn, schema=schema or settings.schema_name)

    @property
    def conninfo(self) -> str:
        params = conninfo_to_dict(self.dsn)
        params["options"] = f"-c search_path={self.schema},public"
        params.setdefault("application_name", "tenantq")
        params.setdefault("connect_timeout", 10)
        return make_conninfo(**params)  # type: ignore[arg-type]

    @property
    def notify_channel(self) -> str:
        return f"tenantq_{self.schema}"

    def connect(self, *, autocommit: bool = True) -> Conn:
        try:
            return psycopg.connect(self.conninfo, autocommit=autocommit, row_factory=dict_row)
        except psycopg.OperationalError as exc:
            raise DatabaseUnavailable(f"cannot connect to Postgres: {_first_line(exc)}") from exc

    def pool(self, *, min_size: int = 1, max_size: int = 4, name: str = "tenantq",
             check: bool = True) -> Pool:
        return Pool(self, min_size=min_size, max_size=max_size, name=name, check=check)


class Pool:
    """A psycopg pool. With `check`, connections are checked before use (one
    round trip), so a Postgres restart costs a reconnect instead of an error;
    the worker passes check=False because every claim and settle already
    retries on a connection error, and the round trip would be paid per batch."""

    def __init__(self, db: Database, *, min_size: int, max_size: int, name: str, check: bool = True) -> None:
        self.db = db
        self._pool: ConnectionPool[Conn] = ConnectionPool(
            db.conninfo,
            min_size=min_size,
            max_size=max_size,
            name=name,
            kwargs={"autocommit": True, "row_factory": dict_row},
            check=ConnectionPool.check_connection if check else None,
            open=False,
        )
        try:
            self._pool.open(wait=True, timeout=15)
        except Exception as exc:
            self._pool.close()
            raise DatabaseUnavailable(f"cannot connect to Postgres: {_first_line(exc)}") from exc

    @contextmanager
    def connection(self) -> Iterator[Conn]:
        with self._pool.connection() as conn:
            yield conn

    def close(self) -> None:
        self._pool.close()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
