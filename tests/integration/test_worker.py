"""The worker end to end on real Postgres with the inline executor: --once
drains, NOTIFY wake-ups, failures and retries, and graceful stop."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import tests.apps.basic  # noqa: F401  (registers the demo.* handlers)
from tenantq import REGISTRY, Queue
from tenantq.dispatch.executors.inline import InlineExecutor
from tenantq.dispatch.outcome import Backoff
from tenantq.dispatch.worker import Worker, WorkerConfig, WorkerStats
from tenantq.fairness import ClaimRequest, claim_next
from tenantq.store.db import Database
from tenantq.testing import drain, wait_until
from tests.integration.helpers import WorkerThread, db_now, fetch_all, running, scalar, status_counts

NO_BACKOFF = Backoff(base_seconds=0.0, cap_seconds=0.0)


def _worker(db: Database, **config: object) -> Worker:
    settings: dict[str, object] = {"concurrency": 1, "batch_size": 10, "lease_seconds": 30,
                                   "poll_seconds": 0.2, "backoff": NO_BACKOFF}
    settings.update(config)
    return Worker(db, InlineExecutor(REGISTRY), WorkerConfig(**settings))  # type: ignore[arg-type]


def _run_once(worker: Worker, timeout: float = 20.0) -> WorkerStats:
    """Run a once=True worker in a thread and wait for it to return by itself."""
    assert worker.config.once
    thread = WorkerThread(worker).start()
    thread.thread.join(timeout)
    if thread.thread.is_alive():
        thread.stop_and_join()
        raise AssertionError("a once=True worker did not return on its own")
    return thread.stop_and_join()


def _status(queue: Queue, job_id: int) -> str:
    return queue.job(job_id).status


def test_once_drains_what_is_runnable_and_returns(queue: Queue, db: Database) -> None:
    ids = queue.enqueue_many([{"tenant": f"t{i % 3}", "kind": "demo.hello", "payload": {"i": i}}
                              for i in range(25)])
    later = queue.enqueue("t0", "demo.hello", delay=3600)
    stats = _run_once(_worker(db, once=True, concurrency=2, batch_size=4))

    assert stats.done == 25 and stats.retried == 0 and stats.dead == 0
    for i, job_id in enumerate(ids):
        info = queue.job(job_id)
        assert info.status == "done" and info.attempts == 1
        assert info.result == {"hello": f"t{i % 3}", "job": job_id, "attempt": 1, "payload": {"i": i}}
        assert info.finished_at is not None
    assert _status(queue, later) == "pending", "not runnable yet, so not drained"
    assert scalar(db, "SELECT count(*) FROM batches WHERE ended_at IS NULL") == 0
    # nothing runnable: returns straight away
    assert _run_once(_worker(db, once=True)).batches == 0


def _listening(db: Database) -> bool:
    return bool(scalar(
        db,
        "SELECT count(*) > 0 FROM pg_stat_activity WHERE query = %(listen)s AND datname = current_database()",
        {"listen": f'LISTEN "{db.notify_channel}"'},
    ))


def test_idle_worker_wakes_on_notify_well_before_the_poll(queue: Queue, db: Database) -> None:
    worker = _worker(db, poll_seconds=5.0)
    with running(worker):
        first = queue.enqueue("acme", "demo.hello")
        wait_until(lambda: _status(queue, first) == "done", timeout=5, message="first job done")
        wait_until(lambda: _listening(db), timeout=5, message="the worker's LISTEN")
        for n in range(3):
            # the slot went idle right after its last empty claim, so a poll
            # would not come for ~5 s: only the notification can wake it
            wait_until(lambda: scalar(db, "SELECT count(*) FROM jobs WHERE status <> 'done'") == 0,
                       timeout=3)
            started = time.monotonic()
            job_id = queue.enqueue("acme", "demo.hello", {"n": n})
            wait_until(lambda job_id=job_id: _status(queue, job_id) == "done", timeout=3,
                       message="the job, woken by NOTIFY")
            assert time.monotonic() - started < 3
        stopping = time.monotonic()
    assert time.monotonic() - stopping < 3, "an idle worker stops without waiting for its poll"


def test_a_job_enqueued_in_the_callers_transaction_wakes_an_idle_worker_at_commit(
        queue: Queue, db: Database) -> None:
    """enqueue(conn=) inside the caller's transaction: its NOTIFY is sent at
    the commit, so an idle worker (its next poll ~5 s away) runs the job at
    once then, and never before."""
    worker = _worker(db, poll_seconds=5.0)
    with running(worker):
        first = queue.enqueue("acme", "demo.hello")
        wait_until(lambda: _status(queue, first) == "done", timeout=5, message="first job done")
        wait_until(lambda: _listening(db), timeout=5, message="the worker's LISTEN")
        with db.connect(autocommit=False) as conn:
            job_id = queue.enqueue("acme", "demo.hello", {"n": 1}, conn=conn)
            with db.connect() as other:  # not visible, so not runnable, before the commit
                assert other.execute("SELECT count(*) AS n FROM jobs WHERE id = %(id)s",
                                     {"id": job_id}).fetchone()["n"] == 0
            conn.commit()
            committed = time.monotonic()
        wait_until(lambda: _status(queue, job_id) == "done", timeout=3, message="the job, woken at commit")
        assert time.monotonic() - committed < 3


def test_a_kind_the_app_does_not_register_is_left_pending_and_explained(queue: Queue, db: Database) -> None:
    """A worker takes only kinds its app registers: another app's job waits
    for a worker that can run it, without losing an attempt, and the worker
    serves its own kinds of the same tenant meanwhile."""
    worker = _worker(db)
    with running(worker) as (thread,):
        other = queue.enqueue("acme", "no.such.kind", {"x": 1}, max_attempts=2)
        good = queue.enqueue("acme", "demo.hello")
        wait_until(lambda: _status(queue, good) == "done", timeout=10, message="next job done")
        info = queue.job(other)
        assert (info.status, info.attempts, info.last_error) == ("pending", 0, None)
        # the kinds listed are the in-process REGISTRY's: what other test modules
        # imported decides which come first, so only the sentence is checked
        assert any(r.startswith("no running worker has a handler for kind no.such.kind (1 running worker(s) "
                                "serve: ") for r in info.why_waiting), info.why_waiting
        assert thread.thread.is_alive()
    assert queue.job(other).why_waiting[0] == "no worker is running (start one: tenantq worker --app MODULE)"


def test_handler_exception_becomes_a_retry_with_its_text(queue: Queue, db: Database) -> None:
    job_id = queue.enqueue("acme", "demo.fail", max_attempts=3)
    stats = _run_once(_worker(db, once=True, backoff=Backoff(base_seconds=3600, cap_seconds=3600)))
    assert stats.retried == 1
    info = queue.job(job_id)
    assert (info.status, info.attempts) == ("pending", 1)
    assert info.last_error is not None
    assert info.last_error.startswith("RuntimeError: boom on attempt 1\n")
    assert "Traceback" in info.last_error and "in fail" in info.last_error
    assert info.run_after > db_now(db)
    assert info.run_after <= db_now(db) + timedelta(seconds=3600)


def test_retries_until_success_or_dead(queue: Queue, db: Database) -> None:
    flaky = queue.enqueue("acme", "demo.flaky", {"succeed_on": 3}, max_attempts=5)
    doomed = queue.enqueue("globex", "demo.fail", max_attempts=3)
    stats = drain(db)
    assert (stats.done, stats.dead, stats.retried) == (1, 1, 4)

    ok = queue.job(flaky)
    assert (ok.status, ok.attempts, ok.result) == ("done", 3, {"succeeded_on": 3})
    dead = queue.job(doomed)
    assert (dead.status, dead.attempts) == ("dead", 3)
    assert dead.last_error is not None and dead.last_error.startswith("RuntimeError: boom on attempt 3")
    assert [r["id"] for r in queue.dead_jobs()] == [doomed]


def test_non_json_result_is_a_failed_attempt(queue: Queue, db: Database) -> None:
    job_id = queue.enqueue("acme", "demo.bad_result", max_attempts=1)
    drain(db)
    info = queue.job(job_id)
    assert (info.status, info.attempts, info.result) == ("dead", 1, None)
    assert info.last_error is not None and "result is not JSON-serialisable" in info.last_error


def test_drain_retries_a_bad_result_until_dead(queue: Queue, db: Database) -> None:
    """testing.drain promises that a failing job is retried within the same
    drain until it is dead; a result that cannot be stored is a failed
    attempt like any other, so it must follow the worker's backoff."""
    job_id = queue.enqueue("acme", "demo.bad_result", max_attempts=3)
    drain(db)
    info = queue.job(job_id)
    assert (info.status, info.attempts) == ("dead", 3), (
        f"retry scheduled {(info.run_after - db_now(db)).total_seconds():.2f}s ahead despite zero backoff")


def test_graceful_stop_finishes_the_running_job_and_releases_the_rest(
    queue: Queue, db: Database, tmp_path: Path
) -> None:
    started, release = tmp_path / "started", tmp_path / "release"
    blocker = queue.enqueue("acme", "demo.block", {"started": str(started), "release": str(release),
                                                   "max_seconds": 20})
    rest = queue.enqueue_many([{"tenant": "acme", "kind": "demo.hello"} for _ in range(4)])
    worker = _worker(db, concurrency=1, batch_size=10)
    thread = WorkerThread(worker).start()
    try:
        wait_until(started.exists, timeout=10, message="demo.block to start")
        lease = fetch_all(db, "SELECT batch_id, job_count, ended_at FROM batches")
        assert len(lease) == 1 and lease[0]["job_count"] == 5 and lease[0]["ended_at"] is None
        worker.stop()
        assert thread.thread.is_alive(), "stop() must not abandon the running job"
        release.write_text("go")
        stats = thread.stop_and_join(timeout=15)
    finally:
        release.write_text("go")
        worker.stop()
        thread.thread.join(15)

    assert (stats.done, stats.released) == (1, 4)
    assert _status(queue, blocker) == "done"
    for job_id in rest:
        info = queue.job(job_id)
        assert (info.status, info.attempts, info.batch_id, info.started_at) == ("pending", 0, None, None)
    batches = fetch_all(db, "SELECT ended_at, outcome FROM batches")
    assert len(batches) == 1 and batches[0]["ended_at"] is not None
    assert batches[0]["outcome"] == "released"
    assert status_counts(db) == {"done": 1, "pending": 4}
    # the released jobs run normally afterwards, on their first attempt
    drain(db)
    assert all(queue.job(j).attempts == 1 for j in rest)
    assert status_counts(db) == {"done": 5}


def test_jobs_of_a_killed_dispatcher_come_back(queue: Queue, db: Database) -> None:
    """A dispatcher leased a batch and died (no heartbeat, no settle): the
    next worker reaps the expired lease before its first claim and runs the
    jobs; the crashed attempt still counts."""
    ids = queue.enqueue_many([{"tenant": "acme", "kind": "demo.hello"} for _ in range(3)])
    request = ClaimRequest(worker_id="dead-dispatcher", driver="inline", batch_size=10, lease_seconds=0.3)
    with db.connect() as conn:
        batch = claim_next(conn, request, "default")
    assert batch is not None and len(batch.jobs) == 3
    wait_until(lambda: db_now(db) > batch.lease_expires_at, timeout=5, message="the lease to expire")

    stats = _run_once(_worker(db, once=True))
    assert stats.reaped == 3 and stats.done == 3
    for job_id in ids:
        info = queue.job(job_id)
        assert (info.status, info.attempts) == ("done", 2)
        assert info.result is not None and info.result["attempt"] == 2
    outcomes = fetch_all(db, "SELECT worker_id, outcome FROM batches ORDER BY batch_id")
    assert outcomes[0] == {"worker_id": "dead-dispatcher", "outcome": "lease_expired"}
    assert [o["outcome"] for o in outcomes[1:]] == ["ok"]


def test_heartbeats_keep_a_job_longer_than_its_lease(queue: Queue, db: Database, tmp_path: Path) -> None:
    log = tmp_path / "runs.log"
    job_id = queue.enqueue("acme", "demo.record", {"log": str(log), "sleep": 2.0})
    stats = _run_once(_worker(db, once=True, lease_seconds=1.0))
    info = queue.job(job_id)
    assert (info.status, info.attempts) == ("done", 1)
    assert (stats.done, stats.refused, stats.reaped) == (1, 0, 0)
    assert len(log.read_text().splitlines()) == 1, "ran once: the lease was never lost"
    lease = fetch_all(db, "SELECT created_at, heartbeat_at, outcome FROM batches")
    assert len(lease) == 1 and lease[0]["outcome"] == "ok"
    assert lease[0]["heartbeat_at"] > lease[0]["created_at"], "the lease was extended"


class BrokenExecutor:
    """An executor that cannot start anything (a sandbox runtime gone bad)."""

    name = "broken"

    def __init__(self) -> None:
        self.calls: list[float] = []

    def run(self, batch: object, **kwargs: object) -> None:
        self.calls.append(time.monotonic())
        raise OSError("cannot start a sandbox")


def test_a_failing_executor_backs_off_instead_of_spinning(queue: Queue, db: Database) -> None:
    job_id = queue.enqueue("acme", "demo.hello")
    broken = BrokenExecutor()
    worker = Worker(db, broken, WorkerConfig(concurrency=1, poll_seconds=0.2))  # type: ignore[arg-type]
    thread = WorkerThread(worker).start()
    try:
        wait_until(lambda: len(broken.calls) >= 3, timeout=30, message="three attempts to run the batch")
    finally:
        thread.stop_and_join()
    gaps = [b - a for a, b in zip(broken.calls, broken.calls[1:], strict=False)]
    # 1 s after the first failure, 2 s after the second: not a hot loop
    assert gaps[0] >= 0.9 and gaps[1] >= 1.9, gaps
    info = queue.job(job_id)
    # no job started, so the first job of each batch carried the failure
    assert info.attempts == len(broken.calls), (info.attempts, broken.calls)
    assert info.last_error is not None
    assert info.last_error.startswith("executor error before the batch's first job started: "
                                      "OSError: cannot start a sandbox"), info.last_error
