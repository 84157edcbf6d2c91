"""`tenantq worker`: slots that lease batches, run them, and settle them.

Each of `concurrency` slot threads loops: pick a batch (interactive first,
then default, then bulk), run it on the executor, settle results as they
come (flushed at most every `flush_seconds` and at the end). A maintenance
thread heartbeats the leases and reaps expired ones; a listener thread turns
NOTIFY into wake-ups.

Stopping is graceful: a slot finishes the job it is running, releases the
batch's unstarted jobs (attempts refunded) and ends its lease.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import psycopg

from tenantq.dispatch.maintenance import LeaseBook, Maintenance
from tenantq.dispatch.outcome import Backoff, failed, succeeded, unstorable
from tenantq.dispatch.wakeup import Listener, Wakeup
from tenantq.errors import LeaseLost
from tenantq.fairness import ClaimRequest, claim_next
from tenantq.fairness.drr import Mode
from tenantq.fairness.slots import DEFAULT_INTERACTIVE_SHARE, class_order, is_lent, reserved_slots
from tenantq.observe import metrics
from tenantq.observe.alerts import DeadJob, DeadLetterAlerts
from tenantq.sandbox.executor import BatchExecutor, EgressUsed, JobEnded, JobStarted
from tenantq.store import jobs
from tenantq.store.db import Database, Pool
from tenantq.store.model import Batch, ClaimedJob, Settlement
from tenantq.store.queries import sql

log = logging.getLogger("tenantq.worker")
OUTCOME_LABEL = {"done": "done", "pending": "retry", "dead": "dead"}
ONCE_CLAIM_ATTEMPTS = 5


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class WorkerConfig:
    concurrency: int = 4
    batch_size: int = 10
    lease_seconds: float = 30.0
    poll_seconds: float = 1.0
    flush_seconds: float = 1.0
    once: bool = False
    backoff: Backoff = field(default_factory=Backoff)
    fair_by: Mode = Mode.JOBS
    quantum_seconds: float = 1.0
    interactive_share: float = DEFAULT_INTERACTIVE_SHARE
    worker_id: str = field(default_factory=default_worker_id)


@dataclass
class WorkerStats:
    batches: int = 0
    done: int = 0
    retried: int = 0
    dead: int = 0
    released: int = 0
    refused: int = 0
    reaped: int = 0
    recalled: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


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
        self.failed = False
        # set when interactive work is runnable: recalls lent reserved slots
        self.interactive_waiting = threading.Event()
        self.reserved = reserved_slots(self.config.concurrency, self.config.interactive_share)
        self._pool: Pool | None = None

    # -- lifecycle -----------------------------------------------------
    def run(self) -> WorkerStats:
        """Run until stop() (or, with once=True, until nothing is runnable)."""
        cfg = self.config
        self._pool = self.db.pool(min_size=1, max_size=cfg.concurrency + 2, name=cfg.worker_id, check=False)
        listener = Listener(self.db, self.wakeup, self.stopping,
                            on_interactive=self.interactive_waiting.set)
        maintenance = Maintenance(self._pool, self.leases, lease_seconds=cfg.lease_seconds,
                                  stopping=self.stopping,
                                  on_reaped=self._reaped,
                                  on_interactive=self.interactive_waiting.set,
                                  reap_sandboxes=_driver_reaper(self.executor))
        slots = [threading.Thread(target=self._slot, args=(i,), name=f"tenantq-slot-{i}", daemon=True)
                 for i in range(cfg.concurrency)]
        try:
            # reap before the first claim, so a restarted fleet picks up the
            # jobs of a dead worker without waiting one tick
            if self.alerts.enabled:
                self.alerts.start()
            maintenance.tick()
            if not cfg.once:
                listener.start()
                # wake-ups only work once LISTEN is in place; without it the
                # poll interval still applies, so do not wait forever
                listener.listening.wait(timeout=5)
            maintenance.start()
            for slot in slots:
                slot.start()
            self.started.set()
            log.info("worker %s started: executor=%s concurrency=%d batch_size=%d",
                     cfg.worker_id, self.executor.name, cfg.concurrency, cfg.batch_size)
            for slot in slots:
                while slot.is_alive():
                    slot.join(timeout=0.5)
        finally:
            self.stopping.set()
            self.wakeup.fire()
            if maintenance.is_alive():
                maintenance.join()
            if listener.is_alive():
                listener.join()
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

    def stop(self) -> None:
        """Graceful stop: finish running jobs, release the rest, end leases."""
        self.stopping.set()
        self.wakeup.fire()

    # -- one slot ------------------------------------------------------
    def _slot(self, slot: int) -> None:
        failures = 0
        executor_failures = 0
        while not self.stopping.is_set():
            seen = self.wakeup.generation
            try:
                batch = self._claim()
                failures = 0
            except psycopg.Error as exc:
                failures += 1
                if self.config.once and failures >= ONCE_CLAIM_ATTEMPTS:
                    # a cron drain must end: give up and say so (non-zero exit)
                    log.error("claim failed %d times (%s); giving up", failures, str(exc).strip()[:200])
                    self.failed = True
                    self.stop()
                    return
                delay = min(0.2 * 2**failures, 5.0)
                log.warning("claim failed (%s); retrying in %.1fs", str(exc).strip()[:200], delay)
                self.stopping.wait(delay)
                continue
            if batch is None:
                if self.config.once:
                    return
                self.wakeup.wait(seen, self.config.poll_seconds)
                continue
            if self._run_batch(batch, lent=is_lent(slot, batch.priority, self.reserved)):
                executor_failures = 0
            else:
                # the executor itself failed (a sandbox that cannot start):
                # its unstarted jobs went back; do not spin on them
                executor_failures += 1
                self.stopping.wait(min(0.5 * 2**executor_failures, 30.0))

    def _claim(self) -> Batch | None:
        assert self._pool is not None
        cfg = self.config
        request = ClaimRequest(worker_id=cfg.worker_id, driver=self.executor.name,
                               batch_size=cfg.batch_size, lease_seconds=cfg.lease_seconds,
                               fair_by=cfg.fair_by, quantum_seconds=cfg.quantum_seconds)
        with self._pool.connection() as conn:
            rows = conn.execute(sql("queues", "classes_with_work"), {"now": None}).fetchall()
            with_work = {str(r["priority"]) for r in rows}
            if "interactive" not in with_work:
                self.interactive_waiting.clear()
            for priority in class_order():
                if priority not in with_work:
                    continue
                batch = claim_next(conn, request, priority)
                if batch is not None:
                    self.leases.add(batch.batch_id)
                    waits = metrics.JOB_WAIT.labels(priority)
                    for job in batch.jobs:
                        waits.observe(job.waited)
                    return batch
                if priority == "interactive":
                    self.interactive_waiting.clear()
        return None

    def _should_stop(self, batch: Batch, lent: bool) -> bool:
        if self.stopping.is_set() or self.leases.is_lost(batch.batch_id):
            return True
        if lent and self.interactive_waiting.is_set():
            self.stats.add(recalled=1)
            return True
        return False

    def _run_batch(self, batch: Batch, *, lent: bool = False) -> bool:
        """Run and settle one batch; False when the executor itself failed."""
        run = BatchRun(self, batch)
        self.stats.add(batches=1)
        outcome = "failed"
        try:
            self.executor.run(
                batch,
                env=self.secrets(batch.tenant_id),
                report=run.report,
                should_stop=lambda: self._should_stop(batch, lent),
            )
            outcome = "ok"
        except Exception:
            log.exception("executor failed on batch %d", batch.batch_id)
            run.fail_running("executor error: the batch's runner failed")
            outcome = "failed"
        finally:
            run.finish(outcome)
            self.leases.remove(batch.batch_id)
        if self.executor.name == "inline" or outcome == "failed":
            # sandboxed executors count their own outcomes, by how the sandbox ended
            metrics.BATCH_OUTCOMES.labels(self.executor.name, outcome).inc()
        return outcome == "ok"


class BatchRun:
    """Settlement bookkeeping for one batch: what started, what ended, what
    is waiting to be written."""

    def __init__(self, worker: Worker, batch: Batch) -> None:
        self.worker = worker
        self.batch = batch
        self.jobs: dict[int, ClaimedJob] = {job.id: job for job in batch.jobs}
        self.started: set[int] = set()
        self.ended: set[int] = set()
        self.pending: list[Settlement] = []
        self.last_flush = time.monotonic()
        self.lost = False
        self.run_seconds = 0.0
        self._job_started_at = 0.0
        self._run_histogram = metrics.JOB_RUN.labels(batch.priority)
        self.egress: EgressUsed | None = None

    def report(self, event: JobStarted | JobEnded | EgressUsed) -> None:
        if isinstance(event, EgressUsed):
            self.egress = event  # written with the end of the batch
            return
        if isinstance(event, JobStarted):
            self.started.add(event.job_id)
            self._job_started_at = time.monotonic()
            return
        job = self.jobs[event.job_id]
        self.ended.add(event.job_id)
        seconds = event.seconds if event.seconds is not None else time.monotonic() - self._job_started_at
        self.run_seconds += seconds
        self._run_histogram.observe(seconds)
        backoff = self.worker.config.backoff
        if event.ok:
            self.pending.append(succeeded(job, event.result, backoff=backoff))
        else:
            self.pending.append(failed(job, event.error or "failed", backoff=backoff,
                                       retryable=event.retryable))
        if time.monotonic() - self.last_flush >= self.worker.config.flush_seconds:
            self._write(end_outcome=None, release=())

    def fail_running(self, error: str) -> None:
        for job_id in sorted(self.started - self.ended):
            self.report(JobEnded(job_id, ok=False, error=error))

    def finish(self, outcome: str) -> None:
        unstarted = [job_id for job_id in self.jobs if job_id not in self.started]
        # a job that started and never reported an end (the runner died on it)
        self.fail_running("the runner stopped before the job ended")
        if unstarted and outcome == "ok":
            outcome = "released"
        self._write(end_outcome=outcome, release=unstarted)

    def _write(self, *, end_outcome: str | None, release: list[int] | tuple[()]) -> None:
        if self.lost:
            return
        settlements, self.pending = self.pending, []
        self.last_flush = time.monotonic()
        pool = self.worker._pool
        assert pool is not None
        deadline = self.batch.lease_expires_at.timestamp() + self.worker.config.lease_seconds
        attempt = 0
        while True:
            try:
                with pool.connection() as conn:
                    egress = self.egress if end_outcome is not None else None
                    applied = jobs.settle(conn, self.batch.batch_id, settlements, release=release,
                                end_outcome=end_outcome, run_seconds=self.run_seconds,
                                ran_jobs=len(self.ended),
                                charge_runtime=self.worker.config.fair_by is Mode.RUNTIME,
                                egress=None if egress is None else (egress.record, egress.blocks))
                break
            except LeaseLost as exc:
                self.lost = True
                self.worker.stats.add(refused=len(settlements))
                log.warning("%s", exc)
                return
            except psycopg.errors.DataError as exc:
                # not transient: some result or error cannot be stored. Keep
                # the batch's other outcomes; the offending ones become
                # failed attempts that say why.
                if attempt > 0:
                    log.error("cannot settle batch %d: %s", self.batch.batch_id, exc)
                    self.lost = True
                    return
                attempt += 1
                settlements = [unstorable(self.jobs[s.job_id], s, str(exc), self.worker.config.backoff)
                               for s in settlements]
            except psycopg.Error as exc:
                # Postgres restarting: keep trying while the lease could still
                # be live; after that the reaper owns these jobs.
                attempt += 1
                if time.time() > deadline:
                    log.error("giving up settling batch %d: %s", self.batch.batch_id, exc)
                    self.lost = True
                    return
                time.sleep(min(0.1 * 2**attempt, 2.0))
        applied_ids = set(applied)
        settled = [s for s in settlements if s.job_id in applied_ids]
        stats = self.worker.stats
        stats.add(
            done=sum(s.status == "done" for s in settled),
            retried=sum(s.status == "pending" for s in settled),
            dead=sum(s.status == "dead" for s in settled),
            released=len(release),
        )
        priority = self.batch.priority
        for status, label in OUTCOME_LABEL.items():
            count = sum(s.status == status for s in settled)
            if count:
                metrics.JOB_OUTCOMES.labels(priority, label).inc(count)
        for s in settled:
            if s.status == "dead":
                metrics.DEAD_LETTERED.labels(priority).inc()
                job = self.jobs[s.job_id]
                self.worker.alerts.fire(DeadJob(job.id, job.tenant_id, job.kind, job.attempt, s.error or ""))


def _driver_reaper(executor: BatchExecutor) -> Callable[[], list[str]] | None:
    """A sandboxed executor reaps sandboxes past their TTL (and old snapshots)."""
    reap = getattr(executor, "reap", None)
    if not callable(reap):
        reap = getattr(getattr(executor, "driver", None), "reap", None)
    return reap if callable(reap) else None
