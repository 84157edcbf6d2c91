"""A worker's connections to tenantq's store are bounded whatever its
concurrency (dispatch/config.py, DEFAULT_MAX_STORE_CONNECTIONS): slots share
a pool they hold only to claim and settle, so 40 slots do not open 40
connections (`./run bench host-connections` measures 200 sandboxed slots)."""

from __future__ import annotations

import subprocess
import threading
import uuid
from dataclasses import replace

import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from psycopg_pool import ConnectionPool

import tenantq
from tenantq import JobSpec, Queue
from tenantq.dispatch.config import DEFAULT_MAX_STORE_CONNECTIONS
from tenantq.dispatch.executors.inline import InlineExecutor
from tenantq.dispatch.worker import Worker, WorkerConfig
from tenantq.errors import InvalidInput
from tenantq.registry import Registry
from tenantq.store import db as store_db
from tenantq.store.db import Database
from tests.integration.helpers import running


def _napping_registry() -> Registry:
    reg = Registry()

    @tenantq.handler("store.nap", registry=reg)
    def nap(payload: object, ctx: tenantq.JobContext) -> int:
        threading.Event().wait(0.2)  # the job's run: no database
        return 1

    return reg


def test_forty_slots_share_the_default_store_pool(db: Database, server_dsn: str) -> None:
    name = f"tq-store-{uuid.uuid4().hex[:8]}"
    worker_db = replace(db, dsn=make_conninfo(db.dsn, application_name=name))
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            while not stop.is_set():
                row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                                   (name,)).fetchone()
                seen.append(int(row[0]) if row else 0)
                stop.wait(0.01)  # the sampling interval, until the jobs are done

    with Queue(db.dsn, schema=db.schema) as q:
        ids = q.enqueue_many([JobSpec(tenant=f"t{n % 40}", kind="store.nap") for n in range(160)])
        worker = Worker(worker_db, InlineExecutor(_napping_registry()),
                        WorkerConfig(concurrency=40, batch_size=1, poll_seconds=0.1))
        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            with running(worker):
                infos = [q.wait(i, timeout=120) for i in ids]
        finally:
            stop.set()
            watcher.join()
    assert all(i.status == "done" for i in infos), [i.last_error for i in infos if i.status != "done"]
    # the pool, and the LISTEN connection that wakes the worker
    assert seen and 10 < max(seen) <= DEFAULT_MAX_STORE_CONNECTIONS + 1, max(seen, default=0)


def test_the_store_pool_size_is_settable_and_checked(tenantq_cmd: list[str], cli_env: dict[str, str]) -> None:
    assert WorkerConfig(concurrency=4).store_pool_size() == 6
    assert WorkerConfig(concurrency=200).store_pool_size() == DEFAULT_MAX_STORE_CONNECTIONS
    assert WorkerConfig(concurrency=200, store_connections=50).store_pool_size() == 50
    with pytest.raises(InvalidInput, match=r"^store connections must be 2-1000, got 1$"):
        WorkerConfig(store_connections=1)
    res = subprocess.run([*tenantq_cmd, "worker", "--app", "tests.apps.basic", "--store-connections", "1"],
                         env=cli_env, capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 2 and "--store-connections" in res.stderr, res.stderr


# -- the producer's pool: a connection is checked only after it sat idle ---------------------


def _counting_checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = ConnectionPool.check_connection

    def counted(conn: psycopg.Connection[object]) -> None:
        calls.append(1)
        real(conn)

    monkeypatch.setattr(ConnectionPool, "check_connection", staticmethod(counted))
    return calls


def test_back_to_back_enqueues_skip_the_pools_check(db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    """One round trip per enqueue: a connection given back moments ago is
    handed out again unchecked (store/db.py, CHECK_BYPASS_SECONDS)."""
    calls = _counting_checks(monkeypatch)
    with Queue(db.dsn, schema=db.schema) as q:
        for i in range(50):
            q.enqueue("acme", "demo.noop", {"i": i})
    assert len(calls) <= 1, f"{len(calls)} checks for 50 back-to-back enqueues"
    monkeypatch.setattr(store_db, "CHECK_BYPASS_SECONDS", 0.0)
    with Queue(db.dsn, schema=db.schema) as q:
        for i in range(50):
            q.enqueue("acme", "demo.noop", {"i": i})
    assert len(calls) >= 50, "with no window, every hand-out is checked"


def test_a_connection_killed_while_idle_is_replaced_before_an_enqueue(
        db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the window the check runs, finds the connection dead (a Postgres
    restart, an idle timeout) and the pool hands out a new one: the caller
    sees no error."""
    monkeypatch.setattr(store_db, "CHECK_BYPASS_SECONDS", 0.0)  # "idle longer than the window"
    with Queue(db.dsn, schema=db.schema) as q:
        q.enqueue("acme", "demo.noop")
        assert q._pool is not None
        with q._pool.connection() as conn:
            pid = conn.info.backend_pid
        with db.connect() as other:
            other.execute("SELECT pg_terminate_backend(%(pid)s)", {"pid": pid})
        job_id = q.enqueue("acme", "demo.noop")
        assert q.job(job_id).status == "pending"
