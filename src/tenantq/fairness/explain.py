"""Why is this pending job not running yet? Answers in plain sentences,
most decisive first."""

from __future__ import annotations

from typing import Any

from tenantq.store.db import Conn
from tenantq.store.model import JobInfo
from tenantq.store.queries import sql


def why_waiting(conn: Conn, job: JobInfo) -> list[str]:
    row = conn.execute(sql("explain", "job"), {"id": job.id}).fetchone()
    if row is None:
        return []
    return reasons(job, row)


def reasons(job: JobInfo, row: dict[str, Any]) -> list[str]:
    out: list[str] = []
    future = float(row["future_seconds"] or 0)
    if future > 0:
        why = "retry backoff after a failed attempt" if job.attempts else "it was enqueued with a delay"
        out.append(f"run_after is {future:.1f}s in the future ({why})")
    cap, live = row["max_sandboxes"], int(row["live_batches"])
    if cap is not None and live >= int(cap):
        out.append(f"tenant {job.tenant_id} is at its cap: {live} of {cap} batch(es) running")
    first = [c for c in (row["classes_first"] or []) if c]
    if first:
        out.append(f"runnable {' and '.join(sorted(set(first)))} work goes first (strict priority over "
                   f"{job.priority})")
    ahead = int(row["ahead_same_tenant"])
    if ahead:
        out.append(f"behind {ahead} runnable job(s) of its own tenant in class {job.priority}")
    others = int(row["other_queues"])
    if others and future <= 0:
        deficit = float(row["deficit"] or 0)
        out.append(f"sharing class {job.priority} by weighted round robin with {others} other tenant(s) "
                   f"(weight {row['weight']}, deficit {deficit:.1f})")
    if not out:
        busy = int(row["running_batches"])
        out.append(f"runnable now: waiting for a free worker slot ({busy} batch(es) running)"
                   if busy else "runnable now: no worker is running batches")
    return out
