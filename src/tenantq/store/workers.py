"""The registry of live workers in Postgres (`workers` table, workers.sql).

A worker upserts its row when it starts and on every maintenance tick,
records its executor's failures, and deletes the row when it stops
gracefully. Readers (`tenantq job`, the dashboard) see the workers whose
heartbeat is younger than WORKER_DEAD_AFTER_LEASES lease periods.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from tenantq.store.db import Conn
from tenantq.store.queries import sql
from tenantq.store.steps import Query, Steps, run

# workers.sql uses this factor too (`3 * lease_seconds`)
WORKER_DEAD_AFTER_LEASES = 3
# dead workers' rows are kept this long (for the record), then pruned
KEEP_DEAD_WORKERS_SECONDS = 24 * 3600.0
# what a worker's row keeps of an executor error
MAX_EXECUTOR_ERROR_CHARS = 2000


@dataclass(frozen=True)
class WorkerRecord:
    """What a worker says about itself in the registry."""

    worker_id: str
    driver: str
    lease_seconds: float
    # the kinds it claims, sorted; None: every kind
    kinds: tuple[str, ...] | None
    host: str = ""
    pid: int = 0

    @classmethod
    def of(cls, worker_id: str, driver: str, lease_seconds: float,
           kinds: Iterable[str] | None) -> WorkerRecord:
        return cls(worker_id=worker_id, driver=driver, lease_seconds=lease_seconds,
                   kinds=None if kinds is None else tuple(sorted(set(kinds))),
                   host=socket.gethostname(), pid=os.getpid())


def beat(conn: Conn, record: WorkerRecord, *, now: datetime | None = None) -> None:
    """Register the worker, or renew its heartbeat (one statement)."""
    conn.execute(sql("workers", "beat"), {
        "worker_id": record.worker_id, "host": record.host, "pid": record.pid,
        "kinds": None if record.kinds is None else list(record.kinds), "driver": record.driver,
        "lease_seconds": record.lease_seconds, "now": now,
    })


def leave(conn: Conn, worker_id: str) -> None:
    conn.execute(sql("workers", "leave"), {"worker_id": worker_id})


def executor_failed(conn: Conn, worker_id: str, error: str, *, now: datetime | None = None) -> None:
    text = error.replace("\x00", "\\0")  # Postgres text cannot hold NUL
    if len(text) > MAX_EXECUTOR_ERROR_CHARS:
        text = text[: MAX_EXECUTOR_ERROR_CHARS - 15] + "... (truncated)"
    conn.execute(sql("workers", "executor_failed"), {"worker_id": worker_id, "error": text, "now": now})


def executor_ok(conn: Conn, worker_id: str) -> None:
    conn.execute(sql("workers", "executor_ok"), {"worker_id": worker_id})


def live(conn: Conn, *, now: datetime | None = None) -> list[dict[str, Any]]:
    return run(conn, live_steps(now=now))


def live_steps(*, now: datetime | None = None) -> Steps[list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = yield Query(sql("workers", "live"), {"now": now})
    return rows


def prune(conn: Conn, *, now: datetime | None = None) -> None:
    conn.execute(sql("workers", "prune"), {"keep_seconds": KEEP_DEAD_WORKERS_SECONDS, "now": now})


def serves(worker: dict[str, Any], kind: str) -> bool:
    """Does this live worker (a `live` row) claim jobs of `kind`?"""
    kinds = worker.get("kinds")
    return kinds is None or kind in kinds
