"""Cancelling running jobs on an inline worker (a threaded `Worker` with the
`InlineExecutor`, real Postgres): `Queue.cancel` on a running job reaches
its worker by notification (or, missed, by the maintenance tick's read of
`cancel_requested_at`), the handler is told through `ctx.cancelled`, and
the job ends `cancelled` on the host's own record (dispatch/settle.py),
whatever the handler returns; batch siblings not cancelled run on, one
cancelled before its turn never runs, and `Queue.wait` returns at the cancel.

Handlers live in a registry of each test's own (never the global one)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

import tenantq
from tenantq import JobSpec, Queue
from tenantq.dispatch.executors.inline import InlineExecutor
from tenantq.dispatch.outcome import Backoff
from tenantq.dispatch.worker import Worker, WorkerConfig
from tenantq.domain.records import JobInfo
from tenantq.errors import JobNotFound
from tenantq.fairness import ClaimRequest, claim_next
from tenantq.registry import Registry
from tenantq.store.db import Database
from tenantq.testing import wait_until
from tests.integration.helpers import fetch_all, running, scalar

STOP_WITHIN_SECONDS = 2.0
NO_BACKOFF = Backoff(base_seconds=0.0, cap_seconds=0.0)


@dataclass
class Probe:
    """What the handlers saw, and the switch that lets the blocking ones go."""

    started: dict[int, threading.Event] = field(default_factory=dict)
    saw_cancel: dict[int, bool] = field(default_factory=dict)
    release: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self, job_id: int) -> None:
        self.event(job_id).set()

    def event(self, job_id: int) -> threading.Event:
        with self.lock:
            return self.started.setdefault(job_id, threading.Event())

    def wait_started(self, job_id: int, timeout: float = 10.0) -> None:
        assert self.event(job_id).wait(timeout), f"job {job_id} did not start within {timeout} s"


def _registry(db: Database, probe: Probe) -> Registry:
    reg = Registry()

    @tenantq.handler("c.loop", isolation="inline", registry=reg)
    def loop(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
        """The well-behaved long job: sleeps through ctx.cancelled.wait."""
        probe.begin(ctx.job_id)
        deadline = time.monotonic() + 20
        while not ctx.cancelled.wait(0.05) and time.monotonic() < deadline:
            pass
        probe.saw_cancel[ctx.job_id] = bool(ctx.cancelled)
        return {"stopped_early": bool(ctx.cancelled)}

    @tenantq.handler("c.ignore", isolation="inline", registry=reg)
    def ignore(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
        """Never looks at ctx.cancelled: runs until the test lets it go."""
        probe.begin(ctx.job_id)
        probe.release.wait(15)
        return {"finished": True}

    @tenantq.handler("c.record", isolation="inline", registry=reg)
    def record(payload: Any, ctx: tenantq.JobContext) -> dict[str, Any]:
        """The side effect of running: a row in the test's own table."""
        with db.connect() as conn:
            conn.execute("INSERT INTO side_effects (job_id) VALUES (%(id)s)", {"id": ctx.job_id})
        return {"ran": ctx.job_id}

    @tenantq.handler("c.raise", isolation="inline", registry=reg)
    def raise_cancelled(payload: Any, ctx: tenantq.JobContext) -> None:
        raise RuntimeError("cancelled")

    return reg


@pytest.fixture
def probe() -> Iterator[Probe]:
    p = Probe()
    try:
        yield p
    finally:
        p.release.set()  # never leave a handler blocked behind a failed assertion


@pytest.fixture
def registry(db: Database, probe: Probe) -> Registry:
    with db.connect() as conn:
        conn.execute("CREATE TABLE side_effects (job_id bigint NOT NULL)")
    return _registry(db, probe)


def _worker(db: Database, registry: Registry, **config: Any) -> Worker:
    settings: dict[str, Any] = {"concurrency": 1, "batch_size": 10, "lease_seconds": 30, "poll_seconds": 0.2,
                                "backoff": NO_BACKOFF}
    settings.update(config)
    return Worker(db, InlineExecutor(registry), WorkerConfig(**settings))


class Waiter:
    """`Queue.wait(job)` in a thread of its own (its own Queue), timed."""

    def __init__(self, db: Database, job_id: int, timeout: float = 15.0) -> None:
        self.queue = Queue(db.dsn, schema=db.schema)
        self.job_id, self.timeout = job_id, timeout
        self.info: JobInfo | None = None
        self.error: BaseException | None = None
        self.returned_at: float | None = None
        self.thread = threading.Thread(target=self._run, name=f"wait-{job_id}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.info = self.queue.wait(self.job_id, timeout=self.timeout)
        except BaseException as exc:
            self.error = exc
        finally:
            self.returned_at = time.monotonic()

    def join(self) -> JobInfo:
        self.thread.join(self.timeout + 5)
        self.queue.close()
        assert not self.thread.is_alive(), "Queue.wait did not return"
        if self.error is not None:
            raise self.error
        assert self.info is not None
        return self.info


def _running_batch(db: Database, ids: list[int]) -> int:
    """The one batch all these jobs are running in (asserted)."""
    rows = fetch_all(db, "SELECT status, batch_id FROM jobs WHERE id = ANY(%(ids)s)", {"ids": ids})
    assert {r["status"] for r in rows} == {"running"} and len({r["batch_id"] for r in rows}) == 1, rows
    return int(rows[0]["batch_id"])


def _side_effects(db: Database) -> list[int]:
    return [int(r["job_id"]) for r in fetch_all(db, "SELECT job_id FROM side_effects ORDER BY job_id")]


def test_a_running_handler_is_stopped_within_two_seconds_and_ends_cancelled(
        queue: Queue, db: Database, registry: Registry, probe: Probe) -> None:
    with running(_worker(db, registry)):
        job = queue.enqueue("acme", "c.loop")
        probe.wait_started(job)
        waiter = Waiter(db, job)
        cancelled_at = time.monotonic()
        assert queue.cancel(job, by="ops") is True
        info = waiter.join()  # Queue.wait returns at the cancel
        assert waiter.returned_at is not None
        elapsed = waiter.returned_at - cancelled_at
        print(f"inline: cancel() to wait() returning cancelled: {elapsed:.3f} s")
        assert elapsed < STOP_WITHIN_SECONDS, elapsed
    assert info.status == "cancelled", info
    info = queue.job(job)
    assert (info.status, info.cancelled_by, info.attempts) == ("cancelled", "ops", 1)
    assert info.cancel_requested_at is not None and info.finished_at is not None
    assert info.result is None
    assert probe.saw_cancel[job] is True, "the handler was told through ctx.cancelled"
    assert [a["outcome"] for a in info.attempts_history] == ["cancelled"]
    assert info.outcome_note == "cancelled"
    assert scalar(db, "SELECT count(*) FROM batches WHERE ended_at IS NULL") == 0


def test_a_handler_that_ignores_the_cancel_still_ends_cancelled_and_its_result_is_dropped(
        queue: Queue, db: Database, registry: Registry, probe: Probe) -> None:
    worker = _worker(db, registry)
    with running(worker):
        job = queue.enqueue("acme", "c.ignore")
        probe.wait_started(job)
        assert queue.cancel(job, by="ops") is True
        wait_until(lambda: worker.cancels.requested(job), timeout=5, message="the worker took the request")
        assert queue.job(job).status == "running", "nothing can stop a handler that does not look"
        probe.release.set()  # it returns its result, as if nothing happened
        info = queue.wait(job, timeout=10)
    assert (info.status, info.cancelled_by, info.result) == ("cancelled", "ops", None)
    assert "its result is dropped" in (info.last_error or ""), info.last_error
    assert info.attempts_history[-1]["outcome"] == "cancelled"


def test_in_a_batch_only_the_cancelled_jobs_stop_and_an_unstarted_one_never_runs(
        queue: Queue, db: Database, registry: Registry, probe: Probe) -> None:
    worker = _worker(db, registry, batch_size=3)
    with running(worker):
        first, sibling, later = queue.enqueue_many([
            JobSpec("acme", "c.loop"), JobSpec("acme", "c.record"), JobSpec("acme", "c.record")])
        probe.wait_started(first)
        _running_batch(db, [first, sibling, later])
        assert queue.cancel(later, by="ops") is True  # claimed with the batch, not started
        wait_until(lambda: worker.cancels.requested(later), timeout=5, message="the worker took the request")
        assert queue.cancel(first, by="ops") is True
        infos = {job: queue.wait(job, timeout=10) for job in (first, sibling, later)}
    assert infos[first].status == "cancelled" and infos[first].cancelled_by == "ops"
    assert infos[sibling].status == "done" and infos[sibling].result == {"ran": sibling}
    assert infos[sibling].cancelled_by is None
    assert infos[later].status == "cancelled" and infos[later].cancelled_by == "ops"
    assert "before it started" in (infos[later].last_error or ""), infos[later].last_error
    assert _side_effects(db) == [sibling], "the cancelled job that had not started never ran"
    assert queue.job(later).attempts_history[-1]["outcome"] == "cancelled"


def test_a_job_cancelled_early_in_its_batch_ends_while_its_sibling_still_runs(
        queue: Queue, db: Database, registry: Registry, probe: Probe) -> None:
    """The cancelled job's end is written when it ends, not when its batch
    does: Queue.wait returns at the cancel even though the next job of the
    batch is still running."""
    with running(_worker(db, registry, batch_size=2)):
        first, sibling = queue.enqueue_many([JobSpec("acme", "c.loop"), JobSpec("acme", "c.ignore")])
        probe.wait_started(first)
        cancelled_at = time.monotonic()
        assert queue.cancel(first, by="ops") is True
        probe.wait_started(sibling)
        try:
            info = queue.wait(first, timeout=STOP_WITHIN_SECONDS + 1)
            elapsed = time.monotonic() - cancelled_at
            print(f"inline, sibling still running: cancel() to cancelled: {elapsed:.3f} s")
        finally:
            probe.release.set()
        assert info.status == "cancelled"
        assert elapsed < STOP_WITHIN_SECONDS, elapsed
        assert queue.wait(sibling, timeout=10).status == "done"


def test_cancelling_an_ended_job_returns_false_and_changes_nothing(
        queue: Queue, db: Database, registry: Registry) -> None:
    done = queue.enqueue("acme", "c.record")
    pending = queue.enqueue("acme", "c.record", delay=3600)
    stats = _worker(db, registry, once=True).run()
    assert stats.done == 1
    assert queue.cancel(done, by="ops") is False
    info = queue.job(done)
    assert (info.status, info.cancelled_by, info.cancel_requested_at) == ("done", None, None)
    # a pending one is cancelled at once; a second cancel finds it ended
    assert queue.cancel(pending, by="ops") is True
    assert (queue.job(pending).status, queue.job(pending).cancelled_by) == ("cancelled", "ops")
    assert queue.cancel(pending, by="someone-else") is False
    assert queue.job(pending).cancelled_by == "ops"
    with pytest.raises(JobNotFound):
        queue.cancel(10**12)


def test_a_missed_notification_is_made_up_for_by_the_maintenance_tick(
        queue: Queue, db: Database, registry: Registry, probe: Probe) -> None:
    lease_seconds = 1.2
    worker = _worker(db, registry, lease_seconds=lease_seconds)
    interval = lease_seconds / 3  # Maintenance heartbeats three times per lease
    with running(worker):
        job = queue.enqueue("acme", "c.loop")
        probe.wait_started(job)
        with db.connect() as conn:  # the request without its 'cancel:' notification
            conn.execute("UPDATE jobs SET cancel_requested_at = now() WHERE id = %(id)s", {"id": job})
        asked = time.monotonic()
        wait_until(lambda: queue.job(job).status == "cancelled", timeout=10, interval=0.02,
                   message="the job cancelled by the maintenance fallback")
        elapsed = time.monotonic() - asked
        print(f"inline, no notification: request to cancelled: {elapsed:.3f} s (tick every {interval:.2f} s)")
        assert elapsed < interval + 1.0, elapsed
    assert probe.saw_cancel[job] is True
    info = queue.job(job)
    assert info.cancelled_by is None and info.attempts_history[-1]["outcome"] == "cancelled"


def test_a_handler_saying_cancelled_is_a_failure_not_a_cancel(queue: Queue, db: Database,
                                                              registry: Registry) -> None:
    """Only the host's record of a cancel request makes a job cancelled."""
    retried = queue.enqueue("acme", "c.raise", max_attempts=2)
    dead = queue.enqueue("acme", "c.raise", max_attempts=1)
    worker = _worker(db, registry, once=True, backoff=Backoff(base_seconds=3600, cap_seconds=3600))
    stats = worker.run()
    assert (stats.retried, stats.dead) == (1, 1), stats.snapshot()
    for job, status in ((retried, "pending"), (dead, "dead")):
        info = queue.job(job)
        assert info.status == status, info
        assert (info.last_error or "").startswith("RuntimeError: cancelled"), info.last_error
        assert info.cancelled_by is None and info.cancel_requested_at is None
        assert [a["outcome"] for a in info.attempts_history] == ["failed"]


def test_a_cancel_that_comes_after_a_failed_attempt_ended_but_before_it_was_written_still_cancels(
        queue: Queue, db: Database, registry: Registry, probe: Probe) -> None:
    """The job failed in the executor, its retry not yet written (the batch
    flushes later): it is still `running` when `cancel()` says True, and a
    job asked to stop must not be retried."""
    worker = _worker(db, registry, batch_size=2, backoff=Backoff(base_seconds=3600, cap_seconds=3600))
    with running(worker):
        failing, sibling = queue.enqueue_many([JobSpec("acme", "c.raise", max_attempts=3),
                                               JobSpec("acme", "c.ignore")])
        probe.wait_started(sibling)  # the failing job has ended in the executor
        assert queue.job(failing).status == "running", "its end is not written yet"
        assert queue.cancel(failing, by="ops") is True
        wait_until(lambda: worker.cancels.requested(failing), timeout=5,
                   message="the worker took the request")
        probe.release.set()
        assert queue.wait(sibling, timeout=10).status == "done"
    info = queue.job(failing)
    assert info.status == "cancelled", (info.status, info.attempts, info.run_after, info.cancelled_by)


def test_a_job_asked_to_stop_when_its_worker_died_is_not_run_again(queue: Queue, db: Database,
                                                                   registry: Registry) -> None:
    job = queue.enqueue("acme", "c.record")
    with db.connect() as conn:  # a worker that claims it, then dies
        claimed = claim_next(conn, ClaimRequest(worker_id="doomed", driver="inline", batch_size=1,
                                                lease_seconds=0.5), "default")
    assert claimed is not None and [j.id for j in claimed.jobs] == [job]
    assert queue.cancel(job, by="ops") is True  # running: asked to stop, but nobody hears it
    wait_until(lambda: queue.reap() == 1, timeout=5, message="the dead worker's lease reaped")
    _worker(db, registry, once=True).run()
    info = queue.job(job)
    assert _side_effects(db) == [], f"the job ran again after its cancel (it is {info.status})"
    assert (info.status, info.cancelled_by) == ("cancelled", "ops")
