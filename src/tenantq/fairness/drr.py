"""Deficit round robin over the queues (tenant x class) that have work.

Pure arithmetic, no database: the picker loads the candidates in rotation
order, asks `plan()` which of them may take a batch and how big, tries them
in that order, and writes back the deficits of the one it served (and of
those it credited on the way).

Each visit to a queue credits it `quantum * weight` cost units, once per
turn. Cost is one unit per job (`Mode.JOBS`: the batch size is capped by the
credit, and the credit is charged at claim time) or measured run seconds
(`Mode.RUNTIME`: the credit only decides eligibility, the run time is
charged when the batch ends, and a deficit may go negative, which makes a
queue with long jobs sit out turns until its credit recovers). A turn stays
open on the same queue while it has credit for more (jobs mode), so a
weight-3 tenant takes three batches in a row where a weight-1 tenant takes
one. A queue at its tenant's cap is passed over without credit. When a queue
empties its deficit resets to zero: idle tenants keep no credit.
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
class Grant:
    """Permission for `tenant_id` to take a batch of at most `max_jobs`.

    `deficit` is the queue's credit after this visit's quantum, before the
    batch is charged.
    """

    tenant_id: str
    deficit: float
    max_jobs: int


@dataclass(frozen=True)
class Plan:
    grants: list[Grant]
    # credit given to queues that could not be served on this pass
    # (runtime mode, still in debt): written back so the debt shrinks
    credited: dict[str, float]


def plan(
    candidates: list[Candidate],
    *,
    cursor: str,
    turn_open: bool,
    mode: Mode,
    quantum: float,
    batch_size: int,
) -> Plan:
    """Which candidates may take a batch, in the order to try them.

    `candidates` are in rotation order, starting with the cursor's queue if
    it still has work. When no queue has enough credit on one pass (runtime
    mode debt), every queue is credited the number of whole rounds the
    least-indebted one needs, as DRR would after that many passes.
    """
    grants: list[Grant] = []
    credited: dict[str, float] = {}
    debtors: list[Candidate] = []
    for c in candidates:
        if c.at_cap:
            continue
        continuing = turn_open and c.tenant_id == cursor
        credit = c.deficit if continuing else c.deficit + quantum * c.weight
        if _eligible(credit, mode):
            grants.append(Grant(c.tenant_id, credit, _batch_limit(credit, mode, batch_size)))
        else:
            credited[c.tenant_id] = credit
            debtors.append(Candidate(c.tenant_id, c.weight, credit))
    if grants or not debtors:
        return Plan(grants, credited)
    rounds = min(math.ceil((_threshold(mode) - d.deficit) / (quantum * d.weight)) for d in debtors)
    rounds = max(rounds, 1)
    for d in debtors:
        credit = d.deficit + rounds * quantum * d.weight
        credited[d.tenant_id] = credit
        if _eligible(credit, mode):
            grants.append(Grant(d.tenant_id, credit, _batch_limit(credit, mode, batch_size)))
    return Plan(grants, credited)


def charge(grant: Grant, *, claimed: int, mode: Mode) -> tuple[float, bool]:
    """The queue's deficit after a batch of `claimed` jobs, and whether its
    turn stays open for another batch."""
    if mode is Mode.JOBS:
        left = grant.deficit - claimed
        return left, left >= 1
    # runtime: charged when the batch ends; one batch per visit
    return grant.deficit, False


def _threshold(mode: Mode) -> float:
    return 1.0 if mode is Mode.JOBS else 1e-9


def _eligible(credit: float, mode: Mode) -> bool:
    return credit >= _threshold(mode)


def _batch_limit(credit: float, mode: Mode, batch_size: int) -> int:
    if mode is Mode.JOBS:
        return max(1, min(batch_size, math.floor(credit)))
    return batch_size
