"""Finding jobs and acting on a filtered set: the operations behind
`tenantq jobs` and the dashboard's search (a mixin of Queue and AsyncQueue).

The filters, the same for each operation (store/search.py validates them;
bad input raises InvalidInput before anything runs):

    tenant   a tenant id          kind    a job kind
    status   pending | running | done | dead | cancelled
    priority interactive | default | bulk
    actor    who the job is for   meta    {"key": "value"} matched by containment
                                          (or KEY=VALUE strings)
    since    created in the last 30s / 15m / 1h / 7d (or seconds, or a timedelta)

`find_jobs` returns one page, newest first; `cancel_jobs`,
`cancel_running_jobs` and `retry_dead_jobs` act on every matching job, a
chunk per statement, and return how many they changed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from tenantq.client.runner import operation
from tenantq.domain import validation
from tenantq.errors import InvalidInput
from tenantq.store import search
from tenantq.store.db import Database
from tenantq.store.queries import sql
from tenantq.store.search import JobFilter, JobPage
from tenantq.store.steps import Query, Steps

MetaFilter = Mapping[str, Any] | Sequence[str] | str | None
Since = str | float | timedelta | None


class Finding:
    """Search operations, written as steps like client/operations.py."""

    db: Database

    @operation
    def find_jobs(
        self,
        *,
        tenant: str | None = None,
        kind: str | None = None,
        status: str | None = None,
        actor: str | None = None,
        meta: MetaFilter = None,
        since: Since = None,
        priority: str | None = None,
        limit: int = search.DEFAULT_LIMIT,
        before: str | None = None,
        now: datetime | None = None,
    ) -> Steps[JobPage]:
        """One page of the jobs that match every filter given, newest first
        (at most `limit`, 1-1000). `before`: the previous page's
        `next_before`, for the page after it (keyset pagination). Each job:
        id, tenant_id, kind, priority, status, attempts, max_attempts, actor,
        meta, created_at, error_line (the first line of its last error)."""
        filters = search.job_filter(tenant=tenant, kind=kind, status=status, actor=actor, meta=meta,
                                    since=since, priority=priority)
        size = search.parse_limit(limit)
        cursor = search.parse_cursor(before)
        params = {**filters.params(now), "limit": size + 1,
                  "before_id": None if cursor is None else cursor.id}
        if filters.tenant is not None:
            params["before_at"] = None if cursor is None else cursor.created_at
            rows: list[dict[str, Any]] = yield Query(search.statement("find_in_tenant"), params)
        else:
            rows = yield Query(search.statement("find_all"), params)
        page = rows[:size]
        more = len(rows) > size
        return JobPage(jobs=page, next_before=search.cursor_of(page[-1]) if more and page else None)

    @operation
    def actionable_counts(
        self,
        *,
        tenant: str | None = None,
        kind: str | None = None,
        status: str | None = None,
        actor: str | None = None,
        meta: MetaFilter = None,
        since: Since = None,
        priority: str | None = None,
        now: datetime | None = None,
    ) -> Steps[dict[str, int]]:
        """How many of the matching jobs `cancel_jobs` (pending) and
        `retry_dead_jobs` (dead) would act on now: {"pending": n, "dead": n}."""
        filters = search.job_filter(tenant=tenant, kind=kind, status=status, actor=actor, meta=meta,
                                    since=since, priority=priority)
        rows = yield Query(search.statement("actionable_counts"), filters.params(now))
        return {"pending": int(rows[0]["pending"]), "dead": int(rows[0]["dead"])}

    @operation
    def cancel_jobs(
        self,
        *,
        tenant: str | None = None,
        kind: str | None = None,
        actor: str | None = None,
        meta: MetaFilter = None,
        since: Since = None,
        priority: str | None = None,
        everything: bool = False,
        running: bool = False,
        by: str | None = None,
        now: datetime | None = None,
    ) -> Steps[int]:
        """Cancel every pending job that matches the filters; returns how
        many. Their `wait()`ers are woken. With `running=True`, also ask the
        matching running jobs to stop (as `cancel_running_jobs`; they are
        counted too). Without any filter it refuses unless `everything=True`
        (every pending job of every tenant). `by` (who cancelled) is recorded
        on the running jobs asked to stop."""
        filters = search.job_filter(tenant=tenant, kind=kind, actor=actor, meta=meta, since=since,
                                    priority=priority)
        _refuse_unfiltered(filters, everything, "cancel every pending job")
        who = validation.actor(by)
        changed = yield from _chunks("cancel_chunk", filters, now, {})
        if running:
            changed += yield from _chunks("cancel_running_chunk", filters, now,
                                          {"channel": self.db.notify_channel, "by": who})
        return changed

    @operation
    def cancel_running_jobs(
        self,
        *,
        tenant: str | None = None,
        kind: str | None = None,
        actor: str | None = None,
        meta: MetaFilter = None,
        since: Since = None,
        priority: str | None = None,
        everything: bool = False,
        by: str | None = None,
        now: datetime | None = None,
    ) -> Steps[int]:
        """Ask every running job that matches the filters to stop, as
        `cancel(id)` does for one: cancel_requested_at and cancelled_by
        (`by`) are set and its worker is notified ('cancel:<batch>:<job>'
        on the workers' channel); it stops the job, which ends `cancelled`
        (docs/controls.md). Returns how many were asked (a job already asked
        is not counted again). Without any filter it refuses unless
        `everything=True`."""
        filters = search.job_filter(tenant=tenant, kind=kind, actor=actor, meta=meta, since=since,
                                    priority=priority)
        _refuse_unfiltered(filters, everything, "stop every running job")
        return (yield from _chunks("cancel_running_chunk", filters, now,
                                   {"channel": self.db.notify_channel, "by": validation.actor(by)}))

    @operation
    def retry_dead_jobs(
        self,
        *,
        tenant: str | None = None,
        kind: str | None = None,
        actor: str | None = None,
        meta: MetaFilter = None,
        since: Since = None,
        priority: str | None = None,
        everything: bool = False,
        now: datetime | None = None,
    ) -> Steps[int]:
        """Replay every dead job that matches the filters (as `retry_dead`:
        fresh attempts, replays + 1, queues woken); returns how many.
        Without any filter it refuses unless `everything=True`."""
        filters = search.job_filter(tenant=tenant, kind=kind, actor=actor, meta=meta, since=since,
                                    priority=priority)
        _refuse_unfiltered(filters, everything, "replay every dead job")
        return (yield from _chunks("retry_dead_chunk", filters, now, {"channel": self.db.notify_channel}))


def _refuse_unfiltered(filters: JobFilter, everything: bool, what: str) -> None:
    if filters.empty and not everything:
        raise InvalidInput(f"no filter given: give at least one (tenant, kind, priority, actor, meta, "
                           f"since), or everything=True to {what} of every tenant")


def _chunks(block: str, filters: JobFilter, now: datetime | None, extra: dict[str, Any]) -> Steps[int]:
    """Run a bulk statement chunk after chunk (each its own transaction on
    tenantq's connection) until one comes back short; returns the jobs changed."""
    bounds = (yield Query(sql("search", "bounds"), {"now": now}))[0]
    params = {**filters.params(bounds["as_of"]), **extra, "max_id": bounds["max_id"],
              "chunk": search.CHUNK, "at": now}
    changed = 0
    while True:
        rows = yield Query(search.statement(block), params)
        chunk = int(rows[0]["changed"])
        changed += chunk
        if int(rows[0]["picked"]) < search.CHUNK or chunk == 0:
            return changed
