"""Job and lease operations on one connection. Callers own transactions
where several statements must commit together (see the docstrings)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb, set_json_loads

from tenantq.errors import InvalidInput, JobNotFound, LeaseLost
from tenantq.store import validation
from tenantq.store.db import Conn
from tenantq.store.history import history_of, outcome_note
from tenantq.store.model import Batch, ClaimedJob, JobInfo, NewJob, Priority, Settlement
from tenantq.store.queries import sql


class _RawJson:
    """Already-serialised JSON (validation produced the text once)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _jsonb_text(text: str) -> Jsonb:
    # Jsonb with an identity dumps: the payload was serialised during
    # validation and is not serialised a second time.
    return Jsonb(_RawJson(text), dumps=lambda obj: obj.text)


def insert_jobs(
    conn: Conn, jobs: Sequence[tuple[NewJob, str]], *, channel: str, now: datetime | None = None
) -> list[int]:
    """Insert validated jobs in one statement; returns ids in input order.

    A job whose idempotency key already exists for its tenant is not
    inserted; its existing id is returned in its place.
    """
    if not jobs:
        return []
    params = {
        "tenant_ids": [j.tenant_id for j, _ in jobs],
        "kinds": [j.kind for j, _ in jobs],
        "payloads": [_jsonb_text(text) for _, text in jobs],
        "priorities": [j.priority for j, _ in jobs],
        "max_attempts": [j.max_attempts for j, _ in jobs],
        "delays": [j.delay for j, _ in jobs],
        "keys": [j.key for j, _ in jobs],
        "now": now,
        "channel": channel,
    }
    # one statement, so autocommit makes it one round trip and one commit
    try:
        rows = conn.execute(sql("jobs", "insert"), params).fetchall()
    except psycopg.errors.CheckViolation as exc:
        # Validation mirrors every CHECK; this is the backstop for a payload
        # whose jsonb rendering outgrows its JSON text (e.g. 1e300 spelled out).
        if exc.diag.constraint_name == "payload_size":
            raise InvalidInput(
                f"payload is over {validation.MAX_PAYLOAD_BYTES} bytes as stored by Postgres"
            ) from None
        raise
    if len(rows) == len(jobs):
        return [int(str(r["id"])) for r in rows]
    return _ids_with_existing(conn, jobs, rows)


def _ids_with_existing(
    conn: Conn, jobs: Sequence[tuple[NewJob, str]], inserted: list[dict[str, object]]
) -> list[int]:
    by_key: dict[tuple[str, str], int] = {}
    keyed = [(j.tenant_id, j.key) for j, _ in jobs if j.key is not None]
    if keyed:
        existing = conn.execute(
            sql("jobs", "ids_by_key"),
            {"tenant_ids": [t for t, _ in keyed], "keys": [k for _, k in keyed]},
        ).fetchall()
        by_key = {(str(r["tenant_id"]), str(r["idempotency_key"])): int(str(r["id"])) for r in existing}
    fresh = iter(int(str(r["id"])) for r in inserted if r["idempotency_key"] is None)
    ids: list[int] = []
    for job, _ in jobs:
        ids.append(by_key[(job.tenant_id, job.key)] if job.key is not None else next(fresh))
    return ids


@dataclass(frozen=True)
class UndecodablePayload:
    """Stands in for the payload of a claimed job whose stored JSON cannot be
    decoded here (nested deeper than Python's recursion limit allows, say).
    The worker fails such a job at once, as dead, without running it."""

    reason: str


def decode_payload(text: str | None) -> Any:
    """A claimed job's payload from its jsonb text; never raises."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except RecursionError:
        return UndecodablePayload("payload cannot be decoded: nested too deeply")
    except (ValueError, MemoryError) as exc:
        return UndecodablePayload(f"payload cannot be decoded: {str(exc)[:200]}")


def claim(
    conn: Conn,
    *,
    tenant_id: str,
    priority: Priority,
    limit: int,
    worker_id: str,
    driver: str,
    lease_seconds: float,
    kinds: Sequence[str] | None = None,
    now: datetime | None = None,
) -> Batch | None:
    """Lease up to `limit` runnable jobs of one tenant and class, of the
    given kinds only (None: any kind).

    A job whose payload cannot be decoded is leased like the others, with an
    `UndecodablePayload` as its payload: the claim must not fail on one
    stored row (it would fail again on every claim of that tenant)."""
    rows = conn.execute(
        sql("jobs", "claim"),
        {
            "tenant_id": tenant_id,
            "priority": priority,
            "limit": limit,
            "worker_id": worker_id,
            "driver": driver,
            "lease_seconds": lease_seconds,
            "kinds": None if kinds is None else list(kinds),
            "now": now,
        },
    ).fetchall()
    if not rows:
        return None
    rows.sort(key=lambda r: int(str(r["id"])))
    first = rows[0]
    return Batch(
        batch_id=int(str(first["batch_id"])),
        tenant_id=tenant_id,
        priority=priority,
        lease_expires_at=first["lease_expires_at"],  # type: ignore[arg-type]
        jobs=tuple(
            ClaimedJob(
                id=int(str(r["id"])),
                tenant_id=tenant_id,
                kind=str(r["kind"]),
                payload=decode_payload(None if r["payload_text"] is None else str(r["payload_text"])),
                attempt=int(str(r["attempts"])),
                max_attempts=int(str(r["max_attempts"])),
                waited=float(str(r["waited"])),
            )
            for r in rows
        ),
    )


def settle(
    conn: Conn,
    batch_id: int,
    settlements: Sequence[Settlement],
    *,
    release: Iterable[int] = (),
    end_outcome: str | None = None,
    run_seconds: float | None = None,
    ran_jobs: int = 0,
    charge_runtime: bool = False,
    egress: tuple[dict[str, int], Sequence[dict[str, Any]]] | None = None,
    now: datetime | None = None,
) -> list[int]:
    """Apply settlements under the batch's fencing token, in one transaction.

    `release` lists jobs that never started: they go back to pending with
    their attempt refunded. With `end_outcome`, the lease ends too. Raises
    LeaseLost (and changes nothing) when the lease is no longer live.
    `run_seconds` is the batch's measured cost; with `charge_runtime` it is
    charged to the queue's DRR deficit (fairness by run time). `egress`: the
    batch's network counts and refused requests, written with its end.
    """
    release_ids = list(release)
    if run_seconds is not None and not (math.isfinite(run_seconds) and run_seconds >= 0):
        run_seconds = 0.0  # the dispatcher clamps it; the store does not rely on that either
    # Pipelined: BEGIN and every statement go out in one round trip, COMMIT
    # in a second. The statements do not depend on each other's results; if
    # the lease turns out to be lost, raising rolls all of them back.
    with conn.pipeline() as pipeline, conn.transaction():
        live = conn.execute(sql("batches", "lock_live"), {"batch_id": batch_id, "now": now})
        settled = None
        if settlements:
            settled = conn.execute(
                sql("jobs", "settle"),
                {
                    "batch_id": batch_id,
                    "ids": [s.job_id for s in settlements],
                    "statuses": [s.status for s in settlements],
                    "results": [None if s.status != "done" else
                                _jsonb_text(s.result_json) if s.result_json is not None else Jsonb(s.result)
                                for s in settlements],
                    "errors": [s.error for s in settlements],
                    "delays": [s.delay for s in settlements],
                    "now": now,
                },
            )
        if release_ids:
            conn.execute(sql("jobs", "release_unstarted"),
                         {"batch_id": batch_id, "ids": release_ids, "now": now})
        if end_outcome is not None:
            conn.execute(sql("batches", "end"), {
                "batch_id": batch_id, "outcome": end_outcome, "run_seconds": run_seconds, "now": now,
                "egress": None if egress is None else Jsonb(egress[0]),
            })
            if egress is not None and egress[1]:
                blocks = egress[1]
                conn.execute(sql("egress", "record_blocks"), {
                    "batch_id": batch_id, "job_ids": [b.get("job_id") for b in blocks],
                    "hosts": [str(b["host"])[:300] for b in blocks],
                    "reasons": [str(b["reason"])[:1000] for b in blocks],
                    "ats": [_block_time(b.get("at")) for b in blocks],
                    "now": now,
                })
            if charge_runtime and run_seconds is not None:
                conn.execute(sql("queues", "charge"), {"batch_id": batch_id, "jobs": ran_jobs})
        pipeline.sync()
        if live.fetchone() is None:
            raise LeaseLost(f"lease {batch_id} is no longer live; its jobs were or will be re-leased")
        return [int(str(r["id"])) for r in settled.fetchall()] if settled is not None else []


# to_timestamp() takes any finite float8, but psycopg reads timestamps only
# up to the year 9999
_LATEST_EPOCH = 253402300799.0


def _block_time(at: object) -> float | None:
    """When a refused request happened (epoch seconds), or None (the batch's
    clock stands in) when it is not a usable time."""
    try:
        seconds = float(at)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None
    return seconds if math.isfinite(seconds) and 0 <= seconds <= _LATEST_EPOCH else None


def wake_queues(conn: Conn, rows: Sequence[dict[str, Any]], *, now: datetime | None = None) -> None:
    """Mark the queues of jobs that went back to pending as having work
    (and as having work of their kinds)."""
    if not rows:
        return
    conn.execute(
        sql("queues", "wake"),
        {
            "tenant_ids": [r["tenant_id"] for r in rows],
            "priorities": [r["priority"] for r in rows],
            "run_afters": [r["run_after"] for r in rows],
            "kinds": [r["kind"] for r in rows],
            "now": now,
        },
    )


def heartbeat(
    conn: Conn, batch_ids: Sequence[int], *, lease_seconds: float, now: datetime | None = None
) -> set[int]:
    """Extend live leases; returns the ids that are not lost (still live, or
    ended by their own slot meanwhile)."""
    if not batch_ids:
        return set()
    rows = conn.execute(
        sql("batches", "heartbeat"),
        {"batch_ids": list(batch_ids), "lease_seconds": lease_seconds, "now": now},
    ).fetchall()
    alive = {int(str(r["batch_id"])) for r in rows}
    missing = [b for b in batch_ids if b not in alive]
    if missing:
        ended = conn.execute(sql("batches", "ended_by_slot"), {"batch_ids": missing}).fetchall()
        alive |= {int(str(r["batch_id"])) for r in ended}
    return alive


def expire_leases(conn: Conn, *, now: datetime | None = None) -> list[dict[str, Any]]:
    """Reap expired leases; returns the jobs put back (or dead-lettered)."""
    with conn.transaction():
        rows = conn.execute(sql("batches", "expire"), {"now": now}).fetchall()
        wake_queues(conn, [r for r in rows if r["status"] == "pending"], now=now)
    return rows


def _readable_json(text: str | bytes) -> Any:
    """jsonb for display: a value Python cannot decode (a payload stored
    before enqueue refused deep nesting) shows as a note, never a crash."""
    try:
        return json.loads(text)
    except RecursionError:
        return {"undecodable": "nested too deeply to show"}


def get_job(conn: Conn, job_id: int) -> JobInfo:
    cur = conn.cursor()
    set_json_loads(_readable_json, cur)
    row = cur.execute(sql("jobs", "get"), {"id": job_id}).fetchone()
    if row is None:
        raise JobNotFound(f"no job with id {job_id}")
    fields = JobInfo.__dataclass_fields__
    blocked = [{"host": r["host"], "reason": r["reason"], "blocked_at": str(r["blocked_at"]),
                "batch_id": r["batch_id"]}
               for r in conn.execute(sql("egress", "for_job"), {"job_id": job_id}).fetchall()]
    history = history_of(conn, str(row["tenant_id"]), job_id)
    info = JobInfo(**{k: v for k, v in row.items() if k in fields},  # type: ignore[arg-type]
                   egress_blocked=blocked, attempts_history=history)
    return replace(info, outcome_note=outcome_note(info))


def cancel(conn: Conn, job_id: int, *, now: datetime | None = None) -> bool:
    """Cancel a pending job; False if it exists but is not pending."""
    if conn.execute(sql("jobs", "cancel"), {"id": job_id, "now": now}).fetchone():
        return True
    get_job(conn, job_id)  # raises JobNotFound for an unknown id
    return False


def dead_jobs(conn: Conn, *, tenant_id: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
    return conn.execute(sql("jobs", "dead_list"), {"tenant_id": tenant_id, "limit": limit}).fetchall()


def retry_dead(
    conn: Conn,
    *,
    ids: Sequence[int] | None = None,
    tenant_id: str | None = None,
    channel: str,
    now: datetime | None = None,
) -> list[int]:
    """Replay dead jobs (some ids, a tenant's, or all); returns the replayed ids."""
    with conn.transaction():
        rows = conn.execute(
            sql("jobs", "retry_dead"),
            {"ids": list(ids) if ids is not None else None, "tenant_id": tenant_id, "now": now},
        ).fetchall()
        wake_queues(conn, rows, now=now)
        if rows:
            conn.execute(sql("jobs", "notify"), {"channel": channel})
    return sorted(int(str(r["id"])) for r in rows)


def prune_jobs(conn: Conn, *, keep_seconds: float, limit: int = 1000, now: datetime | None = None) -> int:
    """Delete finished jobs older than `keep_seconds`, with their attempt
    history; at most `limit` per call. Returns how many went."""
    return len(conn.execute(sql("jobs", "prune"),
                            {"keep_seconds": keep_seconds, "limit": limit, "now": now}).fetchall())
