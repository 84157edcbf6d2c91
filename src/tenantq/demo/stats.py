"""The demo's numbers, computed from the rows Postgres holds (pure functions,
so the acceptance test checks the same arithmetic the demo prints).

Job rows carry epoch seconds from Postgres's clock: `created` (enqueued),
`started` (the lease of the batch that ran it: the claim sets started_at),
`finished`; batch rows carry `created` (leased) and `ended`. A job's *wait*
is `started - created`. A retried job's started_at is its last lease, so its
wait includes the failed attempts and their backoff: such jobs are kept
apart (`attempts > 1`). A job whose batch was released (a recall) gets its
attempt refunded and waits again; it is still a first attempt.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

Row = dict[str, Any]


def p50(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def top(values: Sequence[float]) -> float | None:
    return max(values) if values else None


def wait_of(row: Row) -> float | None:
    if row.get("started") is None:
        return None
    return max(0.0, float(row["started"]) - float(row["created"]))


def first_attempt(row: Row) -> bool:
    """Leased once and never retried: its wait is queueing alone."""
    return row.get("started") is not None and int(row["attempts"]) == 1


def seconds_per_job(batches: Iterable[Row], tenant: str, priority: str) -> float | None:
    """Slot-seconds per job of a tenant's batches that ran to the end: their
    wall time (lease to end, sandbox start included) over their jobs."""
    ran = [b for b in batches if b["tenant_id"] == tenant and b["priority"] == priority
           and b["outcome"] == "ok" and b["ended"] is not None]
    jobs = sum(int(b["job_count"]) for b in ran)
    if not jobs:
        return None
    return sum(float(b["ended"]) - float(b["created"]) for b in ran) / jobs


# -- scene 1: deficit round robin within one class ----------------------
@dataclass(frozen=True)
class TenantWaits:
    tenant: str
    jobs: int
    done: int
    dead: int
    first_batch: int | None     # its first batch's place in the lease order (1-based)
    waits: tuple[float, ...]    # first attempts, enqueue -> lease
    fifo: tuple[float, ...]     # the same jobs under FIFO (computed)
    retried: tuple[float, ...]  # jobs that ran more than once, enqueue -> last lease


@dataclass(frozen=True)
class FairScene:
    tenants: tuple[TenantWaits, ...]   # the whale first
    whale: str
    concurrency: int
    seconds_per_row: float | None      # the whale's measured slot-seconds per row
    arrival: float | None              # the small tenants' enqueue, seconds after the whale's
    whale_ahead: int                   # whale rows not yet leased when they arrived
    first_whale_batches: int           # whale batches leased before any small tenant's
    whale_finished: float | None       # the whale's last row done, seconds after its enqueue
    slot_freed: float | None           # the first batch to end after they arrived, seconds after
    others_slot_seconds: float         # wall time of the other tenants' batches, summed

    @property
    def small(self) -> tuple[TenantWaits, ...]:
        return tuple(t for t in self.tenants if t.tenant != self.whale)

    def small_waits(self) -> list[float]:
        return [w for t in self.small for w in t.waits]

    def small_fifo(self) -> list[float]:
        return [w for t in self.small for w in t.fifo]


def fifo_waits(rows: Sequence[Row], whale_rows: Sequence[Row], seconds_per_row: float,
               concurrency: int) -> list[float]:
    """Where FIFO would have put each row (computed, not measured): the whale
    rows enqueued before it and not yet leased when it was enqueued, times
    the whale's measured slot-seconds per row, over the slots. Only the
    whale's rows are counted ahead, so this is a lower bound."""
    ids = sorted(int(r["id"]) for r in whale_rows)
    leased = sorted(float(r["started"]) for r in whale_rows if r["started"] is not None)
    out = []
    for r in rows:
        before = bisect.bisect_left(ids, int(r["id"]))
        already = bisect.bisect_right(leased, float(r["created"]))
        out.append(max(0, before - already) * seconds_per_row / concurrency)
    return out


def fair_scene(jobs: Sequence[Row], batches: Sequence[Row], *, whale: str, concurrency: int,
               priority: str = "default") -> FairScene:
    """Scene 1's table: per tenant, first-attempt waits next to the FIFO
    wait computed from the same rows. `batches` are the scene's (one class)."""
    scene_batches = sorted((b for b in batches if b["priority"] == priority),
                           key=lambda b: int(b["batch_id"]))
    order: dict[str, int] = {}
    for place, b in enumerate(scene_batches, start=1):
        order.setdefault(str(b["tenant_id"]), place)
    whale_rows = [r for r in jobs if r["tenant_id"] == whale]
    spr = seconds_per_job(scene_batches, whale, priority)
    by_tenant: dict[str, list[Row]] = {}
    for r in jobs:
        by_tenant.setdefault(str(r["tenant_id"]), []).append(r)
    tenants = []
    for tenant in sorted(by_tenant, key=lambda t: (t != whale, order.get(t, 10**9), t)):
        rows = by_tenant[tenant]
        firsts = [r for r in rows if first_attempt(r)]
        tenants.append(TenantWaits(
            tenant=tenant, jobs=len(rows),
            done=sum(r["status"] == "done" for r in rows), dead=sum(r["status"] == "dead" for r in rows),
            first_batch=order.get(tenant),
            waits=tuple(w for r in firsts if (w := wait_of(r)) is not None),
            fifo=tuple(fifo_waits(firsts, whale_rows, spr, concurrency)) if spr is not None else (),
            retried=tuple(w for r in rows if int(r["attempts"]) > 1 and (w := wait_of(r)) is not None),
        ))
    small = [r for r in jobs if r["tenant_id"] != whale]
    whale_t0 = min((float(r["created"]) for r in whale_rows), default=None)
    arrival = min((float(r["created"]) for r in small), default=None)
    ahead = 0
    if arrival is not None:
        ahead = sum(r["started"] is None or float(r["started"]) > arrival for r in whale_rows)
    small_first = min((order[t.tenant] for t in tenants if t.tenant != whale and t.tenant in order),
                      default=len(scene_batches) + 1)
    finished = [float(r["finished"]) for r in whale_rows if r["finished"] is not None]
    t_arrival = min((float(r["created"]) for r in small), default=None)
    ends = [float(b["ended"]) for b in scene_batches
            if t_arrival is not None and b["ended"] is not None and float(b["ended"]) > t_arrival]
    others = sum(float(b["ended"]) - float(b["created"]) for b in scene_batches
                 if b["tenant_id"] != whale and b["ended"] is not None)
    return FairScene(
        tenants=tuple(tenants), whale=whale, concurrency=concurrency, seconds_per_row=spr,
        arrival=None if arrival is None or whale_t0 is None else arrival - whale_t0,
        whale_ahead=ahead, first_whale_batches=small_first - 1,
        whale_finished=max(finished) - whale_t0 if finished and whale_t0 is not None else None,
        slot_freed=min(ends) - t_arrival if ends and t_arrival is not None else None,
        others_slot_seconds=others,
    )


# -- scene 2: the interactive reservation -------------------------------
@dataclass(frozen=True)
class ClassWaits:
    tenant: str
    interactive: tuple[float, ...]          # first attempts
    without_reservation: tuple[float, ...]  # computed, for the same jobs
    bulk: tuple[float, ...]                 # first attempts
    bulk_jobs: int


def natural_end(batch: Row, seconds_per_row: float) -> float:
    """When a bulk batch would have ended had nothing recalled it: its
    measured end if it ran to the end, else its rows at the measured pace."""
    if batch["outcome"] == "ok" and batch["ended"] is not None:
        return float(batch["ended"])
    return float(batch["created"]) + int(batch["job_count"]) * seconds_per_row


def without_reservation(job: Row, bulk_batches: Sequence[Row], seconds_per_row: float) -> float | None:
    """How long strict priority alone would have kept an interactive job
    waiting (computed): until the first bulk batch running at its arrival
    ended. None when a slot was free at its arrival."""
    t = float(job["created"])
    live = [b for b in bulk_batches
            if float(b["created"]) <= t and (b["ended"] is None or float(b["ended"]) > t)]
    if not live:
        return None
    return max(0.0, min(natural_end(b, seconds_per_row) for b in live) - t)


def reservation_scene(jobs: Sequence[Row], batches: Sequence[Row], *,
                      fallback_seconds_per_row: float | None) -> tuple[list[ClassWaits], float | None]:
    """Scene 2's table, and the slot-seconds per bulk row it used."""
    bulk_batches = [b for b in batches if b["priority"] == "bulk"]
    tenants_bulk = {str(b["tenant_id"]) for b in bulk_batches}
    spr = None
    for tenant in sorted(tenants_bulk):
        spr = spr or seconds_per_job(bulk_batches, tenant, "bulk")
    spr = spr or fallback_seconds_per_row
    out = []
    for tenant in sorted({str(r["tenant_id"]) for r in jobs}):
        rows = [r for r in jobs if r["tenant_id"] == tenant]
        inter = [r for r in rows if r["priority"] == "interactive" and first_attempt(r)]
        bulk = [r for r in rows if r["priority"] == "bulk"]
        without = [] if spr is None else [w for r in inter
                                          if (w := without_reservation(r, bulk_batches, spr)) is not None]
        out.append(ClassWaits(
            tenant=tenant,
            interactive=tuple(w for r in inter if (w := wait_of(r)) is not None),
            without_reservation=tuple(without),
            bulk=tuple(w for r in bulk if first_attempt(r) and (w := wait_of(r)) is not None),
            bulk_jobs=len(bulk),
        ))
    out.sort(key=lambda c: (not c.bulk_jobs, c.tenant))
    return out, spr
