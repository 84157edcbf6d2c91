"""PgQueuer's side of `./run bench producers` (bench/producers.py), run in the peers' venv.

Usage: ``bench/peers/.venv/bin/python bench/peers/pgqueuer_producers.py --dsn URL --schema NAME``.
It installs PgQueuer's schema into schema NAME (``PGQUEUER_SCHEMA``, PgQueuer's own setting; the
caller creates no objects there and drops the schema afterwards), then serves requests: one JSON
object per line on stdin, one JSON answer per line on stdout (logs on stderr):

- ``{"op": "percall", "driver": D, "n": N}``: N enqueues of one job, one call each, on one
  autocommit connection, after 50 unmeasured; answers ``{"ms": per call}``;
- ``{"op": "cell", "driver": D, "cell": {...}}``: concurrent producers (producerlib.Cell), each
  transaction ``BEGIN; Queries.enqueue(...); COMMIT`` on the producer's own connection, with
  work_ms of sleep before or after the enqueue; answers producerlib.measure's figures;
- ``{"op": "quit"}``.

Drivers D, as PgQueuer's README and API offer them: ``asyncpg`` (``Queries(AsyncpgDriver(conn))`` on
uvloop, as ``pgq run`` runs), ``psycopg-async`` (``Queries(PsycopgDriver(conn))`` on an autocommit
``psycopg.AsyncConnection``, uvloop) and ``psycopg-sync`` (``SyncQueries(SyncPsycopgDriver(conn))`` on an
autocommit ``psycopg.Connection``; producers are threads).

In a transaction: PgQueuer has no transaction API of its own; its ``Queries`` runs its one INSERT
statement on the connection it is given, so a transaction the caller began on that connection
(asyncpg ``conn.transaction()``, psycopg ``conn.transaction()``) holds the job, and its NOTIFY (a row
trigger) is sent at COMMIT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from importlib.metadata import version
from typing import Any

import asyncpg  # type: ignore[import-untyped]  # no stubs
import psycopg
import uvloop
from pgqueuer import Queries
from pgqueuer.db import AsyncpgDriver, PsycopgDriver, SyncPsycopgDriver
from pgqueuer.queries import SyncQueries
from producerlib import AsyncOpened, Cell, Transaction, measure, payload, run_tasks, run_threads

ENTRYPOINT = "bench"
DRIVERS = ("asyncpg", "psycopg-async", "psycopg-sync")
WARM_CALLS = 50


def encode(tenant: str, seq: int) -> bytes:
    return json.dumps(payload(tenant, seq)).encode()


async def _open_async(dsn: str, driver: str) -> tuple[Any, Queries, Callable[[], Awaitable[None]]]:
    """(connection, Queries on it, close) for an async driver."""
    if driver == "asyncpg":
        conn = await asyncpg.connect(dsn)
        return conn, Queries(AsyncpgDriver(conn)), conn.close
    aconn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    return aconn, Queries(PsycopgDriver(aconn)), aconn.close


def _open_sync(dsn: str) -> tuple[psycopg.Connection[Any], SyncQueries]:
    conn = psycopg.connect(dsn, autocommit=True)
    return conn, SyncQueries(SyncPsycopgDriver(conn))


# --- one enqueue per call ---------------------------------------------------------------------------


async def _percall_async(dsn: str, driver: str, n: int) -> float:
    _, queries, close = await _open_async(dsn, driver)
    try:
        body = encode("t1", 1)
        for _ in range(min(WARM_CALLS, n)):
            await queries.enqueue(ENTRYPOINT, body)
        t0 = time.perf_counter()
        for _ in range(n):
            await queries.enqueue(ENTRYPOINT, body)
        return (time.perf_counter() - t0) / n * 1e3
    finally:
        await close()


def percall(dsn: str, driver: str, n: int) -> float:
    if driver != "psycopg-sync":
        ms: float = uvloop.run(_percall_async(dsn, driver, n))
        return ms
    conn, queries = _open_sync(dsn)
    with conn:
        body = encode("t1", 1)
        for _ in range(min(WARM_CALLS, n)):
            queries.enqueue(ENTRYPOINT, body)
        t0 = time.perf_counter()
        for _ in range(n):
            queries.enqueue(ENTRYPOINT, body)
        return (time.perf_counter() - t0) / n * 1e3


# --- concurrent producers ---------------------------------------------------------------------------


def producers(config: dict[str, Any], cell: Cell, slots: list[int], counters: Any, go: Any, stop: Any,
              ready: Any) -> None:
    """producerlib.Runner: the slots' producers, threads or uvloop tasks by driver."""
    dsn, driver = config["dsn"], config["driver"]
    before, after = cell.work_s()
    if driver == "psycopg-sync":
        def open_sync(slot: int) -> tuple[Transaction, Callable[[], None]]:
            conn, queries = _open_sync(dsn)

            def transaction(tenant: str, seq: int) -> None:
                with conn.transaction():
                    if before:
                        time.sleep(before)
                    queries.enqueue(ENTRYPOINT, encode(tenant, seq))
                    if after:
                        time.sleep(after)
            return transaction, conn.close
        run_threads(open_sync, cell, slots, counters, go, stop, ready)
        return

    async def open_async(slot: int) -> AsyncOpened:
        conn, queries, close = await _open_async(dsn, driver)

        async def transaction(tenant: str, seq: int) -> None:
            async with conn.transaction():
                if before:
                    await asyncio.sleep(before)
                await queries.enqueue(ENTRYPOINT, encode(tenant, seq))
                if after:
                    await asyncio.sleep(after)
        return transaction, close
    uvloop.run(run_tasks(open_async, cell, slots, counters, go, stop, ready))


# --- serving ----------------------------------------------------------------------------------------


async def _install(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await Queries(AsyncpgDriver(conn)).install()
    finally:
        await conn.close()


def serve(dsn: str) -> None:
    uvloop.run(_install(dsn))
    print(json.dumps({"ok": True, "version": version("pgqueuer"), "asyncpg": version("asyncpg"),
                      "psycopg": version("psycopg")}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        if op == "quit":
            break
        if request.get("driver") not in DRIVERS:
            raise SystemExit(f"unknown driver {request.get('driver')!r}")
        if op == "percall":
            answer: dict[str, Any] = {"ms": percall(dsn, request["driver"], int(request["n"]))}
        elif op == "cell":
            answer = measure(producers, {"dsn": dsn, "driver": request["driver"]}, Cell(**request["cell"]))
        else:
            raise SystemExit(f"unknown op {op!r}")
        print(json.dumps(answer), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="pgqueuer_producers.py")
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--schema", required=True, help="PgQueuer's objects go here (PGQUEUER_SCHEMA)")
    args = parser.parse_args()
    # read by PgQueuer's DBSettings whenever Queries is made, here and in spawned producer processes
    os.environ["PGQUEUER_SCHEMA"] = args.schema
    serve(args.dsn)


if __name__ == "__main__":
    main()
