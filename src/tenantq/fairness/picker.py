"""Pick a tenant and lease a batch of its jobs, in one transaction.

The pick walks the queues with work of one priority class in round-robin
order from a cursor stored in Postgres. The cursor row is locked for the
length of the transaction, so dispatchers on any number of hosts take turns
on one shared schedule, and the claim that follows a pick commits with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from tenantq.store import jobs
from tenantq.store.db import Conn
from tenantq.store.model import Batch, Priority
from tenantq.store.queries import sql

# How many queues one pick may probe before giving up for now. A probe only
# fails for a queue whose runnable jobs were all taken since the last look
# (or are due later), and each failed probe fixes the queue's hint, so the
# bound is rarely reached; it keeps the worst case of one pick bounded.
PROBE_LIMIT = 32


@dataclass(frozen=True)
class ClaimRequest:
    worker_id: str
    driver: str
    batch_size: int
    lease_seconds: float


def claim_next(
    conn: Conn, request: ClaimRequest, priority: Priority, *, now: datetime | None = None
) -> Batch | None:
    """Lease the next batch of `priority` work, or None if there is none."""
    with conn.transaction():
        cursor_row = conn.execute(sql("scheduler", "lock_cursor"), {"priority": priority}).fetchone()
        assert cursor_row is not None, "scheduler rows are created by the schema"
        cursor = str(cursor_row["cursor_tenant"])
        candidates = conn.execute(
            sql("queues", "candidates"),
            {"priority": priority, "after": cursor, "limit": PROBE_LIMIT, "now": now},
        ).fetchall()
        for row in candidates[:PROBE_LIMIT]:
            tenant_id = str(row["tenant_id"])
            batch = jobs.claim(
                conn,
                tenant_id=tenant_id,
                priority=priority,
                limit=request.batch_size,
                worker_id=request.worker_id,
                driver=request.driver,
                lease_seconds=request.lease_seconds,
                now=now,
            )
            if batch is not None:
                conn.execute(
                    sql("scheduler", "advance_cursor"), {"priority": priority, "tenant_id": tenant_id}
                )
                return batch
            _settle_queue_hint(conn, tenant_id, priority)
        return None


def _settle_queue_hint(conn: Conn, tenant_id: str, priority: Priority) -> None:
    """A probe found nothing runnable: fix the queue's has_work/next_run_at.

    Two statements on purpose (see queues.sql): the lock first, then the
    emptiness check in a fresh snapshot that sees every enqueue that
    committed while we waited for the lock.
    """
    params = {"tenant_id": tenant_id, "priority": priority}
    conn.execute(sql("queues", "lock_for_clear"), params)
    conn.execute(sql("queues", "clear_if_empty"), params)
