"""Small helpers shared by the integration tests (real Postgres only)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, LiteralString

from tenantq.dispatch.worker import Worker, WorkerStats
from tenantq.store import wakes
from tenantq.store.db import Database


def db_now(db: Database) -> datetime:
    """The database clock (the clock every store function uses by default)."""
    with db.connect() as conn:
        row = conn.execute("SELECT now() AS now").fetchone()
    assert row is not None
    value = row["now"]
    assert isinstance(value, datetime)
    return value


def fetch_all(
    db: Database, query: LiteralString, params: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The rows of `query`. Queue and tenant rows are written by a worker's
    fold of the wakes (queues.sql, "The has_work protocol"): a query that
    reads them folds first, as a worker looking for work would."""
    with db.connect() as conn:
        if "queues" in query or "tenants" in query:
            wakes.fold(conn)
        return conn.execute(query, params or {}).fetchall()


def fetch_one(db: Database, query: LiteralString, params: dict[str, Any] | None = None) -> dict[str, Any]:
    rows = fetch_all(db, query, params)
    assert len(rows) == 1, rows
    return rows[0]


def scalar(db: Database, query: LiteralString, params: dict[str, Any] | None = None) -> Any:
    row = fetch_one(db, query, params)
    (value,) = row.values()
    return value


def table_counts(db: Database) -> dict[str, int]:
    """Row counts of every table a write could touch."""
    row = fetch_one(
        db,
        "SELECT (SELECT count(*) FROM jobs) AS jobs, (SELECT count(*) FROM tenants) AS tenants, "
        "(SELECT count(*) FROM queues) AS queues, (SELECT count(*) FROM batches) AS batches, "
        "(SELECT count(*) FROM wakes) AS wakes",
    )
    return {k: int(v) for k, v in row.items()}


def status_counts(db: Database) -> dict[str, int]:
    rows = fetch_all(db, "SELECT status, count(*) AS n FROM jobs GROUP BY status")
    return {str(r["status"]): int(r["n"]) for r in rows}


class WorkerThread:
    """Worker.run() in a thread of its own; records its result or exception."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.stats: WorkerStats | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"test-{worker.config.worker_id}", daemon=True)

    def _run(self) -> None:
        try:
            self.stats = self.worker.run()
        except BaseException as exc:  # surfaced by stop_and_join
            self.error = exc

    def start(self) -> WorkerThread:
        self.thread.start()
        return self

    def stop_and_join(self, timeout: float = 30.0) -> WorkerStats:
        self.worker.stop()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"worker {self.worker.config.worker_id} did not stop"
        if self.error is not None:
            raise self.error
        assert self.stats is not None
        return self.stats


@contextmanager
def running(*workers: Worker) -> Iterator[list[WorkerThread]]:
    """Run workers in threads; always stop and join them on the way out."""
    threads = [WorkerThread(w).start() for w in workers]
    try:
        yield threads
    finally:
        errors: list[BaseException] = []
        for t in threads:
            t.worker.stop()
        for t in threads:
            try:
                t.stop_and_join()
            except BaseException as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
