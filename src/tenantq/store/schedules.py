"""Periodic jobs: schedules kept in Postgres, fired by the workers.

A schedule is a cron expression (5 fields, or @hourly/@daily/..., read by
croniter) in a time zone (IANA name, zoneinfo), for one tenant and kind.
Firing (`fire_due_steps`, run atomically by every worker's maintenance
loop and by `worker --once` before it drains) locks the due rows with SKIP
LOCKED, enqueues one job per schedule with the idempotency key
`schedule:<id>:<fire time>`, and moves each row's next fire past now, all in
one transaction: one job per fire time however many workers run. Fires
missed while no worker ran collapse into one job, for the latest of them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from tenantq.domain import validation
from tenantq.domain.cron import latest_fire, next_fire, wall_clock
from tenantq.domain.records import NewJob
from tenantq.domain.schedules import ScheduleSpec
from tenantq.store.enqueue import insert_steps
from tenantq.store.queries import sql
from tenantq.store.steps import Query, Steps

# schedules fired per transaction (the rest go in the next one)
FIRE_LIMIT = 500


def upsert_steps(schedule: ScheduleSpec, *, origin: str,
                 now: datetime | None = None) -> Steps[dict[str, Any]]:
    from psycopg.types.json import Jsonb

    yield Query(sql("schedules", "ensure_tenants"), {"tenant_ids": [schedule.tenant_id]})
    rows = yield Query(sql("schedules", "upsert"), {
        "tenant_id": schedule.tenant_id, "name": schedule.name, "kind": schedule.kind, "cron": schedule.cron,
        "timezone": schedule.timezone, "payload": Jsonb(json.loads(schedule.payload_json)),
        "priority": schedule.priority, "max_attempts": schedule.max_attempts, "origin": origin,
        "next_fire_at": next_fire(schedule.cron, schedule.timezone, now or datetime.now(UTC)),
    })
    return dict(rows[0])


def list_steps(tenant_id: str | None = None) -> Steps[list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = yield Query(sql("schedules", "list"), {"tenant_id": tenant_id})
    return rows


def remove_steps(schedule_id: int) -> Steps[bool]:
    return bool((yield Query(sql("schedules", "remove"), {"schedule_id": schedule_id})))


def set_paused_steps(schedule_id: int, paused: bool, *, now: datetime | None = None) -> Steps[bool]:
    """Pause or resume; a resumed schedule fires next at its next time from now."""
    rows = yield Query(sql("schedules", "set_paused"), {"schedule_id": schedule_id, "paused": paused})
    if not rows:
        return False
    if not paused and rows[0]["was_paused"]:
        for row in (yield from list_steps()):
            if row["schedule_id"] == schedule_id:
                upcoming = next_fire(str(row["cron"]), str(row["timezone"]), now or datetime.now(UTC))
                yield Query(sql("schedules", "resume_next_fire"),
                            {"schedule_id": schedule_id, "next_fire_at": upcoming})
    return True


def sync_app_steps(declared: Sequence[ScheduleSpec], kinds: Sequence[str], *,
                   now: datetime | None = None) -> Steps[tuple[int, int]]:
    """Bring the app schedules of `kinds` in step with what the app declares:
    new ones added, gone ones removed (changed ones are new names). Run
    atomically. Returns (declared, removed)."""
    for schedule in declared:
        yield from upsert_steps(schedule, origin="app", now=now)
    wanted = {(s.tenant_id, s.name) for s in declared}
    stored = yield Query(sql("schedules", "app_schedules"), {"kinds": list(kinds)})
    gone = [int(str(r["schedule_id"])) for r in stored if (r["tenant_id"], r["name"]) not in wanted]
    if gone:
        yield Query(sql("schedules", "remove_many"), {"ids": gone})
    return len(declared), len(gone)


def fire_due_steps(*, schema: str, channel: str, now: datetime | None = None,
                   limit: int = FIRE_LIMIT) -> Steps[list[tuple[int, int]]]:
    """Enqueue the job of every due schedule; returns (schedule_id, job_id)
    pairs. Run atomically (the row locks and the jobs commit together)."""
    due = yield Query(sql("schedules", "due"), {"now": now, "limit": limit})
    if not due:
        return []
    jobs: list[tuple[NewJob, str]] = []
    fired: list[tuple[int, datetime, datetime]] = []
    for row in due:
        schedule_id, at = int(str(row["schedule_id"])), row["now"]
        cron, zone = str(row["cron"]), str(row["timezone"])
        fire = max(latest_fire(cron, zone, at), row["next_fire_at"])
        jobs.append(validation.new_job(
            row["tenant_id"], row["kind"], row["payload"], priority_=row["priority"],
            max_attempts_=row["max_attempts"], key=f"schedule:{schedule_id}:{wall_clock(fire, zone)}",
            meta={"schedule_id": schedule_id, "fire_time": fire.isoformat()}))
        fired.append((schedule_id, fire, next_fire(cron, zone, at)))
    ids = yield from insert_steps(jobs, schema=schema, channel=channel)
    yield Query(sql("schedules", "fired"), {
        "ids": [f[0] for f in fired], "fire_ats": [f[1] for f in fired],
        "next_fire_ats": [f[2] for f in fired], "job_ids": ids})
    return [(f[0], job_id) for f, job_id in zip(fired, ids, strict=True)]
