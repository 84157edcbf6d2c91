"""One statement through libpq's own prepared-statement call, past
psycopg's cursor: the one-job enqueue, a producer's hot path (issue
"producer-path"). psycopg's cursor costs about a tenth of a millisecond of
Python per statement on the machines measured, as much as a third of an
enqueue's time on a fast server; libpq's blocking `PQexecPrepared` (called
through psycopg's `pgconn`, which releases the GIL while it waits) does the
same round trip without it (docs/benchmarks.md, "Producers").

Used only where that is safe, else the caller runs the statement on a
cursor as usual (`execute` returns None):
- the connection allows prepared statements (`prepare_threshold` is not
  None: psycopg's own switch, which a caller behind an old transaction-
  pooling PgBouncer turns off) and is not in pipeline mode; its lock is
  held throughout, as psycopg holds it for its own statements;
- it is idle in autocommit: no transaction is open or begun by the
  statement, so a failure aborts nothing, and a statement the server no
  longer knows is prepared again and run once more. Not inside a
  transaction: there that error would abort the caller's transaction, and
  it happens in ordinary use, not only after a `DISCARD ALL` or a pooler's
  switch of server connection: psycopg sends `DEALLOCATE ALL` when a
  transaction in which it prepared statements of its own rolls back
  (found by tests/integration/test_producer_path.py's many producers);
- the statement never waits for a lock (a blocking libpq call cannot be
  interrupted by Ctrl-C): the one-job enqueue without an idempotency key
  (with one, it may wait for another producer's uncommitted job).

Parameters go as UTF-8 text (a connection with another client_encoding
takes the cursor) with their types left to the server, which takes
them from the statement (a column, a cast), so one prepared statement
serves every value; results come back as text.
"""

from __future__ import annotations

import hashlib
import json
import re
import weakref
from collections.abc import Mapping
from datetime import datetime
from functools import cache
from typing import Any

import psycopg
from psycopg import pq
from psycopg.errors import DuplicatePreparedStatement, InvalidSqlStatementName, error_from_result
from psycopg.types.json import Jsonb

_NAMED = re.compile(r"%\((\w+)\)s")

# statements prepared on each connection, by name (the server forgets them
# when the connection closes, and so does this map)
_known: weakref.WeakKeyDictionary[psycopg.Connection[Any], set[bytes]] = weakref.WeakKeyDictionary()


@cache
def _positional(text: str) -> tuple[bytes, bytes, tuple[str, ...]]:
    """`%(name)s` placeholders as `$n`: the statement's name, its text and
    the parameter names in `$n` order."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    sql = _NAMED.sub(number, text)
    if "%" in sql:
        raise ValueError("a statement run through libpq directly has only %(name)s placeholders")
    return b"tenantq_" + hashlib.sha256(sql.encode()).hexdigest()[:20].encode(), sql.encode(), tuple(names)


def _as_text(value: object) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bool):
        return b"t" if value else b"f"
    if isinstance(value, int | float):  # floats are finite: validation refuses NaN and infinity
        return repr(value).encode()
    if isinstance(value, datetime):
        return value.isoformat().encode()
    if isinstance(value, Jsonb):
        dumped = (value.dumps or json.dumps)(value.obj)
        return dumped if isinstance(dumped, bytes) else dumped.encode()
    raise TypeError(f"no text form for a parameter of type {type(value).__name__}")


def execute(conn: psycopg.Connection[Any], text: str,
            params: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """Run `text` with `params` through libpq's prepared-statement call and
    return its rows (values as text), or None where that is not safe (see
    the module docstring): the caller then uses a cursor."""
    name, sql, names = _positional(text)
    values = [_as_text(params[n]) for n in names]
    with conn.lock:
        pgconn = conn.pgconn
        if not conn.autocommit or pgconn.transaction_status != pq.TransactionStatus.IDLE or \
                conn.prepare_threshold is None or pgconn.pipeline_status != pq.PipelineStatus.OFF or \
                pgconn.parameter_status(b"client_encoding") != b"UTF8":  # the text is sent as UTF-8
            return None
        known = _known.get(conn)
        if known is None:
            known = _known[conn] = set()
        for attempt in (1, 2):
            if name not in known:
                _prepare(conn, name, sql)
                known.add(name)
            # None is SQL NULL (as psycopg passes it; the stub says otherwise)
            result = pgconn.exec_prepared(name, values)  # type: ignore[arg-type]
            if result.status in (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK):
                return _rows(conn, result)
            error = _error(conn, result)
            if isinstance(error, InvalidSqlStatementName) and attempt == 1:
                known.discard(name)  # forgotten by the server: prepare it again
                continue
            raise error
    raise AssertionError("unreachable")


def _prepare(conn: psycopg.Connection[Any], name: bytes, sql: bytes) -> None:
    result = conn.pgconn.prepare(name, sql)  # no types: the server takes them from the statement
    if result.status == pq.ExecStatus.COMMAND_OK:
        return
    error = _error(conn, result)
    # the server session already has it (a pooler's server connection that
    # served this name before): the same name is the same text
    if not isinstance(error, DuplicatePreparedStatement):
        raise error


def _error(conn: psycopg.Connection[Any], result: pq.abc.PGresult) -> psycopg.Error:
    """The exception psycopg's cursor raises for this result: a lost
    connection is an OperationalError (what the pool and the worker's
    retries look for), not a bare DatabaseError."""
    if conn.pgconn.status == pq.ConnStatus.BAD:
        message = (result.error_message or b"the connection to the server was lost").decode(errors="replace")
        return psycopg.OperationalError(message.strip())
    return error_from_result(result, encoding="utf-8")


def _rows(conn: psycopg.Connection[Any], result: pq.abc.PGresult) -> list[dict[str, Any]]:
    if result.status != pq.ExecStatus.TUPLES_OK:
        return []
    columns = [(result.fname(i) or b"").decode() for i in range(result.nfields)]
    rows = []
    for row in range(result.ntuples):
        values = [result.get_value(row, i) for i in range(result.nfields)]
        rows.append({c: None if v is None else bytes(v).decode()
                     for c, v in zip(columns, values, strict=True)})
    return rows
