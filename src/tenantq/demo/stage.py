"""What the demo's scenes share: the queue, the running worker, the console,
reads of the demo's own schema, and waiting with a deadline (polling, never
a bare sleep)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from tenantq import Queue
from tenantq.dispatch.worker import Worker
from tenantq.store.db import Database
from tenantq.testing import wait_until

Row = dict[str, Any]

JOBS_SQL = """SELECT id, tenant_id, kind, priority, status, attempts, max_attempts, last_error, result,
                  extract(epoch FROM created_at)::float8 AS created,
                  extract(epoch FROM started_at)::float8 AS started,
                  extract(epoch FROM finished_at)::float8 AS finished
           FROM jobs WHERE id = ANY(%(ids)s::bigint[]) ORDER BY id"""
BATCHES_SQL = """SELECT batch_id, tenant_id, priority, job_count, outcome,
                     extract(epoch FROM created_at)::float8 AS created,
                     extract(epoch FROM ended_at)::float8 AS ended
              FROM batches WHERE priority = ANY(%(priorities)s::text[]) ORDER BY batch_id"""


def within(predicate: Callable[[], object], timeout: float, message: str) -> bool:
    """Poll until `predicate` holds; False (not an error) after `timeout`:
    the demo reports what happened instead of asserting it."""
    try:
        wait_until(predicate, timeout=timeout, interval=0.05, message=message)
    except TimeoutError:
        return False
    return True


@dataclass
class Stage:
    db: Database
    q: Queue
    worker: Worker
    console: Console
    concurrency: int
    batch_size: int
    driver: str  # the executor's name: gvisor, process or inline

    def read(self, statement: str, params: dict[str, Any] | None = None) -> list[Row]:
        with self.db.connect() as conn:
            return list(conn.execute(statement, params or {}).fetchall())

    def jobs(self, ids: Sequence[int]) -> list[Row]:
        return self.read(JOBS_SQL, {"ids": list(ids)})

    def batches(self, *priorities: str) -> list[Row]:
        return self.read(BATCHES_SQL, {"priorities": list(priorities)})

    def live_batches(self, priority: str, tenant: str | None = None) -> int:
        rows = self.read("""SELECT count(*) AS n FROM batches
                            WHERE ended_at IS NULL AND priority = %(p)s
                              AND (%(t)s::text IS NULL OR tenant_id = %(t)s)""", {"p": priority, "t": tenant})
        return int(rows[0]["n"])

    def count(self, ids: Sequence[int], statuses: Sequence[str]) -> int:
        rows = self.read("SELECT count(*) AS n FROM jobs WHERE id = ANY(%(ids)s::bigint[]) "
                         "AND status = ANY(%(s)s::text[])", {"ids": list(ids), "s": list(statuses)})
        return int(rows[0]["n"])

    def leased(self, job_id: int) -> bool:
        rows = self.read("SELECT started_at IS NOT NULL OR status <> 'pending' AS leased FROM jobs "
                         "WHERE id = %(id)s", {"id": job_id})
        return bool(rows and rows[0]["leased"])

    def drain(self, ids: Sequence[int], description: str, *, timeout: float = 600.0) -> float:
        """Show progress until every job in `ids` is done or dead; seconds taken."""
        t0 = time.perf_counter()
        with Progress(TextColumn("{task.description}"), BarColumn(),
                      TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                      console=self.console) as progress:
            task = progress.add_task(description, total=len(ids))

            def finished() -> bool:
                if self.worker.stopping.is_set():
                    raise RuntimeError(f"the worker stopped: {self.worker.failure or 'see the log above'}")
                n = self.count(ids, ("done", "dead", "cancelled"))
                progress.update(task, completed=n)
                return n >= len(ids)

            wait_until(finished, timeout=timeout, interval=0.25, message=description)
        return time.perf_counter() - t0
