"""Retention on real Postgres: finished jobs past their window (TENANTQ_RETAIN_DONE,
_CANCELLED, _DEAD, or the tenant's own `retain_*_seconds`) are deleted by
every worker's maintenance, with their attempt history and refused-egress
rows, in chunks of PRUNE_CHUNK; younger ones and every pending or running
job stay; `Queue.prune(dry_run=True)` only counts; a prune and a claim never
wait on each other. Finished times are moved into the past by SQL."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any, LiteralString

import pytest

import tenantq
from tenantq import JobSpec, Queue
from tenantq.dispatch import maintenance
from tenantq.dispatch.executors.inline import InlineExecutor
from tenantq.dispatch.outcome import Backoff
from tenantq.dispatch.worker import Worker, WorkerConfig, WorkerStats
from tenantq.domain.records import Settlement
from tenantq.fairness import ClaimRequest, claim_next
from tenantq.observe import metrics
from tenantq.registry import Registry
from tenantq.settings import Settings
from tenantq.store import jobs, wakes
from tenantq.store.db import Database
from tenantq.store.steps import Steps, run
from tests.integration.helpers import fetch_all, scalar

NO_BACKOFF = Backoff(base_seconds=0.0, cap_seconds=0.0)
DAY = 86400.0


@pytest.fixture(autouse=True)
def windows(monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    """Retention windows, set before any worker or Queue of the test exists."""
    monkeypatch.setenv("TENANTQ_RETAIN_DONE", "1d")
    monkeypatch.setenv("TENANTQ_RETAIN_CANCELLED", "2d")
    monkeypatch.setenv("TENANTQ_RETAIN_DEAD", "3d")
    return Settings().retention()


@pytest.fixture
def registry() -> Registry:
    reg = Registry()

    @tenantq.handler("r.ok", isolation="inline", registry=reg)
    def ok(payload: Any, ctx: tenantq.JobContext) -> dict[str, int]:
        return {"job": ctx.job_id}

    @tenantq.handler("r.fail", isolation="inline", registry=reg)
    def fail(payload: Any, ctx: tenantq.JobContext) -> None:
        raise RuntimeError("boom")

    return reg


def _once(db: Database, registry: Registry) -> WorkerStats:
    config = WorkerConfig(concurrency=1, batch_size=50, once=True, lease_seconds=30, backoff=NO_BACKOFF)
    return Worker(db, InlineExecutor(registry), config).run()


def _execute(db: Database, statement: LiteralString, params: dict[str, Any] | None = None) -> None:
    with db.connect() as conn:
        conn.execute(statement, params or {})


def _age(db: Database, ids: list[int], seconds: float) -> None:
    """Move these jobs' lives `seconds` into the past (finished or not)."""
    _execute(db, "UPDATE jobs SET created_at = created_at - make_interval(secs => %(s)s), "
                 "started_at = started_at - make_interval(secs => %(s)s), "
                 "finished_at = finished_at - make_interval(secs => %(s)s) WHERE id = ANY(%(ids)s)",
             {"s": seconds, "ids": ids})


def _ids(db: Database) -> set[int]:
    return {int(r["id"]) for r in fetch_all(db, "SELECT id FROM jobs")}


def _attempt_jobs(db: Database) -> set[int]:
    return {int(r["job_id"]) for r in fetch_all(db, "SELECT DISTINCT job_id FROM attempts")}


def _pruned_metric(status: str) -> float:
    return float(metrics.PRUNED.labels(status)._value.get())


def _expired_done(db: Database, queue: Queue, tenant: str, count: int, age: float) -> list[int]:
    """`count` done jobs (each with one attempt row) that finished `age` s ago, made by SQL."""
    ids = queue.enqueue_many([JobSpec(tenant, "r.ok") for _ in range(count)])
    with db.connect() as conn:
        wakes.fold(conn)  # the tenant's row (tenant settings below are written to it)
    _execute(db, "UPDATE jobs SET status = 'done', attempts = 1, result = 'null', "
                 "started_at = now() - make_interval(secs => %(age)s + 1), "
                 "finished_at = now() - make_interval(secs => %(age)s) WHERE id = ANY(%(ids)s)",
             {"ids": ids, "age": age})
    _execute(db, "INSERT INTO attempts (tenant_id, job_id, attempt, started_at, finished_at, worker_id, "
                 "driver, outcome) SELECT tenant_id, id, 1, started_at, finished_at, 'w', 'inline', 'done' "
                 "FROM jobs WHERE id = ANY(%(ids)s)", {"ids": ids})
    return ids


def test_a_workers_maintenance_prunes_what_is_past_its_window_and_keeps_the_rest(
        queue: Queue, db: Database, registry: Registry) -> None:
    # a running job, claimed by some other worker long ago, and a pending one
    running_job = queue.enqueue("acme", "r.ok")
    with db.connect() as conn:
        claimed = claim_next(conn, ClaimRequest(worker_id="elsewhere", driver="inline", batch_size=1,
                                                lease_seconds=3600), "default")
    assert claimed is not None and [j.id for j in claimed.jobs] == [running_job]
    pending_job = queue.enqueue("acme", "r.ok", delay=3600)
    # real finished jobs, with their history: done, dead, cancelled
    done = queue.enqueue_many([JobSpec("acme", "r.ok") for _ in range(5)])
    dead = queue.enqueue_many([JobSpec("acme", "r.fail", max_attempts=1) for _ in range(2)])
    stats = _once(db, registry)
    assert (stats.done, stats.dead) == (5, 2), stats.snapshot()
    cancelled = queue.enqueue_many([JobSpec("acme", "r.ok", delay=3600) for _ in range(2)])
    assert all(queue.cancel(j) for j in cancelled)
    # windows: done 1 d, cancelled 2 d, dead 3 d
    for ids, seconds in ((done[:3], 2 * DAY), (done[3:], 0.5 * DAY), (dead[:1], 4 * DAY), (dead[1:], 2 * DAY),
                         (cancelled[:1], 3 * DAY), (cancelled[1:], 1.5 * DAY),
                         ([pending_job, running_job], 100 * DAY)):
        _age(db, ids, seconds)
    batch_id = scalar(db, "SELECT min(batch_id) FROM batches")
    for job_id in (done[0], done[3]):
        _execute(db, "INSERT INTO egress_blocks (tenant_id, batch_id, job_id, host, reason, blocked_at) "
                     "VALUES ('acme', %(b)s, %(j)s, 'evil.example:443', 'not allowed', now())",
                 {"b": batch_id, "j": job_id})
    assert {*done, *dead} <= _attempt_jobs(db)
    before = {s: _pruned_metric(s) for s in ("done", "dead", "cancelled")}

    _once(db, registry)  # its maintenance prunes at its first tick

    gone = {*done[:3], dead[0], cancelled[0]}
    kept = {*done[3:], dead[1], cancelled[1], pending_job, running_job}
    assert _ids(db) == kept
    assert queue.job(running_job).status == "running" and queue.job(pending_job).status == "pending"
    assert not gone & _attempt_jobs(db), "the pruned jobs' attempts went with them"
    assert {*done[3:], dead[1]} <= _attempt_jobs(db)
    assert [int(r["job_id"]) for r in fetch_all(db, "SELECT job_id FROM egress_blocks")] == [done[3]]
    after = {s: _pruned_metric(s) for s in before}
    assert {s: after[s] - before[s] for s in before} == {"done": 3, "dead": 1, "cancelled": 1}


def test_a_tenants_own_window_keeps_its_jobs_longer_or_shorter(queue: Queue, db: Database) -> None:
    ages = {"keeper": [2 * 3600, 2 * DAY], "short": [2 * 3600, 2 * DAY], "plain": [2 * 3600, 2 * DAY]}
    made = {t: [_expired_done(db, queue, t, 1, age)[0] for age in a] for t, a in ages.items()}
    _execute(db, "UPDATE tenants SET retain_done_seconds = %(s)s WHERE tenant_id = 'keeper'", {"s": 30 * DAY})
    _execute(db, "UPDATE tenants SET retain_done_seconds = 3600 WHERE tenant_id = 'short'")
    everything = _ids(db)

    assert queue.prune(dry_run=True) == {"done": 3}  # counts, deletes nothing
    assert _ids(db) == everything and _attempt_jobs(db) == everything

    assert queue.prune() == {"done": 3}
    assert _ids(db) == {*made["keeper"], made["plain"][0]}
    assert _attempt_jobs(db) == _ids(db)
    assert queue.prune() == {}
    # older_than_seconds overrides every window, the tenants' too
    assert queue.prune(older_than_seconds=DAY, dry_run=True) == {"done": 1}
    assert queue.prune(older_than_seconds=60) == {"done": 3}
    assert _ids(db) == set()


@pytest.fixture
def pool(db: Database) -> Iterator[Any]:
    p = db.pool(min_size=1, max_size=2, name="test-prune", check=False)
    try:
        yield p
    finally:
        p.close()


def test_a_whales_backlog_does_not_starve_the_other_tenants_pruning(queue: Queue, db: Database,
                                                                     pool: Any) -> None:
    # found by the soak: chunks took the first tenant's rows for as long as it
    # had a chunk's worth, so with a whale first the others grew past their window
    _expired_done(db, queue, "a-whale", 3000, 10 * DAY)
    for tenant in ("b", "c", "d", "e", "f"):
        _expired_done(db, queue, tenant, 50, 10 * DAY)
    duty = maintenance.Maintenance(pool, maintenance.LeaseBook(), lease_seconds=30,
                                   stopping=threading.Event())
    windows = {"done": DAY, "cancelled": DAY, "dead": DAY}

    def left() -> dict[str, int]:
        rows = fetch_all(db, "SELECT tenant_id, count(*) AS n FROM jobs GROUP BY tenant_id")
        return {str(r["tenant_id"]): int(r["n"]) for r in rows}

    with pool.connection() as conn:
        first, last = run(conn, jobs.prune_chunk_steps(retention=windows, limit=1000, after=""))
        assert first == {"done": 1000} and last == "a-whale"
        assert left() == {"a-whale": 2000, "b": 50, "c": 50, "d": 50, "e": 50, "f": 50}
        # the next chunk starts after the whale: every other tenant, then round to it
        second, last = run(conn, jobs.prune_chunk_steps(retention=windows, limit=1000, after=last))
        assert second == {"done": 1000} and last == "a-whale"
        assert left() == {"a-whale": 1250}
        # and maintenance keeps the cursor from round to round
        duty._prune_after = "c"
        duty.prune_jobs(conn)
    assert left() == {}


def test_a_backlog_goes_in_chunks_of_a_thousand_in_one_round(queue: Queue, db: Database, pool: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    expired = _expired_done(db, queue, "acme", 2500, 10 * DAY)
    young = _expired_done(db, queue, "acme", 3, 3600)
    statements: list[int] = []
    real = jobs.prune_chunk_steps

    def counted(**kwargs: Any) -> Steps[tuple[dict[str, int], str]]:
        statements.append(int(kwargs["limit"]))
        return real(**kwargs)

    monkeypatch.setattr(jobs, "prune_chunk_steps", counted)
    before = _pruned_metric("done")
    duty = maintenance.Maintenance(pool, maintenance.LeaseBook(), lease_seconds=30,
                                   stopping=threading.Event())
    total = 0
    rounds = 0
    started = time.monotonic()
    with pool.connection() as conn:
        while total < len(expired) and rounds < 5:
            rounds += 1
            total += sum(duty.prune_jobs(conn).values())
    elapsed = time.monotonic() - started
    print(f"pruned {total} jobs in {rounds} round(s), {len(statements)} statement(s), {elapsed:.2f} s")
    assert total == len(expired)
    assert statements == [maintenance.PRUNE_CHUNK] * 3, "1,000 + 1,000 + 500"
    assert _pruned_metric("done") - before == len(expired)
    assert _ids(db) == set(young) and _attempt_jobs(db) == set(young)


def _open_transaction(db: Database) -> Any:
    conn = db.connect(autocommit=False)
    conn.execute("SELECT 1")  # a transaction is open: claim_next's own is a savepoint in it
    return conn


def test_a_prune_and_a_claim_do_not_wait_on_each_other(queue: Queue, db: Database,
                                                       windows: dict[str, float]) -> None:
    request = ClaimRequest(worker_id="w", driver="inline", batch_size=1, lease_seconds=60)
    expired = _expired_done(db, queue, "acme", 5, 10 * DAY)
    pending = queue.enqueue("acme", "r.ok")
    with db.connect() as conn:
        wakes.fold(conn)  # claim_next folds only on a connection with no transaction open

    # a claim holds its transaction (and the pending job's row lock) open...
    claiming = _open_transaction(db)
    try:
        batch = claim_next(claiming, request, "default")
        assert batch is not None and [j.id for j in batch.jobs] == [pending]
        # ...while the prune deletes the tenant's finished jobs: it returns
        with db.connect() as conn:
            conn.execute("SET statement_timeout = '5s'")
            began = time.monotonic()
            assert run(conn, jobs.prune_steps(retention=windows, limit=1000)) == {"done": 5}
            print(f"prune beside an open claim: {time.monotonic() - began:.3f} s")
        claiming.commit()
    finally:
        claiming.close()
    assert _ids(db) == {pending} and queue.job(pending).status == "running"

    # and the other way round: a prune's transaction open, a claim returns
    more = _expired_done(db, queue, "acme", 5, 10 * DAY)
    second = queue.enqueue("acme", "r.ok")
    pruning = _open_transaction(db)
    try:
        assert run(pruning, jobs.prune_steps(retention=windows, limit=1000)) == {"done": 5}
        with db.connect() as conn:
            conn.execute("SET statement_timeout = '5s'")
            began = time.monotonic()
            got = claim_next(conn, request, "default")
            print(f"claim beside an open prune: {time.monotonic() - began:.3f} s")
        assert got is not None and [j.id for j in got.jobs] == [second]
        pruning.commit()
    finally:
        pruning.close()
    assert _ids(db) == {pending, second}
    assert not set(expired) & _attempt_jobs(db) and not set(more) & _attempt_jobs(db)


def test_ended_batches_past_their_window_go_in_chunks_with_their_egress_blocks(
        queue: Queue, db: Database, pool: Any, registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """TENANTQ_RETAIN_BATCHES: an ended batch's record is deleted once it is
    older than the window (in PRUNE_CHUNK statements, oldest first), with its
    refused-egress rows; a younger one and a live one stay."""
    monkeypatch.setenv("TENANTQ_RETAIN_BATCHES", "1d")
    monkeypatch.setattr(maintenance, "PRUNE_CHUNK", 2)
    queue.enqueue_many([JobSpec("acme", "r.ok") for _ in range(5)])
    with db.connect() as conn:  # five one-job batches, settled as done
        for _ in range(5):
            batch = claim_next(conn, ClaimRequest(worker_id="w", driver="inline", batch_size=1,
                                                  lease_seconds=3600), "default")
            assert batch is not None
            jobs.settle(conn, batch.batch_id, [Settlement(batch.jobs[0].id, "done")], end_outcome="ok")
    live_job = queue.enqueue("acme", "r.ok")
    with db.connect() as conn:
        live = claim_next(conn, ClaimRequest(worker_id="w", driver="inline", batch_size=1,
                                             lease_seconds=3600), "default")
    assert live is not None and [j.id for j in live.jobs] == [live_job]
    rows = fetch_all(db, "SELECT batch_id FROM batches WHERE ended_at IS NOT NULL ORDER BY batch_id")
    ended = [int(r["batch_id"]) for r in rows]
    assert len(ended) == 5
    _execute(db, "UPDATE batches SET ended_at = ended_at - make_interval(days => 2), "
                 "created_at = created_at - make_interval(days => 2) WHERE batch_id = ANY(%(old)s)",
             {"old": ended[:4]})
    for batch_id in (ended[0], ended[4]):
        _execute(db, "INSERT INTO egress_blocks (tenant_id, batch_id, job_id, host, reason, blocked_at) "
                     "VALUES ('acme', %(b)s, NULL, 'evil.example:443', 'not allowed', now())",
                 {"b": batch_id})
    duty = maintenance.Maintenance(pool, maintenance.LeaseBook(), lease_seconds=30,
                                   stopping=threading.Event())
    with pool.connection() as conn:
        assert duty.prune_batches(conn, time.monotonic() + 30) == 4  # 2 + 2, then a statement finding none
    left = {int(r["batch_id"]) for r in fetch_all(db, "SELECT batch_id FROM batches")}
    assert left == {ended[4], live.batch_id}
    assert [int(r["batch_id"]) for r in fetch_all(db, "SELECT batch_id FROM egress_blocks")] == [ended[4]]


def test_a_bad_batch_window_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENANTQ_RETAIN_BATCHES", "soon")
    with pytest.raises(tenantq.InvalidInput, match=r"^TENANTQ_RETAIN_BATCHES must be a duration") as caught:
        Settings().batch_retention()
    assert "\n" not in str(caught.value)
