"""Store operations written once, run on a sync or an async connection.

An operation is a generator that yields `Query` (and `Copy`) steps and
receives each one's rows; it does no I/O itself (sans-I/O, as psycopg's own internals
are written). `run` executes the steps on a `psycopg.Connection`, `arun` on
a `psycopg.AsyncConnection`: the SQL, the parameters and the decisions
between statements exist once, and `tenantq.Queue` and `tenantq.AsyncQueue`
are two drivers of the same operations (client/runner.py adds the steps
that wait for a notification).

Each statement runs on a cursor of tenantq's own (`psycopg.Cursor(conn)`,
rows as dicts, tenantq's JSON loader), never the connection's
cursor_factory or row_factory: on a caller's connection (Django's, say,
which loads jsonb as text and binds parameters client-side) tenantq's
statements behave as on its own.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from psycopg import pq
from psycopg import sql as pgsql
from psycopg.rows import dict_row
from psycopg.types.json import set_json_loads

from tenantq.store import prepared

T = TypeVar("T")
Rows = list[dict[str, Any]]


@dataclass(frozen=True)
class Query:
    """One statement and its parameters; the step's answer is its rows
    ([] for a statement that returns none)."""

    text: str | pgsql.Composable
    params: Mapping[str, Any] | None = None
    # no json or jsonb column among its results: run on a cursor without
    # tenantq's json loader (setting it costs a copy of the adapters map,
    # a tenth of a one-job enqueue's time in Python)
    plain: bool = False
    # run through libpq's prepared-statement call where that is safe
    # (store/prepared.py: an idle connection, a statement that waits for
    # no lock); its values then come back as text
    direct: bool = False


@dataclass(frozen=True)
class Copy:
    """`COPY ... FROM STDIN (FORMAT binary)` of `rows`, whose columns have
    the Postgres `types`; the step's answer is [] (COPY returns no rows)."""

    text: str | pgsql.Composable
    types: Sequence[str]
    rows: Iterable[Sequence[Any]]


# an operation: yields Query (and, in client/, other steps), returns T
Steps = Generator[Any, Any, T]


def readable_json(text: str | bytes) -> Any:
    """jsonb as read by tenantq: a value Python cannot decode (a payload
    stored before enqueue refused deep nesting) shows as a note, never a crash."""
    try:
        return json.loads(text)
    except RecursionError:
        return {"undecodable": "nested too deeply to show"}


def cursor(conn: psycopg.Connection[Any], *, plain: bool = False) -> psycopg.Cursor[dict[str, Any]]:
    cur = psycopg.Cursor(conn, row_factory=dict_row)
    if not plain:
        set_json_loads(readable_json, cur)
    return cur


def async_cursor(conn: psycopg.AsyncConnection[Any], *,
                 plain: bool = False) -> psycopg.AsyncCursor[dict[str, Any]]:
    cur = psycopg.AsyncCursor(conn, row_factory=dict_row)
    if not plain:
        set_json_loads(readable_json, cur)
    return cur


def execute(conn: psycopg.Connection[Any], step: Query | Copy) -> Rows:
    if isinstance(step, Query) and step.direct and isinstance(step.text, str) and step.params is not None:
        rows = prepared.execute(conn, step.text, step.params)
        if rows is not None:
            return rows
    with cursor(conn, plain=isinstance(step, Query) and step.plain) as cur:
        if isinstance(step, Copy):
            with cur.copy(step.text) as copy:  # type: ignore[arg-type]  # text is from the .sql files
                copy.set_types(list(step.types))
                for row in step.rows:
                    copy.write_row(row)
            return []
        cur.execute(step.text, step.params)  # type: ignore[arg-type]
        return cur.fetchall() if _has_rows(cur) else []


async def async_execute(conn: psycopg.AsyncConnection[Any], step: Query | Copy) -> Rows:
    async with async_cursor(conn, plain=isinstance(step, Query) and step.plain) as cur:
        if isinstance(step, Copy):
            async with cur.copy(step.text) as copy:  # type: ignore[arg-type]
                copy.set_types(list(step.types))
                for row in step.rows:
                    await copy.write_row(row)
            return []
        await cur.execute(step.text, step.params)  # type: ignore[arg-type]
        return await cur.fetchall() if _has_rows(cur) else []


def _has_rows(cur: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any]) -> bool:
    # not `cur.description is not None`: that builds a Column per column
    # on every call (a tenth of a one-job enqueue's Python time)
    result = cur.pgresult
    return result is not None and result.status == pq.ExecStatus.TUPLES_OK


def run(conn: psycopg.Connection[Any], steps: Steps[T], *, atomic: bool = False) -> T:
    """Run an operation of Query steps on `conn`; with `atomic`, in one
    transaction (a savepoint inside the caller's, if one is open)."""
    if atomic:
        with conn.transaction():
            return run(conn, steps)
    try:
        step = next(steps)
        while True:
            if not isinstance(step, Query | Copy):
                raise TypeError(f"store.steps.run runs Query and Copy steps only, got {type(step).__name__}")
            try:
                rows = execute(conn, step)
            except psycopg.Error as exc:
                # the operation may turn a database error into a one-line one
                step = steps.throw(exc)
            else:
                step = steps.send(rows)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
