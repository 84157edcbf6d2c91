"""The attempt history: every attempt's start, end, worker, sandbox driver,
outcome and error is kept, written by the statements that settle, release
and reap; a done job has no stale last_error; a dead retry keeps it all."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest

import tests.apps.basic  # noqa: F401  (registers the demo.* handlers)
from tenantq import Queue
from tenantq.dispatch.outcome import Backoff, failed, succeeded
from tenantq.fairness import ClaimRequest, claim_next
from tenantq.store import jobs
from tenantq.store.db import Conn, Database
from tenantq.testing import drain
from tests.integration.helpers import db_now, fetch_all, scalar

NO_BACKOFF = Backoff(base_seconds=0.0, cap_seconds=0.0)


@pytest.fixture
def conn(db: Database) -> Iterator[Conn]:
    with db.connect() as c:
        yield c


def _request(worker: str = "w1", lease: float = 30.0, batch_size: int = 10) -> ClaimRequest:
    return ClaimRequest(worker_id=worker, driver="gvisor", batch_size=batch_size, lease_seconds=lease)


def _history(queue: Queue, job_id: int) -> list[tuple[int, int, str]]:
    return [(a["attempt"], a["replay"], a["outcome"]) for a in queue.job(job_id).attempts_history]


def test_a_job_that_succeeds_after_failures_has_its_history_and_no_stale_error(queue: Queue,
                                                                               db: Database) -> None:
    job_id = queue.enqueue("acme", "demo.flaky", {"succeed_on": 3}, max_attempts=5)
    drain(db)
    info = queue.job(job_id)
    assert (info.status, info.attempts, info.last_error) == ("done", 3, None)
    assert [(a["attempt"], a["outcome"]) for a in info.attempts_history] == [
        (1, "failed"), (2, "failed"), (3, "done")]
    first, second, done = info.attempts_history
    assert first["error"].startswith("RuntimeError: flaky failure on attempt 1\n")
    assert second["error"].startswith("RuntimeError: flaky failure on attempt 2\n")
    assert done["error"] is None
    for a in info.attempts_history:
        assert a["driver"] == "inline" and a["worker_id"]
        assert a["started_at"] <= a["finished_at"] and a["seconds"] >= 0
    assert info.outcome_note == "succeeded on attempt 3 after: RuntimeError: flaky failure on attempt 2"
    as_json = info.as_json()
    assert isinstance(as_json["attempts_history"][0]["started_at"], str)
    assert as_json["outcome_note"] == info.outcome_note


def test_a_job_done_at_once_says_so(queue: Queue, db: Database) -> None:
    job_id = queue.enqueue("acme", "demo.hello")
    drain(db)
    assert queue.job(job_id).outcome_note == "succeeded on attempt 1"
    assert queue.job(queue.enqueue("acme", "demo.noop", delay=60)).outcome_note is None


def test_dead_retry_keeps_the_history_and_counts_the_replay(queue: Queue, db: Database) -> None:
    job_id = queue.enqueue("acme", "demo.flaky", {"succeed_on": 3}, max_attempts=2)
    drain(db)
    dead = queue.job(job_id)
    assert (dead.status, dead.attempts, dead.replays) == ("dead", 2, 0)
    assert dead.outcome_note == "dead after 2 attempt(s): RuntimeError: flaky failure on attempt 2"
    assert queue.retry_dead([job_id]) == [job_id]
    replayed = queue.job(job_id)
    assert (replayed.status, replayed.attempts, replayed.replays) == ("pending", 0, 1)
    assert _history(queue, job_id) == [(1, 0, "failed"), (2, 0, "failed")], "nothing is lost"
    drain(db)  # attempts count from 1 again: 1 fails, 2 fails -> dead; replay again
    assert queue.retry_dead([job_id]) == [job_id]
    drain(db)
    info = queue.job(job_id)
    # ctx.attempt restarted at 1 on every replay, so demo.flaky never reached 3
    assert (info.status, info.replays) == ("dead", 2)
    assert _history(queue, job_id) == [(1, 0, "failed"), (2, 0, "failed"), (1, 1, "failed"),
                                       (2, 1, "failed"), (1, 2, "failed"), (2, 2, "failed")]
    assert (info.outcome_note or "").startswith("dead after 2 attempt(s) (replay 2): "), info.outcome_note


def test_released_and_lost_attempts_are_recorded(queue: Queue, db: Database, conn: Conn) -> None:
    t0 = db_now(db)
    ran, unstarted = queue.enqueue("acme", "demo.noop", now=t0), queue.enqueue("acme", "demo.noop", now=t0)
    batch = claim_next(conn, _request(), "default", now=t0 + timedelta(seconds=1))
    assert batch is not None and len(batch.jobs) == 2
    first = batch.jobs[0]
    jobs.settle(conn, batch.batch_id, [succeeded(first, {"ok": 1}, backoff=NO_BACKOFF)], release=[unstarted],
                end_outcome="released", now=t0 + timedelta(seconds=2))
    assert _history(queue, ran) == [(1, 0, "done")]
    released = queue.job(unstarted)
    assert (released.status, released.attempts) == ("pending", 0)
    (row,) = released.attempts_history
    assert (row["attempt"], row["outcome"], row["worker_id"], row["driver"], row["error"]) == (
        1, "released", "w1", "gvisor", None)
    assert row["started_at"] == t0 + timedelta(seconds=1) and row["finished_at"] == t0 + timedelta(seconds=2)

    # leased again by a worker that dies: the reaper records the attempt as lost
    batch = claim_next(conn, _request("doomed", lease=5), "default", now=t0 + timedelta(seconds=3))
    assert batch is not None and [j.id for j in batch.jobs] == [unstarted]
    jobs.expire_leases(conn, now=t0 + timedelta(seconds=10))
    lost = queue.job(unstarted).attempts_history[-1]
    assert (lost["attempt"], lost["outcome"], lost["worker_id"]) == (1, "lost", "doomed")
    assert lost["error"] == "lease expired: worker doomed stopped heartbeating mid-batch"
    assert lost["finished_at"] == t0 + timedelta(seconds=10)


def test_a_zombie_settle_records_nothing(queue: Queue, db: Database, conn: Conn) -> None:
    t0 = db_now(db)
    job_id = queue.enqueue("acme", "demo.noop", now=t0)
    zombie = claim_next(conn, _request("zombie", lease=5), "default", now=t0)
    assert zombie is not None
    jobs.expire_leases(conn, now=t0 + timedelta(seconds=6))
    fresh = claim_next(conn, _request("fresh"), "default", now=t0 + timedelta(seconds=7))
    assert fresh is not None
    with pytest.raises(Exception, match="no longer live"):
        jobs.settle(conn, zombie.batch_id, [failed(zombie.jobs[0], "late", backoff=NO_BACKOFF)],
                    end_outcome="failed", now=t0 + timedelta(seconds=8))
    jobs.settle(conn, fresh.batch_id, [succeeded(fresh.jobs[0], None, backoff=NO_BACKOFF)],
                end_outcome="ok", now=t0 + timedelta(seconds=9))
    assert [(a["attempt"], a["outcome"], a["worker_id"]) for a in queue.job(job_id).attempts_history] == [
        (1, "lost", "zombie"), (2, "done", "fresh")]


def _finish_old_jobs(db: Database, when: datetime) -> None:
    with db.connect() as conn:
        conn.execute("UPDATE jobs SET finished_at = %(when)s WHERE status IN ('done', 'dead')",
                     {"when": when})


def test_prune_takes_a_jobs_history_with_it(queue: Queue, db: Database,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # the workers of this test must not prune on their own (retention)
    monkeypatch.setenv("TENANTQ_RETAIN_DONE", "365d")
    old = queue.enqueue("acme", "demo.flaky", {"succeed_on": 2})
    drain(db)
    _finish_old_jobs(db, db_now(db) - timedelta(days=30))
    young = queue.enqueue("acme", "demo.flaky", {"succeed_on": 2})
    waiting = queue.enqueue("acme", "demo.noop", delay=3600)
    drain(db)
    assert scalar(db, "SELECT count(*) FROM attempts WHERE job_id = %(id)s", {"id": old}) == 2
    assert queue.prune(older_than_seconds=7 * 86400, dry_run=True) == {"done": 1}
    assert scalar(db, "SELECT count(*) FROM jobs WHERE id = %(id)s", {"id": old}) == 1, \
        "a dry run deletes nothing"
    assert queue.prune(older_than_seconds=7 * 86400) == {"done": 1}
    assert {r["id"] for r in fetch_all(db, "SELECT id FROM jobs")} == {young, waiting}
    assert {r["job_id"] for r in fetch_all(db, "SELECT job_id FROM attempts")} == {young}
    assert queue.prune(older_than_seconds=7 * 86400) == {}


@pytest.mark.parametrize(("statement", "constraint"), [
    ("INSERT INTO attempts (tenant_id, job_id, attempt, started_at, finished_at, worker_id, driver, outcome) "
     "VALUES ('acme', 1, 1, now(), now(), 'w', 'inline', 'failed')", "attempt_failure_has_error"),
    ("INSERT INTO attempts (tenant_id, job_id, attempt, started_at, finished_at, worker_id, driver, outcome) "
     "VALUES ('acme', 1, 0, now(), now(), 'w', 'inline', 'done')", "attempt_positive"),
    ("INSERT INTO attempts (tenant_id, job_id, attempt, started_at, finished_at, worker_id, driver, outcome) "
     "VALUES ('acme', 1, 1, now(), now(), 'w', 'inline', 'vanished')", "attempt_outcome_known"),
    ("INSERT INTO workers (worker_id, host, pid, sandbox_driver, lease_seconds, started_at, heartbeat_at) "
     "VALUES ('w', 'h', 1, 'inline', 'NaN', now(), now())", "lease_seconds_finite"),
    ("INSERT INTO workers (worker_id, host, pid, sandbox_driver, lease_seconds, started_at, heartbeat_at, "
     "last_executor_error) VALUES ('w', 'h', 1, 'inline', 30, now(), now(), 'boom')",
     "executor_error_has_time"),
    ("INSERT INTO tenants (tenant_id) VALUES ('acme'); INSERT INTO queues (tenant_id, priority, kinds) "
     "SELECT 'acme', 'default', array_agg('k' || g) FROM generate_series(1, 65) g", "kinds_bounded"),
    ("UPDATE jobs SET replays = -1", "replays_nonnegative"),
])
def test_check_constraints_hold_the_new_invariants(queue: Queue, db: Database, statement: str,
                                                   constraint: str) -> None:
    import psycopg

    queue.enqueue("globex", "demo.noop")
    with db.connect() as conn, pytest.raises(psycopg.errors.CheckViolation) as raised:
        conn.execute(statement)  # type: ignore[arg-type]
    assert raised.value.diag.constraint_name == constraint


def test_the_kinds_hint_holds_at_most_64_kinds_then_means_any(queue: Queue, db: Database) -> None:
    queue.enqueue_many([{"tenant": "acme", "kind": f"k.{n:02d}"} for n in range(64)])
    assert len(scalar(db, "SELECT kinds FROM queues WHERE tenant_id = 'acme'")) == 64
    queue.enqueue("acme", "k.64")
    assert scalar(db, "SELECT kinds FROM queues WHERE tenant_id = 'acme'") is None
