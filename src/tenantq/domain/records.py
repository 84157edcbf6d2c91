"""Plain records that cross the store boundary."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, NamedTuple

Priority = Literal["interactive", "default", "bulk"]
PRIORITIES: tuple[Priority, ...] = ("interactive", "default", "bulk")
Status = Literal["pending", "running", "done", "dead", "cancelled"]


class NewJob(NamedTuple):
    """A validated job, ready to insert; its payload travels beside it as
    the JSON text to store (validation.job_body). A named tuple, not a
    frozen dataclass: a bulk enqueue makes one per job, and a tuple is
    built in a quarter of the time."""

    tenant_id: str
    kind: str
    priority: Priority = "default"
    max_attempts: int = 5
    delay: float = 0.0
    key: str | None = None
    # the security envelope: who asked for it, and the request context (JSON text)
    actor: str | None = None
    meta_json: str | None = None


@dataclass(frozen=True)
class ClaimedJob:
    id: int
    tenant_id: str
    kind: str
    payload: Any
    attempt: int
    max_attempts: int
    # seconds it was runnable before this claim (for the wait histogram)
    waited: float = 0.0
    # the security envelope it was enqueued with (ctx.actor, ctx.meta)
    actor: str | None = None
    meta: dict[str, Any] | None = None


@dataclass(frozen=True)
class Batch:
    """A lease on some jobs of one tenant. batch_id is the fencing token."""

    batch_id: int
    tenant_id: str
    priority: Priority
    lease_expires_at: datetime
    jobs: tuple[ClaimedJob, ...]
    # the tenant's egress rules when it was claimed; empty = no network
    egress: tuple[str, ...] = ()
    # the tenant's restriction of host functions when it was claimed; None:
    # every one its handlers declare
    host_functions: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Settlement:
    """What happens to one job of a batch: the store applies it verbatim."""

    job_id: int
    status: Literal["done", "pending", "dead", "cancelled"]
    result: Any = None
    error: str | None = None
    delay: float = 0.0
    # the result already serialised (by the check that it can be stored), so
    # the settle does not serialise it a second time
    result_json: str | None = None
    # the attempt's host-function calls, counted by the host (host_functions.py)
    host_calls: dict[str, Any] | None = None


@dataclass(frozen=True)
class JobInfo:
    id: int
    tenant_id: str
    kind: str
    priority: Priority
    status: Status
    attempts: int
    max_attempts: int
    payload: Any
    result: Any
    last_error: str | None
    idempotency_key: str | None
    run_after: datetime
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    batch_id: int | None
    lease_owner: str | None
    lease_expires_at: datetime | None
    actor: str | None = None
    meta: dict[str, Any] | None = None
    # who cancelled it (`cancel(..., by=)`); for a running job, when it was asked to stop
    cancelled_by: str | None = None
    cancel_requested_at: datetime | None = None
    why_waiting: list[str] = field(default_factory=list)
    # requests its sandbox's egress proxy refused while it ran (host, reason, when)
    egress_blocked: list[dict[str, Any]] = field(default_factory=list)
    # times it was sent back from dead (`tenantq dead retry`); attempts
    # count from 1 again after each
    replays: int = 0
    # every attempt that ended, oldest first: attempt, replay, started_at,
    # finished_at, worker_id, driver, outcome (done | failed | released |
    # lost), error, seconds (see docs/states.md)
    attempts_history: list[dict[str, Any]] = field(default_factory=list)
    # one line on how it ended, from the history: "succeeded on attempt 2
    # after: <the previous attempt's error>"; None while nothing ended
    outcome_note: str | None = None

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, value in self.__dict__.items():
            if name == "attempts_history":
                # the rows' times too (payload and result are JSON already)
                value = [{k: _iso(v) for k, v in row.items()} for row in value]
            out[name] = _iso(value)
        return out


def _iso(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value
