"""The one-job enqueue through libpq's prepared-statement call
(store/prepared.py): taken only on an idle autocommit connection and for a
job without a key; what it writes is what the cursor path writes; a
statement the server forgot is prepared again; errors are the ones the
cursor path raises."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from tenantq import Queue
from tenantq.errors import TenantqError
from tenantq.store.db import Database


@pytest.fixture
def caller(db: Database) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        yield conn


def _ours(conn: psycopg.Connection[Any]) -> list[str]:
    """tenantq's statements prepared on this session (psycopg's own are named _pg3_*)."""
    rows = conn.execute("SELECT name FROM pg_prepared_statements WHERE name LIKE 'tenantq%' "
                        "ORDER BY name").fetchall()
    return [str(r[0]) for r in rows]


def _exists(db: Database, job_id: int) -> bool:
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        row = conn.execute(f'SELECT count(*) FROM "{db.schema}".jobs WHERE id = %s', (job_id,)).fetchone()
        return row is not None and row[0] == 1


def _job(db: Database, job_id: int) -> dict[str, Any]:
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        conn.execute(f'SET search_path TO "{db.schema}"')
        cur = conn.cursor(row_factory=psycopg.rows.dict_row)
        row = cur.execute("SELECT tenant_id, kind, payload, priority, max_attempts, run_after, created_at, "
                          "idempotency_key, actor, meta FROM jobs WHERE id = %s", (job_id,)).fetchone()
        assert row is not None, f"job {job_id} was not written"
        return row


def test_an_idle_autocommit_connection_takes_the_prepared_call(queue: Queue, db: Database,
                                                               caller: psycopg.Connection[Any]) -> None:
    assert _ours(caller) == []
    first = queue.enqueue("acme", "demo.hello", {"n": 1}, conn=caller)
    assert len(_ours(caller)) == 1
    second = queue.enqueue("acme", "demo.hello", {"n": 2}, conn=caller)
    assert len(_ours(caller)) == 1, "prepared once per connection"
    assert second > first
    assert _job(db, second)["payload"] == {"n": 2}


def test_psycopgs_rollback_forgets_its_statements_so_a_transaction_takes_the_cursor(
    queue: Queue, db: Database, caller: psycopg.Connection[Any]
) -> None:
    """psycopg sends DEALLOCATE ALL when a transaction in which it prepared
    statements rolls back; a prepared statement of tenantq's inside the
    next transaction would then abort it. So inside one: the cursor."""
    queue.enqueue("acme", "demo.hello", {"n": 0}, conn=caller)  # prepared, idle
    for n in range(3):
        with caller.transaction():
            for _ in range(6):  # psycopg prepares a statement run 5 times
                caller.execute("SELECT 1 + %s", (n,))
            queue.enqueue("acme", "demo.hello", {"n": n}, conn=caller)
            raise psycopg.Rollback  # rolled back by the block, not raised
    with caller.transaction():
        held = queue.enqueue("acme", "demo.hello", {"n": "kept"}, conn=caller)
        assert not _exists(db, held), "visible before the commit"
    assert _exists(db, held)
    idle = queue.enqueue("acme", "demo.hello", {"n": "idle"}, conn=caller)
    assert _job(db, idle)["payload"] == {"n": "idle"}


def test_where_it_is_not_safe_the_cursor(queue: Queue, db: Database) -> None:
    with psycopg.connect(db.dsn) as conn:  # not autocommit: the enqueue begins the caller's transaction
        job = queue.enqueue("acme", "demo.hello", {"n": 1}, conn=conn)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        assert _ours(conn) == []
        conn.rollback()
    assert not _exists(db, job)
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        keyed = queue.enqueue("acme", "demo.hello", {"n": 1}, key="k1", conn=conn)
        assert _ours(conn) == [], "a keyed job may wait for another producer's: never a blocking call"
        assert queue.enqueue("acme", "demo.hello", {"n": 2}, key="k1", conn=conn) == keyed
    with psycopg.connect(db.dsn, autocommit=True, prepare_threshold=None) as conn:
        queue.enqueue("acme", "demo.hello", {"n": 1}, conn=conn)
        assert _ours(conn) == [], "prepare_threshold=None: no prepared statements on this connection"
    with psycopg.connect(db.dsn, autocommit=True, client_encoding="LATIN1") as conn:
        job = queue.enqueue("acme", "demo.hello", {"name": "Jose"}, conn=conn)
        assert _ours(conn) == [], "another client_encoding: the cursor, which encodes for it"
    assert _job(db, job)["payload"] == {"name": "Jose"}


def test_every_field_is_written_as_by_the_cursor(queue: Queue, db: Database,
                                                 caller: psycopg.Connection[Any]) -> None:
    now = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    fields: dict[str, Any] = {"priority": "interactive", "max_attempts": 1000, "delay": 12.5,
                              "actor": "user-7", "meta": {"request": "r1", "ok": True}, "now": now}
    direct = queue.enqueue("acme", "demo.hello", {"é": [1, 2.5, None]}, conn=caller, **fields)
    with psycopg.connect(db.dsn) as tx:  # the cursor path, in a transaction
        by_cursor = queue.enqueue("acme", "demo.hello", {"é": [1, 2.5, None]}, conn=tx, **fields)
        tx.commit()
    a, b = _job(db, direct), _job(db, by_cursor)
    assert a == b
    assert a["run_after"] == now + timedelta(seconds=12.5)
    assert a["created_at"] == now
    assert (a["max_attempts"], a["actor"], a["meta"]) == (1000, "user-7", {"request": "r1", "ok": True})


def test_a_forgotten_statement_is_prepared_again(queue: Queue, db: Database,
                                                 caller: psycopg.Connection[Any]) -> None:
    queue.enqueue("acme", "demo.hello", {"n": 1}, conn=caller)
    for forget in ("DEALLOCATE ALL", "DISCARD ALL"):
        caller.execute(forget)
        assert _ours(caller) == []
        job = queue.enqueue("acme", "demo.hello", {"forgot": forget}, conn=caller)
        assert _job(db, job)["payload"] == {"forgot": forget}
        assert len(_ours(caller)) == 1


def test_errors_are_the_cursor_paths(queue: Queue, db: Database, caller: psycopg.Connection[Any]) -> None:
    with Queue(db.dsn, schema="tenantq_no_such_schema") as missing:
        with pytest.raises(TenantqError, match="tenantq tables not found"):
            missing.enqueue("acme", "demo.hello", {"n": 1})
        with psycopg.connect(db.dsn, autocommit=True) as other:
            with pytest.raises(TenantqError, match="tenantq tables not found"):
                missing.enqueue("acme", "demo.hello", {"n": 1}, conn=other)
            assert other.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            other.execute("SELECT 1")  # still usable
    queue.enqueue("acme", "demo.hello", {"n": 1}, conn=caller)
    with psycopg.connect(db.dsn, autocommit=True) as killer:
        killer.execute("SELECT pg_terminate_backend(%s)", (caller.info.backend_pid,))
    with pytest.raises(psycopg.OperationalError):
        queue.enqueue("acme", "demo.hello", {"n": 2}, conn=caller)
    assert caller.broken or caller.closed or caller.info.status == psycopg.pq.ConnStatus.BAD


def test_threads_sharing_one_connection(queue: Queue, db: Database, caller: psycopg.Connection[Any]) -> None:
    """The connection's lock is held for the call: 4 threads, 50 jobs each, one connection."""
    ids: list[int] = []
    errors: list[BaseException] = []

    def produce(t: int) -> None:
        try:
            for n in range(50):
                ids.append(queue.enqueue(f"t{t}", "demo.hello", {"n": n}, conn=caller))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert len(set(ids)) == 200
    with psycopg.connect(db.dsn) as conn:
        count = conn.execute(f'SELECT count(*) FROM "{db.schema}".jobs').fetchone()
    assert count is not None and count[0] == 200
