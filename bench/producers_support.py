"""The systems of `./run bench producers` (bench/producers.py): how each one enqueues, per call and
in concurrent producers' transactions.

- tenantq: `Queue.enqueue` / `AsyncQueue.enqueue`, on the queue's own pool (per call) or with
  `conn=` the producer's own psycopg connection (in its transaction);
- bare: `INSERT INTO jobs ... RETURNING id` + `pg_notify` on a plain psycopg connection, into a
  copy of tenantq's jobs table (`LIKE ... INCLUDING ALL`: its columns, defaults, checks and
  indexes; no foreign key, no tenants or queues rows) in a schema of its own;
- PgQueuer: bench/peers/pgqueuer_producers.py in the peers' venv, driven over a pipe (`PgQueuer`).

The producers of a cell run under bench/peers/producerlib.py, the same procedure for all three.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql as pgsql

from bench.peers.producerlib import Cell, Transaction, payload, run_threads
from tenantq import AsyncQueue, Queue
from tenantq.store.db import Database

KIND = "bench.noop"
WARM_CALLS = 50
PEERS_DIR = Path(__file__).resolve().parent / "peers"

# the bare baseline's enqueue: one statement, one round trip (its NOTIFY is sent at commit)
BARE_ONE = """
WITH i AS (INSERT INTO {s}.jobs (tenant_id, kind, payload, priority, max_attempts, run_after, created_at)
           VALUES (%s, %s, %s::jsonb, 'default', 5, now(), now()) RETURNING id),
     n AS (SELECT pg_notify(%s, ''))
SELECT id FROM i, n
"""
BARE_INSERT = ("INSERT INTO {s}.jobs (tenant_id, kind, payload, priority, max_attempts, run_after, "
               "created_at) VALUES (%s, %s, %s::jsonb, 'default', 5, now(), now()) RETURNING id")


def bare_schema(tenantq_db: Database, schema: str) -> dict[str, str]:
    """Create the bare baseline's schema: a copy of tenantq's jobs table. Its statements."""
    with psycopg.connect(tenantq_db.dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("CREATE SCHEMA {}").format(pgsql.Identifier(schema)))
        conn.execute(pgsql.SQL("CREATE TABLE {}.jobs (LIKE {}.jobs INCLUDING ALL)").format(
            pgsql.Identifier(schema), pgsql.Identifier(tenantq_db.schema)))
    s = f'"{schema}"'
    return {"one": BARE_ONE.replace("{s}", s), "insert": BARE_INSERT.replace("{s}", s),
            "channel": f"bare_{schema}"[:63]}


def drop_schema(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(pgsql.Identifier(schema)))


def _timed(call: Callable[[], Any], n: int) -> float:
    """ms per call of `call`, after WARM_CALLS unmeasured ones."""
    for _ in range(min(WARM_CALLS, n)):
        call()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - t0) / n * 1e3


# --- one enqueue per call ---------------------------------------------------------------------------


def percall_tenantq(queue: Queue, n: int, *, conn: psycopg.Connection[Any] | None = None) -> float:
    """`conn`: None for the queue's own pool, else the caller's (autocommit) connection."""
    body = payload("t1", 1)
    if conn is None:
        return _timed(lambda: queue.enqueue("t1", KIND, body), n)
    return _timed(lambda: queue.enqueue("t1", KIND, body, conn=conn), n)


async def _percall_tenantq_async(db: Database, n: int) -> float:
    body = payload("t1", 1)
    async with AsyncQueue(db.dsn, schema=db.schema) as queue:
        for _ in range(min(WARM_CALLS, n)):
            await queue.enqueue("t1", KIND, body)
        t0 = time.perf_counter()
        for _ in range(n):
            await queue.enqueue("t1", KIND, body)
        return (time.perf_counter() - t0) / n * 1e3


def percall_tenantq_async(db: Database, n: int) -> float:
    return asyncio.run(_percall_tenantq_async(db, n))


def percall_bare(conn: psycopg.Connection[Any], statements: dict[str, str], form: str, n: int) -> float:
    """`form`: "one" (INSERT ... RETURNING and pg_notify in one statement), "pipeline" (BEGIN; INSERT
    ... RETURNING; NOTIFY; COMMIT in one pipelined round trip) or "insert" (no NOTIFY: a reference)."""
    args = ("t1", KIND, json.dumps(payload("t1", 1)))
    channel = statements["channel"]
    if form == "one":
        return _timed(lambda: conn.execute(statements["one"], (*args, channel), prepare=True).fetchone(), n)
    if form == "insert":
        return _timed(lambda: conn.execute(statements["insert"], args, prepare=True).fetchone(), n)
    notify = f'NOTIFY "{channel}"'

    def pipelined() -> None:
        with conn.pipeline():
            conn.execute("BEGIN")
            cur = conn.execute(statements["insert"], args, prepare=True)
            conn.execute(notify)
            conn.execute("COMMIT")
        cur.fetchone()
    return _timed(pipelined, n)


async def _percall_bare_async(dsn: str, statements: dict[str, str], n: int) -> float:
    args = ("t1", KIND, json.dumps(payload("t1", 1)), statements["channel"])
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for _ in range(min(WARM_CALLS, n)):
            await (await conn.execute(statements["one"], args, prepare=True)).fetchone()
        t0 = time.perf_counter()
        for _ in range(n):
            await (await conn.execute(statements["one"], args, prepare=True)).fetchone()
        return (time.perf_counter() - t0) / n * 1e3


def percall_bare_async(dsn: str, statements: dict[str, str], n: int) -> float:
    return asyncio.run(_percall_bare_async(dsn, statements, n))


# --- concurrent producers (producerlib.Runner) -----------------------------------------------------


def tenantq_producers(config: dict[str, Any], cell: Cell, slots: list[int], counters: Any, go: Any,
                      stop: Any, ready: Any) -> None:
    """Each producer: its own psycopg connection; `with conn.transaction(): q.enqueue(...,
    conn=conn)` with the sleep before or after it; one Queue per process (its pool is not used:
    every enqueue is on `conn`)."""
    queue = Queue(config["dsn"], schema=config["schema"])
    before, after = cell.work_s()

    def open_producer(slot: int) -> tuple[Transaction, Callable[[], None]]:
        conn = psycopg.connect(config["dsn"], autocommit=True)

        def transaction(tenant: str, seq: int) -> None:
            with conn.transaction():
                if before:
                    time.sleep(before)
                queue.enqueue(tenant, KIND, payload(tenant, seq), conn=conn)
                if after:
                    time.sleep(after)
        return transaction, conn.close
    try:
        run_threads(open_producer, cell, slots, counters, go, stop, ready)
    finally:
        queue.close()


def bare_producers(config: dict[str, Any], cell: Cell, slots: list[int], counters: Any, go: Any,
                   stop: Any, ready: Any) -> None:
    """Each producer: `with conn.transaction(): INSERT ... RETURNING id + pg_notify` (one prepared
    statement, BARE_ONE), with the sleep before or after it."""
    statement, channel = config["one"], config["channel"]
    before, after = cell.work_s()

    def open_producer(slot: int) -> tuple[Transaction, Callable[[], None]]:
        conn = psycopg.connect(config["dsn"], autocommit=True)

        def transaction(tenant: str, seq: int) -> None:
            with conn.transaction():
                if before:
                    time.sleep(before)
                conn.execute(statement, (tenant, KIND, json.dumps(payload(tenant, seq)), channel),
                             prepare=True).fetchone()
                if after:
                    time.sleep(after)
        return transaction, conn.close
    run_threads(open_producer, cell, slots, counters, go, stop, ready)


# --- PgQueuer, in the peers' venv ---------------------------------------------------------------------


class PgQueuer:
    """bench/peers/pgqueuer_producers.py, serving requests over a pipe; its schema is `schema`."""

    def __init__(self, dsn: str, schema: str) -> None:
        python = PEERS_DIR / ".venv" / "bin" / "python"
        if not python.exists():
            subprocess.run(["python3", str(PEERS_DIR / "setup.py")], check=True, stdout=subprocess.DEVNULL)
        self.proc = subprocess.Popen([str(python), str(PEERS_DIR / "pgqueuer_producers.py"), "--dsn", dsn,
                                      "--schema", schema], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=sys.stderr, text=True, cwd=PEERS_DIR)
        self.versions = self._answer()

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"pgqueuer_producers.py ended (exit code {self.proc.wait()})")
        return dict(json.loads(line))

    def request(self, **request: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.request_quit()
                self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()

    def request_quit(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.proc.stdin.close()
