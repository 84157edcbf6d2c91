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
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


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
    visits: list[Visit] = []
    for c in candidates:
        if c.at_cap:
            continue
        continuing = turn_open and c.tenant_id == cursor
        credit = c.deficit if continuing else c.deficit + quantum * c.weight
        visits.append(_visit(c.tenant_id, credit, mode, batch_size))
    if not visits or any(v.eligible for v in visits):
        return visits
    weights = {c.tenant_id: c.weight for c in candidates}
    rounds = min(math.ceil((_threshold(mode) - v.deficit) / (quantum * weights[v.tenant_id])) for v in visits)
    rounds = max(rounds, 1)
    return [_visit(v.tenant_id, v.deficit + rounds * quantum * weights[v.tenant_id], mode, batch_size)
            for v in visits]


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
    if mode is Mode.JOBS:
        left = visit.deficit - claimed
        return left, left >= 1
    left = visit.deficit - est_job_cost * claimed
    return left, left > 0


def correction(*, actual_seconds: float, charged_seconds: float) -> float:
    """What to subtract from the deficit when a runtime-charged batch ends."""
    return actual_seconds - charged_seconds


def _threshold(mode: Mode) -> float:
    return 1.0 if mode is Mode.JOBS else 1e-9


def _eligible(credit: float, mode: Mode) -> bool:
    return credit >= _threshold(mode)


def _batch_limit(credit: float, mode: Mode, batch_size: int) -> int:
    if mode is Mode.JOBS:
        return max(1, min(batch_size, math.floor(credit)))
    return batch_size
