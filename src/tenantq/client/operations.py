"""Every method of `Queue` and `AsyncQueue`, written once.

Each is a generator of steps (store/steps.py, client/runner.py): it
validates its arguments, yields the statements to run and decides between
them, and never does I/O. `Queue` runs the steps on a sync connection,
`AsyncQueue` awaits them on an async one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from tenantq.client.runner import Subscribe, Wait, atomic_operation, operation
from tenantq.domain import validation
from tenantq.domain.records import JobInfo, NewJob
from tenantq.egress.policy import parse_rules
from tenantq.errors import InvalidInput, JobNotFound, WaitTimeout
from tenantq.store import enqueue, jobs, rates, wakes, workers
from tenantq.store.db import Database
from tenantq.store.queries import sql
from tenantq.store.steps import Query, Steps

FINAL_STATUSES = ("done", "dead", "cancelled")
# rows deleted per prune statement: small, so locks are few and short
PRUNE_CHUNK = 1000


@dataclass(frozen=True)
class JobSpec:
    """One job for `Queue.enqueue_many`."""

    tenant: str
    kind: str
    payload: Any = None
    priority: str = "default"
    max_attempts: int = 5
    delay: float = 0.0
    key: str | None = None
    actor: str | None = None
    meta: dict[str, Any] | None = None


_SPEC_FIELDS = frozenset(JobSpec.__dataclass_fields__)


def _job_id(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**63:
        raise InvalidInput(f"job id must be a positive integer, got {value!r}")
    return value


# the most names a tenant's restriction holds (tenants.host_function_count)
MAX_TENANT_HOST_FUNCTIONS = 256


def _host_functions(value: str | list[str]) -> list[str] | None:
    """A tenant's host-function restriction as stored: None for "*" (every
    function its handlers declare), else the names, checked and deduplicated
    ("" or []: none)."""
    names = value if isinstance(value, list) else [n.strip() for n in value.split(",") if n.strip()]
    if names == ["*"]:
        return None
    if "*" in names:
        raise InvalidInput('--host-functions: "*" (every declared function) stands alone')
    if len(set(names)) > MAX_TENANT_HOST_FUNCTIONS:
        raise InvalidInput(f"--host-functions: at most {MAX_TENANT_HOST_FUNCTIONS} names, "
                           f"got {len(set(names))}")
    for name in names:
        validation.kind(name, "host function name")
    return sorted(set(names))


def _retention(value: object, what: str) -> float | None:
    """A retention override in seconds; None for none given or "default"."""
    if value is None or (isinstance(value, str) and value.strip() == "default"):
        return None
    try:
        return validation.duration(value, what)
    except InvalidInput as exc:
        raise InvalidInput(f"{exc} (or default: the workers' TENANTQ_RETAIN_* setting)") from None


def _bodies(specs: list[Any]) -> Iterator[enqueue.Body]:
    """The jobs' payloads and metas, checked one at a time as they are read."""
    for index, spec in enumerate(specs):
        try:
            fields = spec if isinstance(spec, Mapping) else spec.__dict__  # as enqueue_many reads them
            yield validation.job_body(fields.get("payload"), fields.get("meta"))
        except InvalidInput as exc:
            raise InvalidInput(f"job {index}: {exc}") from None


class Operations:
    """The methods; see `tenantq.Queue` for the class users construct."""

    db: Database

    # -- producing -------------------------------------------------------
    @operation
    def enqueue(
        self,
        tenant: str,
        kind: str,
        payload: Any = None,
        *,
        priority: str = "default",
        max_attempts: int = 5,
        delay: float = 0.0,
        key: str | None = None,
        actor: str | None = None,
        meta: dict[str, Any] | None = None,
        conn: Any = None,
        now: datetime | None = None,
    ) -> Steps[int]:
        """Add one job; returns its id (the existing id if `key` was used before).

        `actor` (who the job is for) and `meta` (a small JSON object of
        request context) travel with the job: `ctx.actor`, `ctx.meta`.
        With `conn` (your open connection: psycopg, SQLAlchemy or Django),
        the job is written in your transaction: it exists, and wakes a
        worker, only if you commit.
        """
        job = validation.new_job(tenant, kind, payload, priority_=priority, max_attempts_=max_attempts,
                                 delay_=delay, key=key, actor_=actor, meta=meta)
        return (yield from enqueue.insert_one_steps(*job, schema=self.db.schema,
                                                    channel=self.db.notify_channel, now=now))

    @atomic_operation
    def enqueue_many(
        self, specs: Iterable[JobSpec | Mapping[str, Any]], *, conn: Any = None, now: datetime | None = None
    ) -> Steps[list[int]]:
        """Add many jobs in one statement; ids come back in input order.

        Every job is validated; one bad job rejects the whole call and
        nothing is written. `conn`: as for `enqueue` (the jobs are written
        in a savepoint of your transaction, and every job is validated
        before the first statement, so a bad one never touches it). From
        1,000 jobs without idempotency keys they are written with COPY, and
        on tenantq's own connection their payloads are checked as the rows
        are written (store/enqueue.py).
        """
        specs = list(specs)  # read twice: the fields now, the bodies as they are written
        envelopes: list[NewJob] = []
        for index, spec in enumerate(specs):
            fields = spec if isinstance(spec, Mapping) else spec.__dict__
            # (a JobSpec itself has no other fields)
            unknown = () if type(spec) is JobSpec else fields.keys() - _SPEC_FIELDS
            if unknown:
                raise InvalidInput(f"job {index}: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
            try:
                envelopes.append(validation.job_envelope(
                    fields.get("tenant"), fields.get("kind"),
                    priority_=fields.get("priority", "default"),
                    max_attempts_=fields.get("max_attempts", 5),
                    delay_=fields.get("delay", 0.0), key=fields.get("key"), actor_=fields.get("actor"),
                ))
            except InvalidInput as exc:
                raise InvalidInput(f"job {index}: {exc}") from None
        bodies: Iterable[enqueue.Body] = _bodies(specs)
        if conn is not None:
            bodies = list(bodies)
        return (yield from enqueue.enqueue_steps(envelopes, bodies, schema=self.db.schema,
                                                 channel=self.db.notify_channel, now=now))

    @operation
    def cancel(self, job_id: int, *, by: str | None = None) -> Steps[bool]:
        """Cancel a job: a pending one ends `cancelled` now; a running one is
        stopped by its worker (a sandboxed job killed, an inline handler told
        through `ctx.cancelled`) and ends `cancelled` within about a second
        (docs/controls.md). `by`: who cancelled it (shown by `tenantq job`).
        False if the job had already ended."""
        return (yield from jobs.cancel_steps(_job_id(job_id), by=validation.actor(by),
                                             channel=self.db.notify_channel))

    # -- waiting -----------------------------------------------------------
    @operation
    def wait(self, job_id: int, *, timeout: float | None = None) -> Steps[JobInfo]:
        """The job once it has ended (done, dead or cancelled), as soon as it
        ends: woken by the notification its settle sends, never by polling
        (unless notifications are lost: client/listener.py). Raises
        `tenantq.WaitTimeout` (a TimeoutError) when `timeout` seconds pass first."""
        _job_id(job_id)
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                    or not math.isfinite(timeout) or timeout < 0):
            raise InvalidInput(f"timeout must be a number of seconds, 0 or more, got {timeout!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        waiter = yield Subscribe(job_id)  # before reading the status: no end can slip between
        while True:
            status = yield from jobs.state_steps(job_id)
            if status is None:
                raise JobNotFound(f"no job with id {job_id}")
            if status in FINAL_STATUSES:
                return (yield from jobs.job_steps(job_id))
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise WaitTimeout(f"job {job_id} did not end within {timeout:g} s (it is {status})")
            yield Wait(waiter, remaining)

    # -- inspecting ------------------------------------------------------
    @operation
    def job(self, job_id: int) -> Steps[JobInfo]:
        """Status, attempts, last error, result, the attempt history (and
        more) of one job; for a pending one, why it waits."""
        from tenantq.fairness.explain import why_waiting_steps

        info = yield from jobs.job_steps(_job_id(job_id))
        if info.status == "pending":
            info.why_waiting.extend((yield from why_waiting_steps(info)))
        return info

    @operation
    def status(self, tenant: str | None = None) -> Steps[list[dict[str, Any]]]:
        """Per tenant and class: pending, runnable, running, done, dead, cancelled, oldest age."""
        if tenant is not None:
            validation.tenant_id(tenant)
        rows: list[dict[str, Any]] = yield Query(sql("jobs", "status_counts"), {"tenant_id": tenant})
        return rows

    @operation
    def tenants(self, tenant: str | None = None) -> Steps[list[dict[str, Any]]]:
        """Weight, cap, live batches and DRR deficit per tenant."""
        # a tenant whose first jobs no worker has folded yet is listed too
        yield from wakes.fold_steps()
        rows: list[dict[str, Any]] = yield Query(sql("tenants", "list"), {"tenant_id": tenant})
        return rows

    @operation
    def running_batches(self) -> Steps[list[dict[str, Any]]]:
        rows: list[dict[str, Any]] = yield Query(sql("batches", "live"))
        return rows

    @operation
    def workers(self) -> Steps[list[dict[str, Any]]]:
        """The live workers: id, host, pid, the kinds each claims (None: every
        kind), sandbox driver, started and heartbeat times, and its executor's
        failures in a row with the last error."""
        return (yield from workers.live_steps())

    @operation
    def dead_jobs(self, tenant: str | None = None, *, limit: int = 100) -> Steps[list[dict[str, Any]]]:
        if tenant is not None:
            validation.tenant_id(tenant)
        return (yield from jobs.dead_steps(tenant_id=tenant, limit=limit))

    # -- operating ---------------------------------------------------------
    @operation
    def prune(self, *, older_than_seconds: float | None = None, dry_run: bool = False,
              limit: int = 10_000) -> Steps[dict[str, int]]:
        """Delete finished jobs past their retention (TENANTQ_RETAIN_DONE,
        _CANCELLED, _DEAD, or the tenant's own; `older_than_seconds`
        overrides them all), with their attempt history, in chunks of 1,000
        up to `limit`. Returns how many went by status; with dry_run, how
        many would (nothing is deleted)."""
        from tenantq.settings import Settings

        if older_than_seconds is not None:
            older_than_seconds = validation.duration(older_than_seconds, "older-than")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidInput(f"limit must be a positive integer, got {limit!r}")
        retention = Settings().retention()
        # the walk is over tenant rows: a tenant no worker has folded yet too
        yield from wakes.fold_steps()
        total: dict[str, int] = {}
        while sum(total.values()) < limit:
            # a dry run deletes nothing, so it counts in one statement
            chunk = limit if dry_run else min(PRUNE_CHUNK, limit - sum(total.values()))
            went = yield from jobs.prune_steps(retention=retention, older_than=older_than_seconds,
                                               limit=chunk, dry_run=dry_run)
            for status, count in went.items():
                total[status] = total.get(status, 0) + count
            if dry_run or sum(went.values()) < chunk:
                break
        return total

    @atomic_operation
    def retry_dead(
        self, ids: Sequence[int] | None = None, *, tenant: str | None = None
    ) -> Steps[list[int]]:
        """Replay dead jobs: the given ids, or all (of one tenant) when ids is None."""
        if tenant is not None:
            validation.tenant_id(tenant)
        return (yield from jobs.retry_dead_steps(ids=ids, tenant_id=tenant, channel=self.db.notify_channel))

    @operation
    def set_tenant(
        self, tenant: str, *, weight: int | None = None, max_sandboxes: int | None = None,
        egress: str | list[str] | None = None, retain_done: str | float | None = None,
        retain_cancelled: str | float | None = None, retain_dead: str | float | None = None,
        host_functions: str | list[str] | None = None,
    ) -> Steps[dict[str, Any]]:
        """Set a tenant's weight, cap (max_sandboxes=0 removes the cap),
        egress rules ("api.stripe.com,*.salesforce.com:443"; "" = none)
        and/or retention overrides: how long its finished jobs are kept, per
        final status, as seconds or "30d", "12h"...; "default" goes back to
        the workers' TENANTQ_RETAIN_* (docs/retention.md); the host functions
        its handlers may call ("orders.for_month,crm.lookup"; "" = none;
        "*" = every one they declare, docs/tenant-data.md). None leaves a
        setting as it is."""
        validation.tenant_id(tenant)
        rules = None if egress is None else [str(r) for r in parse_rules(egress)]
        if weight is not None and not 1 <= weight <= 10000:
            raise InvalidInput(f"weight must be between 1 and 10000, got {weight}")
        if max_sandboxes is not None and max_sandboxes < 0:
            raise InvalidInput(f"max-sandboxes must be 0 (no cap) or more, got {max_sandboxes}")
        retention: dict[str, Any] = {}
        for status, value in (("done", retain_done), ("cancelled", retain_cancelled), ("dead", retain_dead)):
            retention[f"retain_{status}_set"] = value is not None
            retention[f"retain_{status}"] = _retention(value, f"retain-{status}")
        functions = None if host_functions is None else _host_functions(host_functions)
        rows = yield Query(sql("tenants", "upsert"), {
            "tenant_id": tenant, "weight": weight,
            "max_sandboxes": max_sandboxes or None, "clear_cap": max_sandboxes == 0,
            "egress": rules, **retention,
            "host_functions_set": host_functions is not None, "host_functions": functions,
        })
        return dict(rows[0])

    @operation
    def pause_tenant(self, tenant: str, *, paused: bool = True) -> Steps[dict[str, Any]]:
        """Pause a tenant (paused=False: resume it): no new batch of its jobs
        starts; running batches finish; enqueueing goes on."""
        validation.tenant_id(tenant)
        rows = yield Query(sql("tenants", "set_paused"), {"tenant_id": tenant, "paused": paused})
        return dict(rows[0])

    @operation
    def set_rate_limit(self, tenant: str | None = None, kind: str | None = None, *,
                       rate: str | float | None, burst: float | None = None) -> Steps[dict[str, Any]]:
        """Limit a tenant (`tenant=`), one kind of a tenant (both), or a kind
        across every tenant (`kind=`) to `rate` ("10/s", "100/m", "5000/h",
        or a number per second), with bursts of up to `burst` jobs (default:
        one second's worth, at least 1). rate=None removes the limit.
        Changes apply to the next pick of every worker."""
        return (yield from rates.set_steps(tenant=tenant, kind=kind, rate=rate, burst=burst))

    @operation
    def rate_limits(self, tenant: str | None = None) -> Steps[list[dict[str, Any]]]:
        """Every rate limit (those covering one tenant: its own, its kinds',
        and the kinds' global ones), with the tokens each has now."""
        if tenant is not None:
            validation.tenant_id(tenant)
        return (yield from rates.list_steps(tenant))

    @atomic_operation
    def reap(self) -> Steps[int]:
        """Reap expired leases now; returns how many jobs went back (or died)."""
        return len((yield from jobs.expire_steps()))
