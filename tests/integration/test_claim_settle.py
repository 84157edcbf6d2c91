"""Leases and settlement on the store, with time moved explicitly: claim,
fencing tokens, expiry and re-lease, release, cancel, dead-letter replay,
heartbeats and backoff."""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest

import tenantq
from tenantq import Queue
from tenantq.dispatch.outcome import Backoff, failed
from tenantq.domain.records import Batch, Settlement
from tenantq.fairness import ClaimRequest, claim_next
from tenantq.store import jobs
from tenantq.store.db import Conn, Database
from tests.integration.helpers import db_now, fetch_all, fetch_one

LEASE = 30.0


def _request(batch_size: int = 10, worker: str = "worker-a") -> ClaimRequest:
    return ClaimRequest(worker_id=worker, driver="test", batch_size=batch_size, lease_seconds=LEASE)


@pytest.fixture
def conn(db: Database) -> Iterator[Conn]:
    with db.connect() as c:
        yield c


@pytest.fixture
def t0(db: Database) -> datetime:
    return db_now(db)


def at(t0: datetime, seconds: float) -> datetime:
    return t0 + timedelta(seconds=seconds)


def _claim(conn: Conn, now: datetime, *, batch_size: int = 10, worker: str = "worker-a") -> Batch:
    batch = claim_next(conn, _request(batch_size, worker), "default", now=now)
    assert batch is not None
    return batch


def _rows(db: Database, ids: list[int]) -> list[dict[str, Any]]:
    return fetch_all(
        db,
        "SELECT id, status, attempts, batch_id, result, last_error, run_after, started_at, finished_at "
        "FROM jobs WHERE id = ANY(%(ids)s) ORDER BY id",
        {"ids": ids},
    )


def _batch_row(db: Database, batch_id: int) -> dict[str, Any]:
    return fetch_one(db, "SELECT * FROM batches WHERE batch_id = %(b)s", {"b": batch_id})


def _done(job_id: int, result: Any = None) -> Settlement:
    return Settlement(job_id=job_id, status="done", result=result)


def test_claim_leases_up_to_batch_size_jobs_of_one_tenant(queue: Queue, db: Database, conn: Conn,
                                                          t0: datetime) -> None:
    a = queue.enqueue_many([{"tenant": "acme", "kind": "demo.noop", "payload": {"i": i}} for i in range(5)],
                           now=t0)
    b = queue.enqueue_many([{"tenant": "globex", "kind": "demo.noop", "payload": {"i": i}} for i in range(5)],
                           now=t0)
    batch = _claim(conn, at(t0, 1), batch_size=3)

    assert len(batch.jobs) == 3
    assert {j.tenant_id for j in batch.jobs} == {batch.tenant_id}
    owned = a if batch.tenant_id == "acme" else b
    assert [j.id for j in batch.jobs] == owned[:3], "oldest first"
    assert all(j.attempt == 1 for j in batch.jobs), "attempts are counted at claim time"
    assert batch.lease_expires_at == at(t0, 1 + LEASE)

    rows = _rows(db, owned)
    assert [r["status"] for r in rows] == ["running"] * 3 + ["pending"] * 2
    assert [r["attempts"] for r in rows] == [1, 1, 1, 0, 0]
    assert all(r["batch_id"] == batch.batch_id and r["started_at"] == at(t0, 1) for r in rows[:3])
    lease = _batch_row(db, batch.batch_id)
    assert lease["tenant_id"] == batch.tenant_id and lease["job_count"] == 3
    assert lease["worker_id"] == "worker-a" and lease["ended_at"] is None
    assert lease["lease_expires_at"] == at(t0, 1 + LEASE)

    # the next claim takes another tenant's jobs or the rest; never a job twice
    second = _claim(conn, at(t0, 2), batch_size=3)
    assert not {j.id for j in second.jobs} & {j.id for j in batch.jobs}
    assert len({j.tenant_id for j in second.jobs}) == 1


def test_claim_returns_none_when_nothing_is_runnable(queue: Queue, conn: Conn, t0: datetime) -> None:
    assert claim_next(conn, _request(), "default", now=t0) is None
    queue.enqueue("acme", "demo.noop", priority="bulk", now=t0)
    assert claim_next(conn, _request(), "default", now=at(t0, 1)) is None
    assert claim_next(conn, _request(), "interactive", now=at(t0, 1)) is None
    batch = claim_next(conn, _request(), "bulk", now=at(t0, 1))
    assert batch is not None and batch.priority == "bulk"


def test_a_claim_abandoned_before_its_commit_keeps_nothing(queue: Queue, db: Database, conn: Conn,
                                                           t0: datetime) -> None:
    # a stopping worker's pick in flight: asked before the decision commits,
    # the jobs, the lease and the round robin's cursor and deficits are as
    # if it never ran
    ids = queue.enqueue_many([{"tenant": "acme", "kind": "demo.noop"}] * 3, now=t0)
    before = fetch_all(db, "SELECT * FROM scheduler ORDER BY priority")
    deficits = fetch_all(db, "SELECT tenant_id, priority, deficit FROM queues ORDER BY 1, 2")
    asked: list[bool] = []

    def stopping() -> bool:
        asked.append(True)
        return True

    assert claim_next(conn, _request(), "default", now=at(t0, 1), abandon=stopping) is None
    assert asked, "the stop was asked"
    assert [r["status"] for r in _rows(db, ids)] == ["pending"] * 3
    assert [r["attempts"] for r in _rows(db, ids)] == [0] * 3
    assert fetch_one(db, "SELECT count(*) AS n FROM batches")["n"] == 0
    assert fetch_all(db, "SELECT * FROM scheduler ORDER BY priority") == before
    assert fetch_all(db, "SELECT tenant_id, priority, deficit FROM queues ORDER BY 1, 2") == deficits
    # and the next claim, not stopping, takes them on their first attempt
    assert all(j.attempt == 1 for j in _claim(conn, at(t0, 2)).jobs)


def test_a_claim_abandoned_after_its_rows_are_locked_keeps_no_job_and_no_charge(
        queue: Queue, db: Database, conn: Conn, t0: datetime) -> None:
    # the stop arrives between the decision's commit and the claim's: the
    # jobs stay pending at attempt 0, no batch is left, the queue's deficit
    # is repaid; only the cursor has moved (claim_next's docstring)
    ids = queue.enqueue_many([{"tenant": "acme", "kind": "demo.noop"}] * 3, now=t0)
    deficits = fetch_all(db, "SELECT tenant_id, priority, deficit FROM queues ORDER BY 1, 2")
    answers = iter([False, True])
    asked: list[bool] = []

    def stopping() -> bool:
        asked.append(True)
        return next(answers)

    assert claim_next(conn, _request(), "default", now=at(t0, 1), abandon=stopping) is None
    assert len(asked) == 2, "asked before the decision's commit and after the rows were locked"
    assert [r["status"] for r in _rows(db, ids)] == ["pending"] * 3
    assert [r["attempts"] for r in _rows(db, ids)] == [0] * 3
    assert fetch_one(db, "SELECT count(*) AS n FROM batches")["n"] == 0
    assert fetch_all(db, "SELECT tenant_id, priority, deficit FROM queues ORDER BY 1, 2") == deficits
    cursor = fetch_one(db, "SELECT cursor_tenant FROM scheduler WHERE priority = 'default'")
    assert cursor["cursor_tenant"] == "acme"
    assert all(j.attempt == 1 for j in _claim(conn, at(t0, 2)).jobs)


def test_settle_with_a_wrong_or_stale_token_is_refused(queue: Queue, db: Database, conn: Conn,
                                                        t0: datetime) -> None:
    ids = queue.enqueue_many([{"tenant": "acme", "kind": "demo.noop"} for _ in range(2)], now=t0)
    batch = _claim(conn, at(t0, 1))
    before = _rows(db, ids)

    with pytest.raises(tenantq.LeaseLost):
        jobs.settle(conn, batch.batch_id + 1000, [_done(ids[0], 1)], end_outcome="ok", now=at(t0, 2))
    assert _rows(db, ids) == before
    assert _batch_row(db, batch.batch_id)["ended_at"] is None

    settled = jobs.settle(conn, batch.batch_id, [_done(ids[0], {"n": 1}), _done(ids[1], None)],
                          end_outcome="ok", now=at(t0, 2))
    assert sorted(settled) == ids
    after = _rows(db, ids)
    assert [r["status"] for r in after] == ["done", "done"]
    assert [r["result"] for r in after] == [{"n": 1}, None]
    assert all(r["batch_id"] is None and r["finished_at"] == at(t0, 2) for r in after)
    assert _batch_row(db, batch.batch_id)["outcome"] == "ok"

    # the same token once more: the lease has ended
    with pytest.raises(tenantq.LeaseLost):
        jobs.settle(conn, batch.batch_id, [Settlement(ids[0], "pending", error="late")], now=at(t0, 3))
    assert _rows(db, ids) == after


def test_settle_after_expiry_is_refused_even_before_the_reaper_runs(queue: Queue, db: Database, conn: Conn,
                                                                     t0: datetime) -> None:
    job_id = queue.enqueue("acme", "demo.noop", now=t0)
    batch = _claim(conn, t0)
    before = _rows(db, [job_id])
    with pytest.raises(tenantq.LeaseLost):
        jobs.settle(conn, batch.batch_id, [_done(job_id)], end_outcome="ok", now=at(t0, LEASE + 1))
    assert _rows(db, [job_id]) == before


def test_expired_lease_puts_jobs_back_and_refuses_the_old_lease(queue: Queue, db: Database, conn: Conn,
                                                                 t0: datetime) -> None:
    retry = queue.enqueue("acme", "demo.noop", max_attempts=3, now=t0)
    last_try = queue.enqueue("acme", "demo.noop", max_attempts=1, now=t0)
    batch = _claim(conn, at(t0, 1))
    assert {j.id for j in batch.jobs} == {retry, last_try}

    assert jobs.expire_leases(conn, now=at(t0, LEASE)) == [], "not expired yet"
    reaped = jobs.expire_leases(conn, now=at(t0, LEASE + 2))
    assert {(r["id"], r["status"]) for r in reaped} == {(retry, "pending"), (last_try, "dead")}

    back, dead = _rows(db, [retry, last_try])
    assert back["status"] == "pending" and back["attempts"] == 1, "the crashed attempt still counts"
    assert back["batch_id"] is None and back["run_after"] == at(t0, LEASE + 2)
    assert "lease expired" in back["last_error"] and "worker-a" in back["last_error"]
    assert dead["status"] == "dead" and dead["attempts"] == 1
    assert dead["finished_at"] == at(t0, LEASE + 2) and "lease expired" in dead["last_error"]
    lease = _batch_row(db, batch.batch_id)
    assert lease["outcome"] == "lease_expired" and lease["ended_at"] == at(t0, LEASE + 2)
    assert jobs.expire_leases(conn, now=at(t0, LEASE + 3)) == [], "reaping is idempotent"

    # the dispatcher that lost the lease comes back and tries to settle
    before = _rows(db, [retry, last_try])
    for now in (at(t0, 2), at(t0, LEASE + 3), None):
        with pytest.raises(tenantq.LeaseLost):
            jobs.settle(conn, batch.batch_id, [_done(retry), _done(last_try)], end_outcome="ok", now=now)
    assert _rows(db, [retry, last_try]) == before


def test_a_re_leased_job_is_not_overwritten_by_the_zombie(queue: Queue, db: Database, conn: Conn,
                                                           t0: datetime) -> None:
    job_id = queue.enqueue("acme", "demo.noop", now=t0)
    zombie = _claim(conn, t0, worker="zombie")
    jobs.expire_leases(conn, now=at(t0, LEASE + 1))
    fresh = _claim(conn, at(t0, LEASE + 2), worker="fresh")
    assert fresh.batch_id > zombie.batch_id, "fencing tokens only grow"
    assert [j.id for j in fresh.jobs] == [job_id] and fresh.jobs[0].attempt == 2

    with pytest.raises(tenantq.LeaseLost):
        jobs.settle(conn, zombie.batch_id, [_done(job_id, "zombie")], end_outcome="ok", now=at(t0, LEASE + 3))
    (row,) = _rows(db, [job_id])
    assert row["status"] == "running" and row["batch_id"] == fresh.batch_id and row["result"] is None

    jobs.settle(conn, fresh.batch_id, [_done(job_id, "fresh")], end_outcome="ok", now=at(t0, LEASE + 4))
    with pytest.raises(tenantq.LeaseLost):
        jobs.settle(conn, zombie.batch_id, [Settlement(job_id, "dead", error="zombie")], now=None)
    (row,) = _rows(db, [job_id])
    assert (row["status"], row["result"], row["attempts"]) == ("done", "fresh", 2)


def test_settle_ignores_jobs_outside_the_lease(queue: Queue, db: Database, conn: Conn, t0: datetime) -> None:
    mine = queue.enqueue("acme", "demo.noop", now=t0)
    batch = _claim(conn, at(t0, 1))
    other = queue.enqueue("acme", "demo.noop", now=at(t0, 2))
    settled = jobs.settle(conn, batch.batch_id, [_done(mine), _done(other)], now=at(t0, 3))
    assert settled == [mine]
    assert [r["status"] for r in _rows(db, [mine, other])] == ["done", "pending"]


def test_release_of_unstarted_jobs_refunds_the_attempt(queue: Queue, db: Database, conn: Conn,
                                                        t0: datetime) -> None:
    ids = queue.enqueue_many([{"tenant": "acme", "kind": "demo.noop"} for _ in range(3)], now=t0)
    batch = _claim(conn, at(t0, 1))
    jobs.settle(conn, batch.batch_id, [_done(ids[0])], release=ids[1:], end_outcome="released",
                run_seconds=0.5, now=at(t0, 2))
    rows = _rows(db, ids)
    assert [r["status"] for r in rows] == ["done", "pending", "pending"]
    assert [r["attempts"] for r in rows] == [1, 0, 0]
    assert all(r["batch_id"] is None and r["started_at"] is None for r in rows[1:])
    lease = _batch_row(db, batch.batch_id)
    assert lease["outcome"] == "released" and lease["ended_at"] == at(t0, 2)
    assert lease["run_seconds"] == 0.5

    again = _claim(conn, at(t0, 3))
    assert [j.id for j in again.jobs] == ids[1:]
    assert [j.attempt for j in again.jobs] == [1, 1]


def test_cancel_ends_a_pending_job_at_once_and_a_running_one_at_its_settle(
        queue: Queue, db: Database, conn: Conn, t0: datetime) -> None:
    pending, running = queue.enqueue_many(
        [{"tenant": "acme", "kind": "demo.noop"}, {"tenant": "globex", "kind": "demo.noop"}], now=t0)
    batch = claim_next(conn, _request(), "default", now=at(t0, 1))
    assert batch is not None
    if batch.jobs[0].id == pending:  # whichever tenant the scheduler served first is running
        pending, running = running, pending

    assert queue.cancel(pending) is True
    row = _rows(db, [pending])[0]
    assert row["status"] == "cancelled" and row["finished_at"] is not None
    assert queue.cancel(pending) is False, "already cancelled"
    assert queue.cancel(running, by="usr_1") is True, "a running job is asked to stop"
    assert _rows(db, [running])[0]["status"] == "running", "its worker stops and settles it"
    assert queue.job(running).cancelled_by == "usr_1" and queue.job(running).cancel_requested_at is not None
    jobs.settle(conn, batch.batch_id, [_done(running)], end_outcome="ok", now=at(t0, 2))
    assert _rows(db, [running])[0]["status"] == "cancelled", "the request wins over the reported outcome"
    assert queue.job(running).result is None
    assert jobs.cancel(conn, running) is False, "it has ended"
    with pytest.raises(tenantq.JobNotFound):
        queue.cancel(10**12)
    assert claim_next(conn, _request(), "default", now=at(t0, 3)) is None, "a cancelled job never runs"


def test_retry_dead_resets_attempts_and_makes_the_job_claimable(queue: Queue, db: Database, conn: Conn,
                                                                t0: datetime) -> None:
    job_id = queue.enqueue("acme", "demo.noop", max_attempts=2, now=t0)
    other = queue.enqueue("globex", "demo.noop", max_attempts=1, now=t0)
    n = 0
    while (batch := claim_next(conn, _request(), "default", now=at(t0, n))) is not None:
        n += 1
        assert n <= 3, "three attempts in all"
        settlements = [failed(j, f"boom {j.attempt}", backoff=Backoff(0, 0)) for j in batch.jobs]
        jobs.settle(conn, batch.batch_id, settlements, end_outcome="failed", now=at(t0, n))
    rows = _rows(db, [job_id, other])
    assert [r["status"] for r in rows] == ["dead", "dead"]
    assert (rows[0]["attempts"], rows[0]["last_error"]) == (2, "boom 2")
    assert (rows[1]["attempts"], rows[1]["last_error"]) == (1, "boom 1")
    assert {r["id"] for r in queue.dead_jobs()} == {job_id, other}
    assert [r["id"] for r in queue.dead_jobs("acme")] == [job_id]

    assert queue.retry_dead([job_id]) == [job_id]
    row = _rows(db, [job_id])[0]
    assert (row["status"], row["attempts"], row["finished_at"]) == ("pending", 0, None)
    assert row["last_error"] is not None, "the last error stays for the record"
    # the history is kept: the replay is counted, the attempts before it stay
    info = queue.job(job_id)
    assert info.replays == 1
    assert [(a["attempt"], a["replay"], a["outcome"], a["error"]) for a in info.attempts_history] == [
        (1, 0, "failed", "boom 1"), (2, 0, "failed", "boom 2")]
    assert _rows(db, [other])[0]["status"] == "dead", "only the named job is replayed"
    assert queue.retry_dead([job_id]) == [], "it is no longer dead"

    batch = _claim(conn, at(t0, 10))
    assert [(j.id, j.attempt) for j in batch.jobs] == [(job_id, 1)]

    assert queue.retry_dead(tenant="globex") == [other]
    assert _claim(conn, at(t0, 11)).jobs[0].id == other


def test_heartbeat_extends_a_live_lease_and_never_revives_an_expired_one(queue: Queue, db: Database,
                                                                         conn: Conn, t0: datetime) -> None:
    job_id = queue.enqueue("acme", "demo.noop", now=t0)
    batch = _claim(conn, t0)
    assert jobs.heartbeat(conn, [batch.batch_id], lease_seconds=LEASE, now=at(t0, 20)) == {batch.batch_id}
    lease = _batch_row(db, batch.batch_id)
    assert lease["lease_expires_at"] == at(t0, 20 + LEASE) and lease["heartbeat_at"] == at(t0, 20)
    assert jobs.expire_leases(conn, now=at(t0, LEASE + 1)) == [], "the heartbeat kept it alive"
    jobs.settle(conn, batch.batch_id, [], now=at(t0, LEASE + 1))  # still live: accepted

    # missed beats: expired (not yet reaped) and then reaped
    assert jobs.heartbeat(conn, [batch.batch_id], lease_seconds=LEASE, now=at(t0, 20 + LEASE + 1)) == set()
    assert _batch_row(db, batch.batch_id)["lease_expires_at"] == at(t0, 20 + LEASE)
    assert [r["id"] for r in jobs.expire_leases(conn, now=at(t0, 20 + LEASE + 1))] == [job_id]
    assert jobs.heartbeat(conn, [batch.batch_id], lease_seconds=LEASE, now=at(t0, 20 + LEASE + 2)) == set()
    lease = _batch_row(db, batch.batch_id)
    assert lease["lease_expires_at"] == at(t0, 20 + LEASE) and lease["outcome"] == "lease_expired"
    assert jobs.heartbeat(conn, [], lease_seconds=LEASE) == set()


def test_a_batch_its_slot_just_ended_is_not_reported_lost(queue: Queue, conn: Conn, t0: datetime) -> None:
    """The slot ends its batch, then the heartbeat (working from an older
    snapshot of the worker's leases) sees it: finished, not lost."""
    queue.enqueue("acme", "demo.noop", now=t0)
    batch = _claim(conn, t0)
    jobs.settle(conn, batch.batch_id, [], end_outcome="ok", now=at(t0, 1))
    assert jobs.heartbeat(conn, [batch.batch_id], lease_seconds=LEASE, now=at(t0, 2)) == {batch.batch_id}


def test_failed_job_backs_off_then_goes_dead_with_the_last_error(queue: Queue, db: Database, conn: Conn,
                                                                 t0: datetime) -> None:
    job_id = queue.enqueue("acme", "demo.fail", max_attempts=2, now=t0)
    backoff = Backoff(base_seconds=10, cap_seconds=10)
    batch = _claim(conn, at(t0, 1))
    first = failed(batch.jobs[0], "RuntimeError: boom 1", backoff=backoff, rng=random.Random(7))
    assert first.status == "pending" and 0 < first.delay <= 10
    jobs.settle(conn, batch.batch_id, [first], end_outcome="failed", now=at(t0, 2))
    (row,) = _rows(db, [job_id])
    assert (row["status"], row["attempts"], row["last_error"]) == ("pending", 1, "RuntimeError: boom 1")
    assert abs((row["run_after"] - at(t0, 2 + first.delay)).total_seconds()) < 1e-3
    assert row["finished_at"] is None

    assert claim_next(conn, _request(), "default", now=at(t0, 2)) is None, "not before run_after"
    batch = _claim(conn, at(t0, 2 + first.delay + 0.01))
    assert batch.jobs[0].attempt == 2
    last = failed(batch.jobs[0], "RuntimeError: boom 2", backoff=backoff)
    assert last.status == "dead"
    jobs.settle(conn, batch.batch_id, [last], end_outcome="failed", now=at(t0, 20))
    (row,) = _rows(db, [job_id])
    assert (row["status"], row["attempts"], row["last_error"]) == ("dead", 2, "RuntimeError: boom 2")
    assert row["finished_at"] == at(t0, 20)
    assert claim_next(conn, _request(), "default", now=at(t0, 1000)) is None


def test_job_info_shows_the_lease(queue: Queue, conn: Conn, t0: datetime) -> None:
    job_id = queue.enqueue("acme", "demo.noop", now=t0)
    batch = _claim(conn, t0, worker="worker-z")
    info = queue.job(job_id)
    assert (info.status, info.batch_id, info.lease_owner) == ("running", batch.batch_id, "worker-z")
    assert info.lease_expires_at == batch.lease_expires_at
    with pytest.raises(tenantq.JobNotFound):
        queue.job(10**12)
