"""`tenantq.Queue`: the producer's and operator's handle on the store."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from tenantq.egress.policy import parse_rules
from tenantq.errors import InvalidInput, TenantqError
from tenantq.store import jobs, validation
from tenantq.store.db import Conn, Database, Pool
from tenantq.store.migrate import MigrateReport, migrate
from tenantq.store.model import JobInfo, NewJob
from tenantq.store.queries import sql


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


class Queue:
    """Enqueue and inspect jobs. Thread-safe; holds a small connection pool.

    `Queue()` uses TENANTQ_DATABASE_URL, or the embedded Postgres when unset.
    """

    def __init__(self, dsn: str | None = None, *, schema: str | None = None) -> None:
        self.db = Database.resolve(dsn, schema)
        self._pool: Pool | None = None

    # -- plumbing --------------------------------------------------------
    @contextmanager
    def _conn(self) -> Iterator[Conn]:
        if self._pool is None:
            self._pool = self.db.pool(min_size=1, max_size=4, name="tenantq-queue")
        try:
            with self._pool.connection() as conn:
                yield conn
        except psycopg.errors.UndefinedTable:
            raise TenantqError(
                f"tenantq tables not found in schema {self.db.schema!r}: run `tenantq migrate` first"
            ) from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> Queue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def migrate(self) -> MigrateReport:
        return migrate(self.db)

    # -- producing -------------------------------------------------------
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
        now: datetime | None = None,
    ) -> int:
        """Add one job; returns its id (the existing id if `key` was used before)."""
        job = validation.new_job(tenant, kind, payload, priority_=priority,
                                 max_attempts_=max_attempts, delay_=delay, key=key)
        with self._conn() as conn:
            return jobs.insert_jobs(conn, [job], channel=self.db.notify_channel, now=now)[0]

    def enqueue_many(
        self, specs: Iterable[JobSpec | Mapping[str, Any]], *, now: datetime | None = None
    ) -> list[int]:
        """Add many jobs in one statement; ids come back in input order.

        Every job is validated first; one bad job rejects the whole call and
        nothing is written.
        """
        validated: list[tuple[NewJob, str]] = []
        for index, spec in enumerate(specs):
            fields = spec if isinstance(spec, Mapping) else spec.__dict__
            unknown = set(fields) - set(JobSpec.__dataclass_fields__)
            if unknown:
                raise InvalidInput(f"job {index}: unknown field(s) {', '.join(sorted(unknown))}")
            try:
                validated.append(validation.new_job(
                    fields.get("tenant"), fields.get("kind"), fields.get("payload"),
                    priority_=fields.get("priority", "default"),
                    max_attempts_=fields.get("max_attempts", 5),
                    delay_=fields.get("delay", 0.0), key=fields.get("key"),
                ))
            except InvalidInput as exc:
                raise InvalidInput(f"job {index}: {exc}") from None
        with self._conn() as conn:
            return jobs.insert_jobs(conn, validated, channel=self.db.notify_channel, now=now)

    def cancel(self, job_id: int) -> bool:
        """Cancel a pending job. False if the job is no longer pending."""
        with self._conn() as conn:
            return jobs.cancel(conn, job_id)

    # -- inspecting ------------------------------------------------------
    def job(self, job_id: int) -> JobInfo:
        """Status, attempts, last error, result, the attempt history (and
        more) of one job; for a pending one, why it waits."""
        from tenantq.fairness.explain import why_waiting

        with self._conn() as conn:
            info = jobs.get_job(conn, job_id)
            if info.status == "pending":
                info.why_waiting.extend(why_waiting(conn, info))
            return info

    def status(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """Per tenant and class: pending, runnable, running, done, dead, cancelled, oldest age."""
        if tenant is not None:
            validation.tenant_id(tenant)
        with self._conn() as conn:
            return conn.execute(sql("jobs", "status_counts"), {"tenant_id": tenant}).fetchall()

    def tenants(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """Weight, cap, live batches and DRR deficit per tenant."""
        with self._conn() as conn:
            return conn.execute(sql("tenants", "list"), {"tenant_id": tenant}).fetchall()

    def running_batches(self) -> list[dict[str, Any]]:
        with self._conn() as conn:
            return conn.execute(sql("batches", "live")).fetchall()

    def workers(self) -> list[dict[str, Any]]:
        """The live workers: id, host, pid, the kinds each claims (None: every
        kind), sandbox driver, started and heartbeat times, and its executor's
        failures in a row with the last error."""
        from tenantq.store import workers

        with self._conn() as conn:
            return workers.live(conn)

    def prune(self, *, older_than_seconds: float, limit: int = 1000) -> int:
        """Delete finished jobs (done, dead, cancelled) older than this, with
        their attempt history; at most `limit` per call. Returns how many."""
        if not (math.isfinite(older_than_seconds) and older_than_seconds >= 0):
            raise InvalidInput(f"older-than must be 0 seconds or more, got {older_than_seconds}")
        with self._conn() as conn:
            return jobs.prune_jobs(conn, keep_seconds=older_than_seconds, limit=max(1, limit))

    def dead_jobs(self, tenant: str | None = None, *, limit: int = 100) -> list[dict[str, Any]]:
        if tenant is not None:
            validation.tenant_id(tenant)
        with self._conn() as conn:
            return jobs.dead_jobs(conn, tenant_id=tenant, limit=limit)

    def retry_dead(
        self, ids: Sequence[int] | None = None, *, tenant: str | None = None
    ) -> list[int]:
        """Replay dead jobs: the given ids, or all (of one tenant) when ids is None."""
        if tenant is not None:
            validation.tenant_id(tenant)
        with self._conn() as conn:
            return jobs.retry_dead(conn, ids=ids, tenant_id=tenant, channel=self.db.notify_channel)

    # -- tenants -----------------------------------------------------------
    def set_tenant(
        self, tenant: str, *, weight: int | None = None, max_sandboxes: int | None = None,
        egress: str | list[str] | None = None,
    ) -> dict[str, Any]:
        """Set a tenant's weight, cap (max_sandboxes=0 removes the cap) and/or
        egress rules ("api.stripe.com,*.salesforce.com:443"; "" = none)."""
        validation.tenant_id(tenant)
        rules = None if egress is None else [str(r) for r in parse_rules(egress)]
        if weight is not None and not 1 <= weight <= 10000:
            raise InvalidInput(f"weight must be between 1 and 10000, got {weight}")
        if max_sandboxes is not None and max_sandboxes < 0:
            raise InvalidInput(f"max-sandboxes must be 0 (no cap) or more, got {max_sandboxes}")
        with self._conn() as conn:
            row = conn.execute(sql("tenants", "upsert"), {
                "tenant_id": tenant, "weight": weight,
                "max_sandboxes": max_sandboxes or None, "clear_cap": max_sandboxes == 0,
                "egress": rules,
            }).fetchone()
        assert row is not None
        return row

    def reap(self) -> int:
        """Reap expired leases now; returns how many jobs went back (or died)."""
        with self._conn() as conn:
            return len(jobs.expire_leases(conn))
