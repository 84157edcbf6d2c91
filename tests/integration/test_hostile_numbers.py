"""Hostile numbers: a job that reports a run time of NaN, Infinity or -5 s,
and rows that hold such numbers, can neither poison fairness nor wedge the
store. The CHECKs reject NaN and ±Infinity in every float column, migration
0004 repairs rows written before them, and the worker settles such jobs
normally, leaving finite numbers in queues and batches under both
`fair_by` modes."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import LiteralString

import psycopg
import pytest
from psycopg import sql as pgsql

from tenantq import Queue
from tenantq.dispatch.executors.contract import JobEnded, JobStarted, Report
from tenantq.dispatch.outcome import Backoff
from tenantq.dispatch.worker import Worker, WorkerConfig, WorkerStats
from tenantq.domain.records import Batch, Settlement
from tenantq.fairness import ClaimRequest, claim_next
from tenantq.fairness.drr import MAX_CREDIT, MAX_JOB_SECONDS, Mode
from tenantq.store import jobs, wakes
from tenantq.store.db import Database
from tenantq.store.migrate import migrate
from tenantq.store.queries import migration_files
from tests.integration.helpers import WorkerThread, fetch_all, fetch_one, status_counts

# JSON cannot carry NaN or Infinity, so a job's payload names the run time
# its (fake) executor reports for it
HOSTILE_SECONDS: dict[str, str | None] = {
    "t-nan": "nan", "t-inf": "inf", "t-neg-inf": "-inf", "t-neg": "-5.0", "t-huge": "1e308", "t-none": None,
}


class ReportedSecondsExecutor:
    """Implements BatchExecutor: every job succeeds at once and reports the
    run time its payload names, as a hostile guest would."""

    name = "fake"

    def __init__(self) -> None:
        self.reported: list[float | None] = []

    def run(self, batch: Batch, *, env: Mapping[str, str], report: Report,
            should_stop: Callable[[], bool]) -> None:
        for job in batch.jobs:
            if should_stop():
                return
            report(JobStarted(job.id))
            named = job.payload.get("seconds") if isinstance(job.payload, dict) else None
            seconds = None if named is None else float(named)
            self.reported.append(seconds)
            report(JobEnded(job.id, ok=True, result={"job": job.id}, seconds=seconds))


def _drain(db: Database, executor: ReportedSecondsExecutor, fair_by: Mode,
           timeout: float = 30) -> WorkerStats:
    config = WorkerConfig(concurrency=2, batch_size=2, lease_seconds=30, poll_seconds=0.1, once=True,
                          fair_by=fair_by, backoff=Backoff(base_seconds=0, cap_seconds=0))
    thread = WorkerThread(Worker(db, executor, config)).start()  # type: ignore[arg-type]
    thread.thread.join(timeout)
    if thread.thread.is_alive():
        thread.stop_and_join()
        raise AssertionError("a once=True worker did not return on its own")
    return thread.stop_and_join()


def _assert_finite_numbers(db: Database, *, wall: float) -> None:
    for q in fetch_all(db, "SELECT tenant_id, priority, deficit, avg_job_seconds FROM queues"):
        assert math.isfinite(q["deficit"]) and abs(q["deficit"]) <= MAX_CREDIT, q
        avg = q["avg_job_seconds"]
        assert avg is None or (math.isfinite(avg) and 0 <= avg <= wall), q
    for b in fetch_all(db, "SELECT batch_id, outcome, run_seconds, charged_seconds FROM batches"):
        assert b["outcome"] == "ok", b
        # clamped to the host's wall time: the whole drain took `wall` seconds
        assert b["run_seconds"] is not None and 0 <= b["run_seconds"] <= wall, b
        charged = b["charged_seconds"]
        assert charged is None or (math.isfinite(charged) and charged >= 0), b


@pytest.mark.parametrize("fair_by", [Mode.JOBS, Mode.RUNTIME])
def test_hostile_run_times_settle_normally_and_leave_finite_numbers(
    queue: Queue, db: Database, fair_by: Mode
) -> None:
    specs = [{"tenant": tenant, "kind": "fake.job", "payload": {"seconds": seconds}}
             for tenant, seconds in HOSTILE_SECONDS.items() for _ in range(3)]
    ids = queue.enqueue_many(specs)
    executor = ReportedSecondsExecutor()
    began = time.monotonic()
    stats = _drain(db, executor, fair_by)
    wall = time.monotonic() - began

    assert any(s is not None and math.isnan(s) for s in executor.reported), "NaN was reported"
    assert (stats.done, stats.retried, stats.dead, stats.refused) == (len(ids), 0, 0, 0)
    rows = fetch_all(db, "SELECT id, status, attempts, result FROM jobs ORDER BY id")
    assert [(r["status"], r["attempts"], r["result"]) for r in rows] == [("done", 1, {"job": r["id"]})
                                                                         for r in rows]
    _assert_finite_numbers(db, wall=wall)
    if fair_by is Mode.RUNTIME:
        averages = fetch_all(db, "SELECT avg_job_seconds FROM queues")
        assert all(a["avg_job_seconds"] is not None for a in averages), "runtime mode keeps an average"

    # the schedule is not poisoned: the same queues are picked and charged again
    more = queue.enqueue_many(specs)
    began = time.monotonic()
    assert _drain(db, executor, fair_by).done == len(more)
    _assert_finite_numbers(db, wall=time.monotonic() - began + wall)
    assert status_counts(db) == {"done": 2 * len(ids)}


def test_extreme_finite_numbers_in_the_store_do_not_break_picks_or_charges(
    queue: Queue, db: Database
) -> None:
    """Finite, so the CHECKs let them through, but big enough to overflow
    arithmetic: the picker and the runtime charge bound them."""
    queue.enqueue_many([{"tenant": t, "kind": "fake.job", "payload": {"seconds": "0.001"}}
                        for t in ("debtor", "rich", "slow") for _ in range(4)])
    with db.connect() as conn:
        conn.execute("UPDATE queues SET deficit = -1e308 WHERE tenant_id = 'debtor'")
        conn.execute("UPDATE queues SET deficit = 1e308 WHERE tenant_id = 'rich'")
        conn.execute("UPDATE queues SET avg_job_seconds = 1e308, deficit = 1e-300 WHERE tenant_id = 'slow'")
    began = time.monotonic()
    stats = _drain(db, ReportedSecondsExecutor(), Mode.RUNTIME)
    assert stats.done == 12, "a queue 1e308 in debt still gets served (DRR fast-forwards its rounds)"
    for q in fetch_all(db, "SELECT tenant_id, deficit, avg_job_seconds FROM queues"):
        assert math.isfinite(q["deficit"]) and abs(q["deficit"]) <= MAX_CREDIT + MAX_JOB_SECONDS * 2, q
        assert q["avg_job_seconds"] is None or 0 <= q["avg_job_seconds"] <= MAX_JOB_SECONDS, q
    for b in fetch_all(db, "SELECT run_seconds, charged_seconds FROM batches"):
        assert 0 <= b["run_seconds"] <= time.monotonic() - began, b
        assert 0 <= b["charged_seconds"] <= 2 * MAX_JOB_SECONDS, b


# -- the CHECKs --------------------------------------------------------------

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("statement", "value", "constraints"),
    [
        ("UPDATE queues SET deficit = %(v)s", NAN, {"deficit_finite"}),
        ("UPDATE queues SET deficit = %(v)s", INF, {"deficit_finite"}),
        ("UPDATE queues SET deficit = %(v)s", -INF, {"deficit_finite"}),
        ("UPDATE queues SET avg_job_seconds = %(v)s", NAN, {"avg_job_seconds_finite"}),
        ("UPDATE queues SET avg_job_seconds = %(v)s", INF, {"avg_job_seconds_finite"}),
        ("UPDATE queues SET avg_job_seconds = %(v)s", -1.0, {"avg_job_seconds_nonnegative"}),
        ("UPDATE queues SET avg_job_seconds = %(v)s", -INF,
         {"avg_job_seconds_nonnegative", "avg_job_seconds_finite"}),
        ("UPDATE batches SET run_seconds = %(v)s", NAN, {"run_seconds_finite"}),
        ("UPDATE batches SET run_seconds = %(v)s", INF, {"run_seconds_finite"}),
        ("UPDATE batches SET run_seconds = %(v)s", -1.0, {"run_seconds_nonnegative"}),
        ("UPDATE batches SET charged_seconds = %(v)s", NAN, {"charged_seconds_finite"}),
        ("UPDATE batches SET charged_seconds = %(v)s", INF, {"charged_seconds_finite"}),
        ("UPDATE batches SET charged_seconds = %(v)s", -1.0, {"charged_seconds_nonnegative"}),
    ],
)
def test_checks_reject_nan_infinity_and_negative_numbers(
    queue: Queue, db: Database, statement: LiteralString, value: float, constraints: set[str]
) -> None:
    _one_queue_and_batch(queue, db)
    with db.connect() as conn:
        with pytest.raises(psycopg.errors.CheckViolation) as info:
            conn.execute(statement, {"v": value})
        assert info.value.diag.constraint_name in constraints


def test_checks_accept_finite_numbers(queue: Queue, db: Database) -> None:
    _one_queue_and_batch(queue, db)
    with db.connect() as conn:
        conn.execute("UPDATE queues SET deficit = -1e308, avg_job_seconds = 1e308")
        conn.execute("UPDATE queues SET deficit = 1e308, avg_job_seconds = 0")
        conn.execute("UPDATE batches SET run_seconds = 0, charged_seconds = 1e308")


def test_every_float_column_has_a_finite_check(db: Database) -> None:
    floats = fetch_all(db, "SELECT table_name, column_name FROM information_schema.columns "
                           "WHERE table_schema = %(s)s AND data_type IN ('double precision', 'real')",
                       {"s": db.schema})
    checks = {r["conname"] for r in fetch_all(db, "SELECT conname FROM pg_constraint co "
                                                  "JOIN pg_namespace n ON n.oid = co.connamespace "
                                                  "WHERE n.nspname = %(s)s AND co.contype = 'c'",
                                              {"s": db.schema})}
    assert {f"{r['column_name']}_finite" for r in floats} <= checks
    # deficit, avg_job_seconds, run_seconds, charged_seconds, workers.lease_seconds,
    # tenants.retain_{done,cancelled,dead}_seconds, rate_limits.{per_second,burst,tokens}
    assert len(floats) == 11, floats


def _one_queue_and_batch(queue: Queue, db: Database) -> None:
    queue.enqueue("acme", "fake.job")
    with db.connect() as conn:
        wakes.fold(conn)  # the queue row, as a worker looking for work makes it
        conn.execute("INSERT INTO batches (tenant_id, priority, worker_id, sandbox_driver, job_count, "
                     "lease_expires_at, created_at, heartbeat_at) "
                     "VALUES ('acme', 'default', 'w', 'inline', 1, now(), now(), now())")


# -- migration 0004 repairs what it finds ----------------------------------

def test_migration_0004_repairs_poisoned_rows_before_adding_the_checks(fresh_schema: Database) -> None:
    with fresh_schema.connect(autocommit=False) as conn, conn.transaction():
        conn.execute(pgsql.SQL("CREATE SCHEMA {}").format(pgsql.Identifier(fresh_schema.schema)))
        conn.execute(pgsql.SQL("SET LOCAL search_path = {}").format(pgsql.Identifier(fresh_schema.schema)))
        conn.execute("CREATE TABLE migrations (version integer PRIMARY KEY, name text NOT NULL, "
                     "applied_at timestamptz NOT NULL DEFAULT now())")
        for version, name, text in migration_files():
            if version >= 4:
                break
            conn.execute(text)
            conn.execute("INSERT INTO migrations (version, name) VALUES (%s, %s)", (version, name))
        conn.execute("INSERT INTO tenants (tenant_id) VALUES ('nan'), ('inf'), ('fine')")
        conn.execute("INSERT INTO queues (tenant_id, priority, deficit, avg_job_seconds) VALUES "
                     "('nan', 'default', 'NaN', 'NaN'), ('inf', 'default', '-Infinity', 'Infinity'), "
                     "('fine', 'default', -2.5, 0.5)")
        for tenant, run, charged in (("nan", "NaN", "Infinity"), ("inf", "Infinity", "NaN"),
                                     ("fine", "1.5", "0.25")):
            conn.execute("INSERT INTO batches (tenant_id, priority, worker_id, sandbox_driver, job_count, "
                         "lease_expires_at, created_at, heartbeat_at, ended_at, outcome, run_seconds, "
                         "charged_seconds) VALUES (%s, 'default', 'w', 'inline', 1, now(), now(), now(), "
                         "now(), 'ok', %s::float8, %s::float8)", (tenant, run, charged))

    report = migrate(fresh_schema)
    assert "0004_finite_numbers" in report.applied
    queues = {r["tenant_id"]: (r["deficit"], r["avg_job_seconds"])
              for r in fetch_all(fresh_schema, "SELECT tenant_id, deficit, avg_job_seconds FROM queues")}
    assert queues == {"nan": (0.0, None), "inf": (0.0, None), "fine": (-2.5, 0.5)}
    stored = fetch_all(fresh_schema, "SELECT tenant_id, run_seconds, charged_seconds FROM batches")
    batches = {r["tenant_id"]: (r["run_seconds"], r["charged_seconds"]) for r in stored}
    assert batches == {"nan": (0.0, 0.0), "inf": (0.0, 0.0), "fine": (1.5, 0.25)}
    row = fetch_one(fresh_schema, "SELECT count(*) AS n FROM pg_constraint co "
                                  "JOIN pg_namespace n ON n.oid = co.connamespace "
                                  "WHERE n.nspname = %(s)s AND co.conname LIKE '%%\\_finite'",
                    {"s": fresh_schema.schema})
    # 0004's four, workers.lease_seconds (0005), and 0007's six (retention
    # windows, rate limits)
    assert row["n"] == 11
    with fresh_schema.connect() as conn, pytest.raises(psycopg.errors.CheckViolation):
        conn.execute("UPDATE queues SET deficit = 'NaN'")


def test_egress_blocks_with_unusable_times_get_the_batch_clock(queue: Queue, db: Database) -> None:
    job_id = queue.enqueue("acme", "fake.job")
    request = ClaimRequest(worker_id="w", driver="test", batch_size=1, lease_seconds=30)
    with db.connect() as conn:
        batch = claim_next(conn, request, "default")
        assert batch is not None
        blocks = [{"job_id": job_id, "host": f"h{i}.example", "reason": "not allowed", "at": at}
                  for i, at in enumerate([NAN, INF, -INF, 1e300, -1.0, "junk", None, 1.7e9])]
        jobs.settle(conn, batch.batch_id, [Settlement(job_id, "done", result=None)], end_outcome="ok",
                    run_seconds=NAN, egress=({"allowed": 0, "blocked": len(blocks)}, blocks))
    stored = fetch_all(db, "SELECT host, blocked_at FROM egress_blocks ORDER BY id")
    assert len(stored) == len(blocks)
    assert stored[-1]["blocked_at"].timestamp() == 1.7e9
    now = time.time()
    assert all(abs(r["blocked_at"].timestamp() - now) < 300 for r in stored[:-1]), stored
    assert fetch_one(db, "SELECT run_seconds FROM batches")["run_seconds"] == 0.0
    assert len(queue.job(job_id).egress_blocked) == len(blocks)
