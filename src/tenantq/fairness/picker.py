"""Pick a queue by deficit round robin and lease a batch of its jobs, in
one transaction.

The cursor row of the priority class is locked FOR UPDATE first, so
dispatchers on any number of hosts take turns on one shared schedule, and
the deficits and cursor they write commit together with the claim. The
work per pick is bounded: at most 2 * PROBE_LIMIT candidate queues, read
through the partial index of queues with work, whatever the backlog or the
number of idle tenants.

A worker claims only the kinds its app registers (`ClaimRequest.kinds`).
The candidates are the queues whose kinds hint holds one of them (see
queues.sql, "The kinds hint"), so a tenant with only other kinds of work is
never visited by this worker: it is neither credited nor charged, and the
round robin of the workers that can run it is untouched. A visit whose
claim finds nothing makes that queue's hint exact (`_settle_queue_hint`),
so the next pick does not probe it again.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime

import psycopg

from tenantq.fairness import drr
from tenantq.store import jobs, rates
from tenantq.store.db import Conn
from tenantq.store.model import Batch, Priority
from tenantq.store.queries import composed, sql

# Candidate queues read per side of the cursor. A probe only fails for a
# queue whose runnable jobs were all taken since the last look, or a tenant
# at its cap; each failed probe fixes the queue's hint.
PROBE_LIMIT = 32


@dataclass
class PickNotes:
    """What a pick that found nothing learnt: how soon a rate-limited
    tenant it passed over gets a token (the slot waits no longer)."""

    next_token_in: float | None = None
    # The last pick's wait for its class's cursor lock (from BEGIN until the
    # locked row arrived, one round trip included) and how long it then held
    # the lock (until its COMMIT returned), in seconds. Every pick of the
    # fleet takes that lock in turn, so 1 / lock_held is the picks per second
    # one class allows (docs/benchmarks.md, "Many workers").
    lock_wait: float = 0.0
    lock_held: float = 0.0

    def token_in(self, seconds: float) -> None:
        self.next_token_in = seconds if self.next_token_in is None else min(self.next_token_in, seconds)


class _LockClock:
    """Times a pick's cursor lock into its PickNotes. Entered before the
    pick's transaction and left after it, so the hold ends with the COMMIT."""

    def __init__(self, notes: PickNotes) -> None:
        self.notes = notes
        self.started = self.locked = 0.0

    def __enter__(self) -> _LockClock:
        self.notes.lock_wait = self.notes.lock_held = 0.0
        self.started, self.locked = time.perf_counter(), 0.0
        return self

    def lock_taken(self) -> None:
        self.locked = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self.locked:
            self.notes.lock_wait = self.locked - self.started
            self.notes.lock_held = time.perf_counter() - self.locked


@dataclass(frozen=True)
class ClaimRequest:
    worker_id: str
    driver: str
    batch_size: int
    lease_seconds: float
    fair_by: drr.Mode = drr.Mode.JOBS
    # credit per visit and unit of weight, in seconds, with fair_by=runtime
    quantum_seconds: float = 1.0
    # the kinds this worker can run, sorted; None: any kind
    kinds: tuple[str, ...] | None = None

    @property
    def quantum(self) -> float:
        # jobs mode: a weight-1 queue may take one full batch per turn
        return float(self.batch_size) if self.fair_by is drr.Mode.JOBS else self.quantum_seconds


def claim_next(
    conn: Conn, request: ClaimRequest, priority: Priority, *, now: datetime | None = None,
    notes: PickNotes | None = None, abandon: Callable[[], bool] | None = None,
) -> Batch | None:
    """Lease the next batch of `priority` work, or None if there is none.

    `abandon` is asked after the batch's rows are locked and before the
    commit: if it says yes the whole pick rolls back (None). A stopping
    worker uses it, so a claim that began before the stop cannot take the
    jobs a stopping batch has just released: any claim that sees those rows
    read them after the stop, so it also sees the stop."""
    notes = notes if notes is not None else PickNotes()
    leased: tuple[str, list[jobs.Row], tuple[str, ...], tuple[str, ...] | None] | None = None
    # Pipelined: BEGIN, the cursor lock and the candidate read go out in one
    # round trip; the claim is a second; the writes and COMMIT a third. The
    # cursor lock is held until that commit, so every other pick of the class
    # waits for it: only what decides the schedule happens inside; the
    # batch's jobs are built from the leased rows after the commit.
    with _LockClock(notes) as clock, conn.pipeline(), conn.transaction():
        locked = conn.execute(sql("scheduler", "lock_cursor"), {"priority": priority})
        kinds = None if request.kinds is None else list(request.kinds)
        found = conn.execute(composed("queues", "candidates", rate_columns="rate_columns"),
                             {"priority": priority, "limit": PROBE_LIMIT, "kinds": kinds, "now": now})
        row = locked.fetchone()
        clock.lock_taken()
        assert row is not None, "scheduler rows are created by the schema"
        cursor, turn_open = str(row["cursor_tenant"]), bool(row["turn_open"])
        rows = found.fetchall()
        if rows and not turn_open and rows[0]["tenant_id"] == cursor:
            rows.append(rows.pop(0))  # its turn is over: it goes last this round
        candidates = [
            drr.Candidate(
                tenant_id=str(r["tenant_id"]),
                weight=int(str(r["weight"])),
                # never trusted to be a usable number (see drr.safe_deficit)
                deficit=drr.safe_deficit(r["deficit"]),
                # a tenant at its cap, or with no token left, is passed over:
                # no credit, no charge, nobody waits for it
                at_cap=_at_cap_hint(r) or (r["rate_tokens"] is not None and float(str(r["rate_tokens"])) < 1),
            )
            for r in rows
        ]
        pending_kinds = {str(r["tenant_id"]): None if r["kinds"] is None else [str(k) for k in r["kinds"]]  # type: ignore[attr-defined]
                         for r in rows}
        rate_limited = {str(r["tenant_id"]) for r in rows
                        if r["rate_tokens"] is not None or r["kind_limited"]}
        for r in rows:
            tokens = r["rate_tokens"]
            if tokens is not None and float(str(tokens)) < 1:
                notes.token_in(rates.refill_seconds(float(str(tokens)), float(str(r["rate_per_second"]))))
        capped = {str(r["tenant_id"]) for r in rows if r["max_sandboxes"] is not None}
        egress_of = {str(r["tenant_id"]): tuple(str(e) for e in (r["egress"] or ())) for r in rows}  # type: ignore[attr-defined]
        host_functions_of = {str(r["tenant_id"]): None if r["host_functions"] is None
                             else tuple(str(f) for f in r["host_functions"])  # type: ignore[attr-defined]
                             for r in rows}
        # runtime mode: until a queue has history, assume a batch costs one quantum
        default_est = request.quantum_seconds / max(1, request.batch_size)
        estimates = {str(r["tenant_id"]): drr.estimate(r["avg_job_seconds"], default=default_est)
                     for r in rows}
        visits = drr.plan(candidates, cursor=cursor, turn_open=turn_open, mode=request.fair_by,
                          quantum=request.quantum, batch_size=request.batch_size)
        walked_past: dict[str, float] = {}
        for visit in visits:
            if not visit.eligible:
                walked_past[visit.tenant_id] = visit.deficit  # runtime debt shrinks by one quantum
                continue
            limits = None
            if visit.tenant_id in rate_limited:
                # under the buckets' row locks until commit (rates.py)
                limits = rates.for_claim(conn, visit.tenant_id, kinds, now=now,
                                         pending_kinds=pending_kinds.get(visit.tenant_id))
                if limits.refill_in is not None:
                    notes.token_in(limits.refill_in)
                if limits.tenant is not None and limits.tenant < 1:
                    continue
            if visit.tenant_id in capped and _at_cap(conn, visit.tenant_id, now):
                continue
            rows = jobs.claim_rows(
                conn,
                tenant_id=visit.tenant_id,
                priority=priority,
                limit=visit.max_jobs if limits is None or limits.tenant is None
                else min(visit.max_jobs, limits.tenant),
                worker_id=request.worker_id,
                driver=request.driver,
                lease_seconds=request.lease_seconds,
                kinds=request.kinds,
                quotas=None if limits is None else limits.kinds,
                now=now,
            )
            if not rows:
                if limits is not None and limits.exhausted:
                    continue  # its runnable kinds may all be out of tokens: the hint stays
                # nothing runnable of our kinds: no credit kept, nothing
                # charged, and the hint is fixed so we do not come back
                _settle_queue_hint(conn, visit.tenant_id, priority, now)
                continue
            if limits is not None:
                rates.take(conn, limits, Counter(str(r["kind"]) for r in rows), now=now)
            batch_id = int(str(rows[0]["batch_id"]))
            est = estimates[visit.tenant_id]
            deficit, keep_turn = drr.charge(visit, claimed=len(rows), mode=request.fair_by,
                                            est_job_cost=est)
            if limits is not None and len(rows) < visit.max_jobs:
                # bounded by its tokens, not its credit: the turn ends (tenants
                # sharing a kind's limit take turns) and no credit is banked
                # (it would let the tenant run ahead of others once unlimited)
                deficit, keep_turn = min(deficit, 0.0), False
            _set_deficits(conn, priority, {**walked_past, visit.tenant_id: deficit})
            if request.fair_by is drr.Mode.RUNTIME:
                conn.execute(sql("batches", "set_charged"),
                             {"batch_id": batch_id, "seconds": est * len(rows)})
            conn.execute(sql("scheduler", "advance_cursor"),
                         {"priority": priority, "tenant_id": visit.tenant_id, "turn_open": keep_turn})
            if abandon is not None and abandon():
                raise psycopg.Rollback()  # nothing of this pick is kept
            leased = (visit.tenant_id, rows, egress_of[visit.tenant_id], host_functions_of[visit.tenant_id])
            break
        else:
            if walked_past:
                _set_deficits(conn, priority, walked_past)
    if leased is None:
        return None
    tenant_id, rows, egress, host_functions = leased
    # the tenant's egress rules and host-function restriction travel with
    # the batch to its sandbox
    return replace(jobs.batch_of(tenant_id, priority, rows), egress=egress, host_functions=host_functions)


def _at_cap_hint(row: dict[str, object]) -> bool:
    cap = row["max_sandboxes"]
    return cap is not None and int(str(row["live"])) >= int(str(cap))


def _at_cap(conn: Conn, tenant_id: str, now: datetime | None) -> bool:
    """Authoritative cap check under the tenant's row lock (held to commit),
    so two dispatchers picking different classes cannot both pass it."""
    row = conn.execute(sql("tenants", "lock_for_cap"), {"tenant_id": tenant_id}).fetchone()
    if row is None or row["max_sandboxes"] is None:
        return False
    live = conn.execute(sql("tenants", "count_live"), {"tenant_id": tenant_id, "now": now}).fetchone()
    assert live is not None
    return int(str(live["live"])) >= int(str(row["max_sandboxes"]))


def _set_deficits(conn: Conn, priority: Priority, deficits: dict[str, float]) -> None:
    conn.execute(sql("queues", "set_deficits"), {
        "priority": priority, "tenant_ids": list(deficits), "deficits": list(deficits.values()),
    })


def _settle_queue_hint(conn: Conn, tenant_id: str, priority: Priority, now: datetime | None) -> None:
    """A probe found nothing runnable (of this worker's kinds): fix the
    queue's has_work/next_run_at and its kinds hint.

    Two statements on purpose (see queues.sql): the lock first, then the
    emptiness check in a fresh snapshot that sees every enqueue that
    committed while we waited for the lock.
    """
    conn.execute(sql("queues", "lock_for_clear"), {"tenant_id": tenant_id, "priority": priority})
    conn.execute(sql("queues", "clear_if_empty"), {"tenant_id": tenant_id, "priority": priority, "now": now})
