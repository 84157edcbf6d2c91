"""Why is this pending job not running yet? Answers in plain sentences,
most decisive first."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from tenantq.domain.records import JobInfo
from tenantq.store import rates, wakes
from tenantq.store import workers as worker_registry
from tenantq.store.db import Conn
from tenantq.store.queries import sql
from tenantq.store.steps import Query, Steps, run

# how many workers' names a sentence lists before "and N more"
NAMED_WORKERS = 3
ERROR_CHARS = 300


def why_waiting(conn: Conn, job: JobInfo) -> list[str]:
    return run(conn, why_waiting_steps(job))


def why_waiting_steps(job: JobInfo) -> Steps[list[str]]:
    # the job's queue row, which a fold of its wake makes (store/wakes.py)
    yield from wakes.fold_steps()
    rows = yield Query(sql("explain", "job"), {"id": job.id})
    if not rows:
        return []
    limited = yield from rates.waiting_steps(job.tenant_id, job.kind)
    return limited + reasons(job, rows[0], (yield from worker_registry.live_steps()))


def reasons(job: JobInfo, row: dict[str, Any], workers: Sequence[dict[str, Any]] | None = None) -> list[str]:
    """`workers`: the live workers (workers.sql `live`); None leaves the
    workers out of the answer (the registry was not read)."""
    out: list[str] = []
    serving: list[dict[str, Any]] = []
    if workers is not None:
        serving = [w for w in workers if worker_registry.serves(w, job.kind)]
        out.extend(_worker_reasons(job, workers, serving))
    if row.get("paused_at") is not None:
        out.append(f"tenant {job.tenant_id} is paused (since {row['paused_at']:%Y-%m-%d %H:%M:%S %Z}; "
                   f"tenantq tenant resume {job.tenant_id})")
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
        if busy:
            out.append(f"runnable now: waiting for a free worker slot ({busy} batch(es) running)")
        elif workers is None:
            out.append("runnable now: no worker is running batches")
        else:
            out.append(f"runnable now: {len(serving)} running worker(s) can run it; it goes with their next "
                       "claim")
    return out


def _worker_reasons(job: JobInfo, workers: Sequence[dict[str, Any]],
                    serving: Sequence[dict[str, Any]]) -> list[str]:
    """What the registry of live workers says: none runs, none has a
    handler for this kind, or those that have one cannot run batches."""
    if not workers:
        return ["no worker is running (start one: tenantq worker --app MODULE)"]
    if not serving:
        served = sorted({k for w in workers for k in (w["kinds"] or ())})
        shown = ", ".join(served[:10]) + (f" and {len(served) - 10} more" if len(served) > 10 else "")
        return [f"no running worker has a handler for kind {job.kind} ({len(workers)} running worker(s) "
                f"serve: {shown or 'nothing'})"]
    failing = [w for w in serving if int(w["executor_failures"] or 0) > 0]
    if not failing:
        return []
    out = []
    for w in failing[:NAMED_WORKERS]:
        out.append(f"worker {w['worker_id']} cannot run batches: its executor failed "
                   f"{w['executor_failures']} time(s) in a row, last {_ago(w['last_executor_error_at'])}: "
                   f"{_line(w['last_executor_error'])}")
    if len(failing) > NAMED_WORKERS:
        out.append(f"... and {len(failing) - NAMED_WORKERS} more worker(s) whose executor is failing")
    return out


def _line(text: object) -> str:
    lines = str(text or "").strip().splitlines()
    line = lines[0] if lines else "(no message)"
    return line if len(line) <= ERROR_CHARS else line[: ERROR_CHARS - 1] + "…"


def _ago(when: object) -> str:
    if not isinstance(when, datetime):
        return "at an unknown time"
    seconds = max(0.0, (datetime.now(UTC) - when).total_seconds())
    return f"{seconds:.0f}s ago"
