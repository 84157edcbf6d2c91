"""`tenantq worker`: slots that lease batches, run them, and settle them.

Each of `concurrency` slot threads loops: pick a batch (interactive first,
then default, then bulk), run it on the executor, settle results as they
come (flushed at most every `flush_seconds` and at the end). A maintenance
thread heartbeats the leases and reaps expired ones; a listener thread turns
NOTIFY into wake-ups.

A worker claims only the kinds its executor can run (`kinds()`, or its
registry's; see dispatch/presence.py), so several services with different
apps share one database, and it says so in the registry of live workers
(its kinds, driver, heartbeat and executor failures), which `tenantq job`
and the dashboard read. A worker whose app registers nothing it can run
refuses to start.

Stopping is graceful: a slot finishes the job it is running, releases the
batch's unstarted jobs (attempts refunded) and ends its lease.

A worker never dies from a batch (docs/security.md, rule H6): whatever a claim, an executor or the
settle bookkeeping (dispatch/settle.py) raises is contained in its slot. It
is logged once, with the batch id, the batch's jobs are settled or released
with the reason, and the slot carries on after a backoff. An executor that
raises before any job of its batch started (a failing warmup, a sandbox
that cannot start) fails the batch's first job with that error, attempt
counted, and releases the rest: a failure, never a release loop; an
executor that returns having started nothing is an executor failure too.
Only a worker that cannot carry on stops by itself (`failed`, `failure`;
`tenantq worker` then exits non-zero with that one line): `max_failures`
claims, or batches, failing in a row with no success in between, a slot
thread dying, or, with `once`, a claim failing ONCE_CLAIM_ATTEMPTS times,
ONCE_EXECUTOR_FAILURES executor failures in a row, or a drain that ends
while the executor's last batch failed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import psycopg

from tenantq.dispatch.cancels import CancelBook
from tenantq.dispatch.config import WorkerConfig, WorkerStats, default_worker_id
from tenantq.dispatch.executors.contract import BatchExecutor
from tenantq.dispatch.executors.inline import describe_exception
from tenantq.dispatch.maintenance import LeaseBook, Maintenance, driver_reaper, sync_app_schedules
from tenantq.dispatch.outcome import first_line, is_transient
from tenantq.dispatch.presence import Presence, executor_kinds, require_kinds
from tenantq.dispatch.settle import BatchRun, SettleContext
from tenantq.dispatch.wakeup import Listener, Wakeup
from tenantq.domain.records import Batch
from tenantq.errors import TenantqError
from tenantq.fairness import ClaimRequest, PickNotes, claim_next
from tenantq.fairness.slots import class_order, is_lent, reserved_slots
from tenantq.observe import metrics
from tenantq.observe.alerts import DeadJob, DeadLetterAlerts
from tenantq.store import wakes
from tenantq.store.db import Database, Pool
from tenantq.store.queries import sql
from tenantq.store.workers import WorkerRecord

log = logging.getLogger("tenantq.worker")
ONCE_CLAIM_ATTEMPTS = 5
# with `once`, executor failures in a row after which the drain gives up
ONCE_EXECUTOR_FAILURES = 3

__all__ = ["BatchRun", "Worker", "WorkerConfig", "WorkerStats", "default_worker_id"]


SecretsLookup = Callable[[str], Mapping[str, str]]


class Worker:
    def __init__(
        self,
        db: Database,
        executor: BatchExecutor,
        config: WorkerConfig | None = None,
        *,
        secrets: SecretsLookup | None = None,
        alerts: DeadLetterAlerts | None = None,
    ) -> None:
        self.db = db
        self.alerts = alerts or DeadLetterAlerts()
        self.executor = executor
        self.config = config or WorkerConfig()
        self.secrets = secrets or (lambda tenant: {})
        self.stats = WorkerStats()
        self.stopping = threading.Event()
        self.wakeup = Wakeup()
        self.leases = LeaseBook()
        self.started = threading.Event()
        # the worker stopped by itself because it cannot carry on, and why
        # (one line); `tenantq worker` then exits non-zero with it
        self.failed = False
        self.failure: str | None = None
        self._failing_lock = threading.Lock()
        self._streaks = {"claims": 0, "batches": 0}
        # set when interactive work is runnable: recalls lent reserved slots
        self.interactive_waiting = threading.Event()
        self.reserved = reserved_slots(self.config.concurrency, self.config.interactive_share)
        self._pool: Pool | None = None
        # cancel requests for jobs of its live batches (dispatch/cancels.py)
        self.cancels = CancelBook(self.leases.live, getattr(executor, "cancel", None))
        # the kinds it claims (None: every kind, for an executor that does not say)
        self.kinds = executor_kinds(executor)
        require_kinds(self.kinds, executor)
        self.presence = Presence(WorkerRecord.of(self.config.worker_id, executor.name,
                                                 self.config.lease_seconds, self.kinds))
        self._last_executor_error = ""

    # -- lifecycle -----------------------------------------------------
    def run(self) -> WorkerStats:
        """Run until stop() (or, with once=True, until nothing is runnable)."""
        cfg = self.config
        self._pool = self.db.pool(min_size=1, max_size=cfg.store_pool_size(), name=cfg.worker_id, check=False)
        listener = Listener(self.db, self.wakeup, self.stopping,
                            on_interactive=self._interactive_notified, on_cancel=self.cancels.request)
        maintenance = Maintenance(self._pool, self.leases, lease_seconds=cfg.lease_seconds,
                                  stopping=self.stopping,
                                  on_reaped=self._reaped,
                                  on_interactive=self.interactive_waiting.set,
                                  reap_sandboxes=driver_reaper(self.executor),
                                  presence=self.presence, kinds=self.kinds, cancels=self.cancels)
        slots = [threading.Thread(target=self._slot_thread, args=(i,), name=f"tenantq-slot-{i}", daemon=True)
                 for i in range(cfg.concurrency)]
        try:
            # reap before the first claim, so a restarted fleet picks up the
            # jobs of a dead worker without waiting one tick
            if self.alerts.enabled:
                self.alerts.start()
            try:
                sync_app_schedules(self._pool, getattr(self.executor, "registry", None), self.kinds)
                maintenance.tick()  # fires due schedules too: `--once` drains what they enqueue
            except psycopg.errors.UndefinedTable:
                raise TenantqError(f"tenantq tables not found in schema {self.db.schema!r}: "
                                   "run `tenantq migrate` first") from None
            if not cfg.once:
                listener.start()
                # wake-ups only work once LISTEN is in place; without it the
                # poll interval still applies, so do not wait forever
                listener.listening.wait(timeout=5)
            maintenance.start()
            for slot in slots:
                slot.start()
            self.started.set()
            shown = "every kind" if self.kinds is None else ", ".join(sorted(self.kinds))
            log.info("worker %s started: executor=%s concurrency=%d batch_size=%d kinds=%s",
                     cfg.worker_id, self.executor.name, cfg.concurrency, cfg.batch_size, shown)
            for slot in slots:
                while slot.is_alive():
                    slot.join(timeout=0.5)
            if cfg.once and self.presence.failures:
                # the drain ended while its failed jobs wait out their backoff:
                # the executor is broken, the queue is not empty
                self._fail(f"the executor failed on its last {self.presence.failures} batch(es) "
                           f"(last: {self._last_executor_error})")
        finally:
            self.stopping.set()
            self.wakeup.fire()
            if maintenance.is_alive():
                maintenance.join()
            if listener.is_alive():
                listener.join()
            self.presence.leave(self._pool)
            self._pool.close()
            close = getattr(self.executor, "close", None)
            if callable(close):
                close()  # kept-warm sandboxes go with the worker
            if self.alerts.enabled:
                self.alerts.close()
        log.info("worker %s stopped: %s", cfg.worker_id, self.stats.snapshot())
        return self.stats

    def _reaped(self, rows: list[dict[str, Any]]) -> None:
        """Jobs the reaper put back or dead-lettered from expired leases."""
        self.stats.add(reaped=len(rows))
        for r in rows:
            if r["status"] == "dead":
                metrics.DEAD_LETTERED.labels(r["priority"]).inc()
                self.alerts.fire(DeadJob(int(r["id"]), str(r["tenant_id"]), str(r["kind"]),
                                         int(r["attempts"]), str(r["last_error"])))

    def _interactive_notified(self) -> None:
        """NOTIFY says interactive work arrived: recall lent slots, unless
        none of it is of a kind this worker runs (another app's work)."""
        pool = self._pool
        if self.kinds is not None and pool is not None:
            try:
                with pool.connection() as conn:
                    row = conn.execute(sql("queues", "interactive_runnable"),
                                       {"kinds": sorted(self.kinds)}).fetchone()
                if row is not None and not row["waiting"]:
                    return
            except Exception:  # cannot tell: recall, as without kinds
                log.debug("interactive check failed; recalling lent slots", exc_info=True)
        self.interactive_waiting.set()

    def stop(self) -> None:
        """Graceful stop: finish running jobs, release the rest, end leases."""
        self.stopping.set()
        self.wakeup.fire()

    # -- failing -------------------------------------------------------
    def _fail(self, why: str) -> None:
        """Stop the worker: it cannot carry on (`why` is one line)."""
        why = " ".join(why.split())
        with self._failing_lock:
            if self.failed:
                return
            self.failed, self.failure = True, why
        log.error("worker %s stopping: %s", self.config.worker_id, why)
        self.stop()

    def _failed(self, what: str, last: str) -> None:
        """One more unexpected failure of `what` ("claims" or "batches")."""
        with self._failing_lock:
            self._streaks[what] += 1
            streak = self._streaks[what]
        if streak == self.config.max_failures:  # once, whichever slot gets there
            self._fail(f"{streak} {what} in a row failed with no success in between (last: {last})")

    def _succeeded(self, what: str) -> None:
        with self._failing_lock:
            self._streaks[what] = 0

    # -- one slot ------------------------------------------------------
    def _slot_thread(self, slot: int) -> None:
        try:
            self._slot(slot)
        except BaseException as exc:  # _slot contains Exception; this is the backstop
            log.critical("slot %d died", slot, exc_info=True)
            self._fail(f"slot {slot} died: {_describe(exc)}")

    def _slot(self, slot: int) -> None:
        claim_errors = 0
        batch_failures = 0
        while not self.stopping.is_set():
            seen = self.wakeup.generation
            try:
                batch, token_in = self._claim()
            except Exception as exc:
                claim_errors += 1
                if not self._claim_failed(exc, claim_errors):
                    return
                continue
            claim_errors = 0
            self._succeeded("claims")
            if batch is None:
                # a rate-limited tenant passed over gets a token soon: wait
                # that long, not a whole poll (and --once waits for it too)
                if self.config.once and token_in is None:
                    return
                self.wakeup.wait(seen, min(self.config.poll_seconds, token_in or self.config.poll_seconds))
                continue
            try:
                failure = self._run_batch(batch, lent=is_lent(slot, batch.priority, self.reserved))
            except Exception as exc:  # outside the batch's own containment: a bug
                log.exception("batch %d: unexpected error; its lease will expire", batch.batch_id)
                self.leases.remove(batch.batch_id)
                failure = _describe(exc)
            if failure is None:
                batch_failures = 0
                self._succeeded("batches")
                continue
            # its jobs are failed or released; do not spin on them
            batch_failures += 1
            self._failed("batches", f"batch {batch.batch_id}: {failure}")
            streak = self.presence.failures
            if self.config.once and streak >= ONCE_EXECUTOR_FAILURES:
                self._fail(f"the executor failed {streak} batches in a row (last: {failure})")
                return
            self.stopping.wait(min(self.config.failure_backoff_seconds * 2**batch_failures, 30.0))

    def _claim_failed(self, exc: Exception, failures: int) -> bool:
        """A claim raised: back off and say whether the slot carries on.
        Connection errors (Postgres restarting) are retried for as long as
        it takes; anything else counts towards `max_failures`."""
        what = _describe(exc)
        if self.config.once and failures >= ONCE_CLAIM_ATTEMPTS:
            # a cron drain must end: give up and say so (non-zero exit)
            self._fail(f"the worker could not claim jobs: {failures} claims in a row failed (last: {what})")
            return False
        delay = min(0.2 * 2**failures, 5.0)
        if is_transient(exc):
            log.warning("claim failed (%s); retrying in %.1fs", what, delay)
        else:
            log.error("claim failed unexpectedly (%s); retrying in %.1fs", what, delay,
                      exc_info=not isinstance(exc, psycopg.Error))
            self._failed("claims", what)
        self.stopping.wait(delay)
        return True

    def _claim(self) -> tuple[Batch | None, float | None]:
        """The next batch; else None and how soon a rate-limited tenant
        passed over gets a token (None: none was passed over)."""
        assert self._pool is not None
        notes = PickNotes()
        cfg = self.config
        kinds = None if self.kinds is None else tuple(sorted(self.kinds))
        request = ClaimRequest(worker_id=cfg.worker_id, driver=self.executor.name,
                               batch_size=cfg.batch_size, lease_seconds=cfg.lease_seconds,
                               fair_by=cfg.fair_by, quantum_seconds=cfg.quantum_seconds, kinds=kinds)
        with self._pool.connection() as conn:
            # folds the wakes too: the picks below need not
            with_work = wakes.classes_with_work(conn, kinds=None if kinds is None else list(kinds))
            if "interactive" not in with_work:
                self.interactive_waiting.clear()
            for priority in class_order():
                if priority not in with_work:
                    continue
                batch = claim_next(conn, request, priority, notes=notes, abandon=self.stopping.is_set,
                                   fold=False)
                metrics.PICK_LOCK_WAIT.labels(priority).observe(notes.lock_wait)
                metrics.PICK_LOCK_HELD.labels(priority).observe(notes.lock_held)
                if batch is not None:
                    metrics.sampled(metrics.JOB_WAIT, priority).observe_many(
                        [job.waited for job in batch.jobs], metrics.job_exemplars(batch.jobs))
                    self.leases.add(batch.batch_id)  # heartbeated from now on: nothing may raise after
                    return batch, None
                if priority == "interactive":
                    self.interactive_waiting.clear()
        return None, notes.next_token_in

    def _should_stop(self, batch: Batch, lent: bool) -> bool:
        if self.stopping.is_set() or self.leases.is_lost(batch.batch_id):
            return True
        if lent and self.interactive_waiting.is_set():
            self.stats.add(recalled=1)
            return True
        return False

    def _settling(self) -> SettleContext:
        assert self._pool is not None, "batches run only while the worker runs"
        return SettleContext(config=self.config, pool=self._pool, cancels=self.cancels, stats=self.stats,
                             alerts=self.alerts)

    def _run_batch(self, batch: Batch, *, lent: bool = False) -> str | None:
        """Run and settle one batch. Returns None, or what went wrong when it
        could not run normally (the executor or the bookkeeping raised, or
        the executor started nothing): the job it was running is failed with
        the reason (none had started: the batch's first job, attempt
        counted), the rest released."""
        run = BatchRun(self._settling(), batch)
        self.stats.add(batches=1)
        failure: str | None = None
        executor_error: str | None = None
        before_any_job = False
        stopped = _Seen(lambda: self._should_stop(batch, lent))
        try:
            run.fail_undecodable()
            runnable = run.runnable()
            if runnable.jobs:
                self.executor.run(runnable, env=self.secrets(batch.tenant_id), report=run.report,
                                  should_stop=stopped)
                if not run.started_runnable() and not stopped.seen:
                    failure = executor_error = "the executor returned without starting any job of its batch"
                    log.error("batch %d: %s; releasing its jobs", batch.batch_id, failure)
        except BaseException as exc:  # even SystemExit from a handler: a batch never ends a slot
            failure, executor_error = _describe(exc), describe_exception(exc)
            log.error("batch %d failed: %s; failing its running (or first) job, releasing the rest",
                      batch.batch_id, failure, exc_info=True)
            before_any_job = not run.started_runnable()
        try:
            if before_any_job:
                # a warmup or a sandbox that failed before any job started:
                # the first job carries the error and its attempt, so a broken
                # executor fails jobs (with backoff, up to dead) instead of
                # releasing them into a loop
                run.fail_first(f"executor error before the batch's first job started: {executor_error}")
            if failure is not None:
                run.fail_running(f"executor error: the batch's runner failed ({failure})")
            run.finish("ok" if failure is None else "failed")
        except Exception as exc:
            log.exception("settling batch %d failed; failing and releasing its jobs", batch.batch_id)
            failure = failure or f"settling failed: {_describe(exc)}"
            run.abandon(f"the worker could not settle this batch: {_describe(exc)}")
        finally:
            self.leases.remove(batch.batch_id)
        assert self._pool is not None
        if executor_error is not None:
            self._last_executor_error = failure or executor_error
            self.presence.executor_failed(self._pool, executor_error)
        elif run.started_runnable():
            self.presence.executor_ok(self._pool)
        if self.executor.name == "inline" or failure is not None:
            # sandboxed executors count their own outcomes, by how the sandbox ended
            metrics.BATCH_OUTCOMES.labels(self.executor.name, "ok" if failure is None else "failed").inc()
        return failure


class _Seen:
    """should_stop() for the executor, remembering whether it ever said stop."""

    def __init__(self, should_stop: Callable[[], bool]) -> None:
        self.should_stop = should_stop
        self.seen = False

    def __call__(self) -> bool:
        if self.should_stop():
            self.seen = True
        return self.seen


def _describe(exc: BaseException) -> str:
    """`Type: first line of the message`, for logs and one-line reasons."""
    if not str(exc).strip():
        return type(exc).__name__
    return f"{type(exc).__name__}: {first_line(exc)}"[:300]

