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

import tenantq
from tenantq import JobSpec, Queue
from tenantq.dispatch.config import DEFAULT_MAX_STORE_CONNECTIONS
from tenantq.dispatch.executors.inline import InlineExecutor
from tenantq.dispatch.worker import Worker, WorkerConfig
from tenantq.errors import InvalidInput
from tenantq.registry import Registry
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
