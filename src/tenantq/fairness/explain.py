"""Why is this pending job not running yet? Answers in plain sentences."""

from __future__ import annotations

from tenantq.store.db import Conn
from tenantq.store.model import JobInfo
from tenantq.store.queries import sql


def why_waiting(conn: Conn, job: JobInfo) -> list[str]:
    row = conn.execute(sql("explain", "job"), {"id": job.id}).fetchone()
    if row is None:
        return []
    reasons: list[str] = []
    if row["future_seconds"] and float(str(row["future_seconds"])) > 0:
        reasons.append(f"run_after is {float(str(row['future_seconds'])):.1f}s in the future"
                       + (" (retry backoff)" if job.attempts else " (delayed)"))
    cap = row["max_sandboxes"]
    if cap is not None and int(str(row["live_batches"])) >= int(str(cap)):
        reasons.append(f"tenant {job.tenant_id} is at its cap of {cap} running batch(es)")
    ahead = int(str(row["ahead_same_tenant"]))
    if ahead:
        reasons.append(f"behind {ahead} runnable job(s) of its own tenant in class {job.priority}")
    if not reasons:
        reasons.append("runnable now: waiting for a free worker slot")
    return reasons
