"""Priority classes with real workers: interactive work is never behind
bulk, and slots lent out of the interactive reservation are recalled."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

import tenantq
import tests.apps.basic  # noqa: F401  (registers the test handlers)
from tenantq import JobSpec, Queue
from tenantq.dispatch.executors.inline import InlineExecutor
from tenantq.dispatch.worker import Worker, WorkerConfig
from tenantq.store.db import Database
from tenantq.testing import drain, wait_until


@pytest.fixture
def worker(db: Database) -> Iterator[Worker]:
    # 3 slots: ceil(0.3 * 3) = 1 reserved for interactive, lent to bulk while idle
    w = Worker(db, InlineExecutor(tenantq.REGISTRY),
               WorkerConfig(concurrency=3, batch_size=20, poll_seconds=5.0, lease_seconds=30))
    thread = threading.Thread(target=w.run, daemon=True)
    thread.start()
    assert w.started.wait(30)
    try:
        yield w
    finally:
        w.stop()
        thread.join(timeout=60)
        assert not thread.is_alive()


def _running_bulk_batches(db: Database) -> int:
    with db.connect() as conn:
        row = conn.execute("SELECT count(*) AS n FROM batches WHERE ended_at IS NULL AND priority = 'bulk'"
                           ).fetchone()
    assert row is not None
    return int(str(row["n"]))


def test_lent_slots_are_recalled_for_interactive_work(db: Database, queue: Queue, worker: Worker) -> None:
    # 1-second bulk batches (20 x 50 ms) on every slot, the reserved one included
    queue.enqueue_many([JobSpec(f"bulk{i % 3}", "demo.sleep", {"seconds": 0.05}, priority="bulk")
                        for i in range(600)])
    wait_until(lambda: _running_bulk_batches(db) == 3, timeout=10, message="all 3 slots on bulk work")
    job_id = queue.enqueue("acme", "demo.hello", {}, priority="interactive")
    info = wait_until(lambda: (j := queue.job(job_id)).status == "done" and j, timeout=10,
                      message="the interactive job")
    assert info.started_at is not None
    waited = (info.started_at - info.created_at).total_seconds()
    # recalled after the running 50 ms job, not after the lent slot's whole 1 s batch
    assert waited < 0.5, waited
    assert worker.stats.snapshot()["recalled"] >= 1
    # the recalled bulk batch released its unstarted jobs without losing attempts
    with db.connect() as conn:
        row = conn.execute("SELECT max(attempts) AS a FROM jobs WHERE status = 'pending'").fetchone()
    assert row is not None and (row["a"] or 0) == 0


def test_interactive_is_never_behind_bulk(db: Database, queue: Queue) -> None:
    queue.enqueue_many([JobSpec("whale", "demo.noop", {}, priority="bulk") for _ in range(500)])
    ids = queue.enqueue_many([JobSpec(f"t{i}", "demo.noop", {}, priority="interactive") for i in range(5)])
    stats = drain(db, concurrency=1, batch_size=10)
    assert stats.done == 505
    with db.connect() as conn:
        row = conn.execute(
            """SELECT max(finished_at) FILTER (WHERE priority = 'interactive') AS last_interactive,
                      min(started_at) FILTER (WHERE priority = 'bulk') AS first_bulk
               FROM jobs"""
        ).fetchone()
    assert row is not None
    assert row["last_interactive"] <= row["first_bulk"], (ids, row)
