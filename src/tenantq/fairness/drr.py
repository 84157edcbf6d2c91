"""Deficit round robin over the queues (tenant x class) that have work.

Pure arithmetic, no database: the picker loads the candidates in rotation
order, asks `plan()` which of them may take a batch and how big, tries them
in that order, and writes back the deficits of the one it served (and of
those it credited on the way).

Each visit to a queue credits it `quantum * weight` cost units, once per
turn. Cost is one unit per job (`Mode.JOBS`: the batch size is capped by the
credit, and the credit is charged at claim time) or measured run seconds
(`Mode.RUNTIME`: an estimate is charged at claim time and corrected with the
measured run time when the batch ends; a deficit may go negative, which
makes a queue with long jobs sit out turns until its credit recovers). A
turn stays open on the same queue while it has credit for more, so a
weight-3 tenant takes three batches in a row where a weight-1 tenant takes
one. A queue at its tenant's cap is passed over without credit. When a
queue empties its deficit resets to zero: idle tenants keep no credit.

Nothing here raises on what the store holds or a job reported: a deficit,
run time or average that is NaN, infinite, negative where it cannot be, or
not a number at all is read as a safe value (a deficit of 0, no seconds, the
default estimate), and every result is bounded (`MAX_CREDIT`), so a hostile
number can neither poison the schedule nor overflow into one.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

# Bound on a queue's credit or debt, in cost units (jobs, or seconds: 1e12 s
# is 30,000 years). Jobs mode credit is at most batch size x weight; a debt
# is at most what the queue's batches really ran.
MAX_CREDIT = 1e12
# Bound on the per-job estimate charged at claim time (runtime mode), in
# seconds: 11 days per job.
MAX_JOB_SECONDS = 1e6


def finite_or_none(value: object) -> float | None:
    """`value` as a finite float, or None (NaN, infinity, not a number)."""
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def safe_deficit(value: object) -> float:
    """A stored or computed deficit: 0 if it is not a finite number, else
    within +-MAX_CREDIT. Negative is legitimate (runtime debt)."""
    number = finite_or_none(value)
    return 0.0 if number is None else min(max(number, -MAX_CREDIT), MAX_CREDIT)


def safe_seconds(value: object, *, default: float = 0.0, limit: float = MAX_CREDIT) -> float:
    """A run time or cost: `default` if it is not a finite, non-negative
    number, else at most `limit`."""
    number = finite_or_none(value)
    if number is None or number < 0:
        return default
    return min(number, limit)


def estimate(avg_job_seconds: object, *, default: float) -> float:
    """The per-job cost charged at claim time in runtime mode: the queue's
    average when it is a usable number, else `default` (itself bounded)."""
    fallback = safe_seconds(default, limit=MAX_JOB_SECONDS)
    return safe_seconds(avg_job_seconds, default=fallback, limit=MAX_JOB_SECONDS)


class Mode(enum.StrEnum):
    JOBS = "jobs"
    RUNTIME = "runtime"


@dataclass(frozen=True)
class Candidate:
    """A queue with work, as the picker sees it."""

    tenant_id: str
    weight: int
    deficit: float
    at_cap: bool = False


@dataclass(frozen=True)
class Visit:
    """One queue's turn in rotation order.

    `deficit` is its credit after this visit's quantum. An `eligible` visit
    may take a batch of at most `max_jobs`; a visit that is not eligible
    (runtime mode, still in debt) only keeps the credit it was given.
    """

    tenant_id: str
    deficit: float
    eligible: bool
    max_jobs: int


def plan(
    candidates: list[Candidate],
    *,
    cursor: str,
    turn_open: bool,
    mode: Mode,
    quantum: float,
    batch_size: int,
) -> list[Visit]:
    """The visits of one pick, in rotation order.

    The picker walks them in order and stops at the first eligible visit
    whose claim finds jobs; the credits of the visits it walked past are
    written back, those after it are not (they were not visited). When no
    queue has enough credit on one pass (runtime mode debt), every queue is
    credited the number of whole rounds the first of them needs to recover,
    as DRR would after that many passes.
    """
    quantum = safe_seconds(quantum, default=1.0) or 1.0
    batch_size = max(1, batch_size)
    weights = {c.tenant_id: max(1, c.weight) for c in candidates}
    visits: list[Visit] = []
    for c in candidates:
        if c.at_cap:
            continue
        continuing = turn_open and c.tenant_id == cursor
        deficit = safe_deficit(c.deficit)
        credit = deficit if continuing else safe_deficit(deficit + quantum * weights[c.tenant_id])
        visits.append(_visit(c.tenant_id, credit, mode, batch_size))
    if not visits or any(v.eligible for v in visits):
        return visits
    rounds = max(min(_rounds_to_recover(v.deficit, quantum * weights[v.tenant_id], mode) for v in visits), 1)
    return [_visit(v.tenant_id, safe_deficit(v.deficit + rounds * quantum * weights[v.tenant_id]), mode,
                   batch_size)
            for v in visits]


def _rounds_to_recover(deficit: float, step: float, mode: Mode) -> int:
    """Whole rounds of `step` credit a queue in debt needs to become eligible
    (bounded: a tiny quantum cannot make it overflow)."""
    need = (_threshold(mode) - deficit) / step
    if not (math.isfinite(need) and need < 4 * MAX_CREDIT):
        return int(4 * MAX_CREDIT)
    rounds = max(math.ceil(need), 1)
    for _ in range(3):  # float rounding at a large debt can leave it just short
        if deficit + rounds * step >= _threshold(mode):
            break
        rounds += 1
    return rounds


def _visit(tenant_id: str, credit: float, mode: Mode, batch_size: int) -> Visit:
    return Visit(tenant_id, credit, _eligible(credit, mode), _batch_limit(credit, mode, batch_size))


def charge(visit: Visit, *, claimed: int, mode: Mode, est_job_cost: float = 0.0) -> tuple[float, bool]:
    """The queue's deficit after a batch of `claimed` jobs, and whether its
    turn stays open for another batch.

    In runtime mode the real cost is only known when the batch ends, so the
    batch is charged an estimate now (the queue's average job seconds times
    the jobs claimed) and corrected by `correction()` at the end; this keeps
    a queue of cheap jobs from taking a batch per visit while its credit
    grows without bound.
    """
    claimed = max(0, claimed)
    if mode is Mode.JOBS:
        left = safe_deficit(safe_deficit(visit.deficit) - claimed)
        return left, left >= 1
    cost = safe_seconds(est_job_cost, limit=MAX_JOB_SECONDS) * claimed
    left = safe_deficit(safe_deficit(visit.deficit) - cost)
    return left, left > 0


def correction(*, actual_seconds: float, charged_seconds: float) -> float:
    """What to subtract from the deficit when a runtime-charged batch ends
    (queues.sql `charge` does the same in SQL). A run time that is not a
    finite, non-negative number counts as 0."""
    return safe_seconds(actual_seconds) - safe_seconds(charged_seconds)


def _threshold(mode: Mode) -> float:
    return 1.0 if mode is Mode.JOBS else 1e-9


def _eligible(credit: float, mode: Mode) -> bool:
    return credit >= _threshold(mode)


def _batch_limit(credit: float, mode: Mode, batch_size: int) -> int:
    if mode is Mode.JOBS:
        return max(1, min(batch_size, math.floor(credit)))
    return batch_size
