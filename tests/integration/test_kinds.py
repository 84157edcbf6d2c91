"""Workers take only what they can run: each worker claims only the kinds its
app registers, the pick never credits, charges or spins on a tenant whose
work is all of other kinds, a worker with app B serves what app A leaves,
and the registry of live workers says who serves what."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pytest

import tenantq
from tenantq import Queue
from tenantq.dispatch.executors.inline import InlineExecutor
from tenantq.dispatch.outcome import Backoff
from tenantq.dispatch.worker import Worker, WorkerConfig
from tenantq.fairness import ClaimRequest, claim_next
from tenantq.fairness.picker import PROBE_LIMIT
from tenantq.registry import Registry
from tenantq.store import workers
from tenantq.store.db import Database
from tenantq.store.workers import WorkerRecord
from tenantq.testing import wait_until
from tests.integration.helpers import db_now, fetch_all, fetch_one, running

NO_BACKOFF = Backoff(base_seconds=0.0, cap_seconds=0.0)
APP_A, APP_B = Registry(), Registry()


@tenantq.handler("a.job", isolation="inline", registry=APP_A)
def a_job(payload: Any, ctx: tenantq.JobContext) -> dict[str, str]:
    return {"ran": "a"}


@tenantq.handler("b.job", isolation="inline", registry=APP_B)
def b_job(payload: Any, ctx: tenantq.JobContext) -> dict[str, str]:
    return {"ran": "b"}


def _worker(db: Database, app: Registry, name: str, **config: Any) -> Worker:
    settings: dict[str, Any] = {"concurrency": 2, "batch_size": 5, "lease_seconds": 30, "poll_seconds": 0.1,
                                "backoff": NO_BACKOFF, "worker_id": name}
    settings.update(config)
    return Worker(db, InlineExecutor(app), WorkerConfig(**settings))


def _request(kinds: tuple[str, ...] | None) -> ClaimRequest:
    return ClaimRequest(worker_id="picker", driver="test", batch_size=10, lease_seconds=30, kinds=kinds)


def _queue_row(db: Database, tenant: str) -> dict[str, Any]:
    # psycopg reads no 'infinity' timestamp: kinds_due "never" comes back as None
    return fetch_one(db, "SELECT has_work, deficit, kinds, "
                         "CASE WHEN isfinite(kinds_due) THEN kinds_due END AS kinds_due FROM queues "
                         "WHERE tenant_id = %(t)s AND priority = 'default'", {"t": tenant})


def test_two_workers_with_different_apps_each_run_only_their_kinds(queue: Queue, db: Database) -> None:
    only_a = [queue.enqueue("only-a", "a.job") for _ in range(6)]
    only_b = [queue.enqueue("only-b", "b.job") for _ in range(6)]
    mixed_a = [queue.enqueue("mixed", "a.job") for _ in range(4)]
    mixed_b = [queue.enqueue("mixed", "b.job") for _ in range(4)]

    with running(_worker(db, APP_A, "worker-a")):
        wait_until(lambda: all(queue.job(j).status == "done" for j in only_a + mixed_a), timeout=15,
                   message="app A's jobs done by the A worker")
        # app B's work is left alone: not leased, no attempt used, no credit taken
        for job_id in only_b + mixed_b:
            info = queue.job(job_id)
            assert (info.status, info.attempts, info.attempts_history) == ("pending", 0, []), info
        assert _queue_row(db, "only-b")["deficit"] == 0
        assert _queue_row(db, "only-b")["kinds"] == ["b.job"]
        waiting = queue.job(only_b[0]).why_waiting
        assert waiting[0] == ("no running worker has a handler for kind b.job (1 running worker(s) serve: "
                              "a.job)"), waiting

    with running(_worker(db, APP_B, "worker-b")):
        wait_until(lambda: all(queue.job(j).status == "done" for j in only_b + mixed_b), timeout=15,
                   message="app B's jobs done by the B worker")

    attempts = fetch_all(db, "SELECT job_id, worker_id, outcome FROM attempts ORDER BY job_id")
    by_job = {r["job_id"]: r for r in attempts}
    assert len(attempts) == len(by_job) == 20, "one attempt each: nothing failed as an unknown kind"
    assert {by_job[j]["worker_id"] for j in only_a + mixed_a} == {"worker-a"}
    assert {by_job[j]["worker_id"] for j in only_b + mixed_b} == {"worker-b"}
    assert {r["outcome"] for r in attempts} == {"done"}


def test_both_apps_at_once_share_one_database(queue: Queue, db: Database) -> None:
    ids = queue.enqueue_many([{"tenant": f"t{i % 7}", "kind": "a.job" if i % 3 else "b.job"}
                              for i in range(120)])
    with running(_worker(db, APP_A, "worker-a"), _worker(db, APP_B, "worker-b")):
        wait_until(lambda: fetch_one(db, "SELECT count(*) AS n FROM jobs WHERE status = 'done'")["n"] == 120,
                   timeout=30, message="every job done by the worker of its app")
    ran = {r["job_id"]: r["worker_id"] for r in fetch_all(db, "SELECT job_id, worker_id FROM attempts")}
    kinds = {r["id"]: r["kind"] for r in fetch_all(db, "SELECT id, kind FROM jobs")}
    assert len(ran) == 120 and fetch_one(db, "SELECT count(*) AS n FROM attempts")["n"] == 120
    assert all(ran[j] == ("worker-a" if kinds[j] == "a.job" else "worker-b") for j in ids)


def test_many_tenants_of_another_app_never_block_the_pick(queue: Queue, db: Database) -> None:
    """More B-only tenants than a pick reads candidates, ahead of the one
    A tenant in rotation order: the A worker's first pick serves A at once,
    and credits or charges no B tenant."""
    queue.enqueue_many([{"tenant": f"b{i:03d}", "kind": "b.job"} for i in range(3 * PROBE_LIMIT)])
    a = queue.enqueue("zz-a", "a.job")
    with db.connect() as conn:
        # one B queue with an unknown hint (as before migration 0005): probed
        # once, then made exact
        conn.execute("UPDATE queues SET kinds = NULL WHERE tenant_id = 'b000'")
        batch = claim_next(conn, _request(("a.job",)), "default")
        assert batch is not None and [j.id for j in batch.jobs] == [a]
        assert claim_next(conn, _request(("a.job",)), "default") is None
    rows = fetch_all(db, "SELECT tenant_id, has_work, deficit, kinds FROM queues WHERE tenant_id LIKE 'b%%'")
    assert len(rows) == 3 * PROBE_LIMIT
    assert all(r["has_work"] and r["deficit"] == 0 and r["kinds"] == ["b.job"] for r in rows), rows
    with db.connect() as conn:
        batch = claim_next(conn, _request(("b.job",)), "default")
    assert batch is not None and batch.tenant_id == "b000", "B's round robin is where it was"


def test_a_kind_not_due_yet_is_offered_when_it_is_due(queue: Queue, db: Database) -> None:
    t0 = db_now(db)
    queue.enqueue("acme", "b.job", now=t0)
    later = queue.enqueue("acme", "a.job", delay=60, now=t0)
    row = _queue_row(db, "acme")
    assert row["kinds"] == ["b.job"] and row["kinds_due"] == t0 + timedelta(seconds=60), row
    with db.connect() as conn:
        assert claim_next(conn, _request(("a.job",)), "default", now=t0 + timedelta(seconds=1)) is None
        assert _queue_row(db, "acme")["deficit"] == 0
        batch = claim_next(conn, _request(("a.job",)), "default", now=t0 + timedelta(seconds=61))
    assert batch is not None and [j.id for j in batch.jobs] == [later]


def test_a_worker_whose_app_registers_nothing_it_can_run_refuses_to_start(db: Database) -> None:
    with pytest.raises(tenantq.InvalidInput, match=r"^the app registers no handler"):
        Worker(db, InlineExecutor(Registry()))
    sandbox_only = Registry()

    @tenantq.handler("box.only", sandbox_only=True, registry=sandbox_only)
    def boxed(payload: Any, ctx: tenantq.JobContext) -> None: ...

    with pytest.raises(tenantq.InvalidInput, match=r"^the app registers no handler this worker can run"):
        Worker(db, InlineExecutor(sandbox_only))
    # the built-in tenantq.python runs only in a sandbox: an inline worker leaves it out
    assert "tenantq.python" not in InlineExecutor(tenantq.REGISTRY).kinds()


class _Undeclared:
    """An executor from before kinds(): no kinds, no registry."""

    name = "legacy"

    def run(self, batch: Any, **kwargs: Any) -> None:
        raise AssertionError("not run in this test")


def test_an_executor_that_does_not_say_claims_every_kind(db: Database) -> None:
    worker = Worker(db, _Undeclared())  # type: ignore[arg-type]
    assert worker.kinds is None


def test_the_registry_lists_live_workers_and_what_they_serve(queue: Queue, db: Database) -> None:
    worker = _worker(db, APP_A, "worker-a", lease_seconds=0.6)
    with running(worker):
        wait_until(lambda: queue.workers(), timeout=10, message="the worker's row")
        (row,) = queue.workers()
        assert (row["worker_id"], row["kinds"], row["sandbox_driver"], row["pid"]) == (
            "worker-a", ["a.job"], "inline", os.getpid())
        assert row["host"] and row["executor_failures"] == 0 and row["last_executor_error"] is None
        first = row["heartbeat_at"]
        wait_until(lambda: queue.workers()[0]["heartbeat_at"] > first, timeout=10,
                   message="a heartbeat from the maintenance thread")
    assert queue.workers() == [], "a graceful stop leaves the registry"


def test_a_worker_without_a_heartbeat_for_three_lease_periods_is_dead(queue: Queue, db: Database) -> None:
    now = db_now(db)
    with db.connect() as conn:
        for name, ago in (("fresh", 2.5), ("gone", 3.5)):
            record = WorkerRecord.of(name, "inline", 1.0, ["a.job"])
            workers.beat(conn, record, now=now - timedelta(seconds=ago))
    assert [w["worker_id"] for w in queue.workers()] == ["fresh"]
    with db.connect() as conn:
        workers.prune(conn, now=now + timedelta(days=2))
    assert fetch_all(db, "SELECT worker_id FROM workers") == []



def test_an_upgraded_schema_serves_the_queues_it_had(fresh_schema: Database) -> None:
    """Queues from before migration 0005 have no kinds hint (NULL: any kind):
    a worker with kinds still finds their jobs, and its first probe that
    finds nothing makes the hint exact."""
    from psycopg import sql as pgsql

    from tenantq.store.migrate import migrate
    from tenantq.store.queries import migration_files, sql

    old = [f for f in migration_files() if f[0] <= 4]
    with fresh_schema.connect(autocommit=False) as conn, conn.transaction():
        conn.execute(pgsql.SQL("CREATE SCHEMA {}").format(pgsql.Identifier(fresh_schema.schema)))
        conn.execute(pgsql.SQL("SET LOCAL search_path = {}").format(pgsql.Identifier(fresh_schema.schema)))
        conn.execute(sql("migrate", "create_migrations_table"))
        for version, name, text in old:
            conn.execute(text)
            conn.execute(sql("migrate", "record"), {"version": version, "name": name})
        conn.execute("INSERT INTO tenants (tenant_id) VALUES ('acme'), ('other')")
        conn.execute("INSERT INTO queues (tenant_id, priority) "
                     "VALUES ('acme', 'default'), ('other', 'default')")
        conn.execute("INSERT INTO jobs (tenant_id, kind, payload, run_after, created_at) VALUES "
                     "('acme', 'a.job', '{}', now(), now()), ('other', 'b.job', '{}', now(), now())")
    assert migrate(fresh_schema).applied[:1] == ["0005_workers_and_attempts"]
    assert _queue_row(fresh_schema, "acme")["kinds"] is None
    with fresh_schema.connect() as conn:
        batch = claim_next(conn, _request(("a.job",)), "default")
        assert batch is not None and batch.tenant_id == "acme"
        assert claim_next(conn, _request(("a.job",)), "default") is None
    assert _queue_row(fresh_schema, "other")["kinds"] == ["b.job"], "probed once, then exact"
