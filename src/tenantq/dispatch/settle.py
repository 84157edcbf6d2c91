"""Settlement bookkeeping for one batch: what started, what ended, what is
waiting to be written, and writing it whatever Postgres says.

Nothing an executor reports is trusted beyond bounds: an event for a job of
another batch, or for a job that already ended, is dropped, and a job's run
seconds (`JobEnded.seconds`: None, NaN, infinite, negative, anything) are
clamped to [0, the batch's wall time measured here with time.monotonic()],
as is the batch's total. That total is the DRR cost with fairness by run time.
(docs/security.md, rule H4: a number the host did not measure is never trusted.)

Writing (`_write`) puts the batch's outcomes in one transaction. When it
fails, the error decides what happens (`is_transient`):

- connection-level errors (Postgres restarting, a dropped connection, a pool
  timeout, a serialization failure) are retried while the lease could still
  be live; after that the reaper owns the jobs;
- LeaseLost: the lease is gone and nothing was written;
- anything else (Postgres refused the data: an IntegrityError, DataError,
  ProgrammingError or a program limit; or the driver could not send it) is
  never retried as it is. The jobs are settled one by one, each in its own
  transaction, so the job that cannot be stored fails with "could not be
  stored: <first line of the error>" and every other job keeps its outcome;
  the batch's end follows on its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from tenantq.dispatch.cancels import cancelled_error
from tenantq.dispatch.executors.contract import EgressUsed, Event, HostCallsUsed, JobEnded, JobStarted
from tenantq.dispatch.outcome import failed, first_line, is_transient, last_resort, succeeded, unstorable
from tenantq.domain.records import Batch, ClaimedJob, Settlement
from tenantq.errors import LeaseLost
from tenantq.fairness.drr import Mode, finite_or_none
from tenantq.host_functions import merge_counts
from tenantq.observe import metrics
from tenantq.observe.alerts import DeadJob
from tenantq.store import jobs
from tenantq.store.db import Conn

if TYPE_CHECKING:
    from tenantq.dispatch.cancels import CancelBook
    from tenantq.dispatch.config import WorkerConfig, WorkerStats
    from tenantq.observe.alerts import DeadLetterAlerts
    from tenantq.store.db import Pool

log = logging.getLogger("tenantq.worker")
OUTCOME_LABEL = {"done": "done", "pending": "retry", "dead": "dead", "cancelled": "cancelled"}

class _GaveUp(Exception):
    """Transient errors outlasted the lease: the reaper owns the jobs now."""


@dataclass(frozen=True)
class SettleContext:
    """What a batch's settlement needs of its worker, and nothing more: the
    worker's configuration, its store pool, its book of cancel requests,
    its counters and its dead-letter alerts (one per worker, shared by its
    slots)."""

    config: WorkerConfig
    pool: Pool
    cancels: CancelBook
    stats: WorkerStats
    alerts: DeadLetterAlerts


class BatchRun:
    """Settlement bookkeeping for one batch: what started, what ended, what
    is waiting to be written."""

    def __init__(self, context: SettleContext, batch: Batch) -> None:
        self.context = context
        self.batch = batch
        self.jobs: dict[int, ClaimedJob] = {job.id: job for job in batch.jobs}
        self.undecodable = {job.id for job in batch.jobs if isinstance(job.payload, jobs.UndecodablePayload)}
        self.started: set[int] = set()
        self.ended: set[int] = set()
        self.settled: set[int] = set()
        self.pending: list[Settlement] = []
        self.began = time.monotonic()
        self.last_flush = self.began
        # settlements not written at once (writes are batched, at most one
        # per flush_seconds) are written by a timer: a job that ended is
        # never left running until its next sibling ends. Executor threads,
        # the timer and the slot take this lock.
        self._lock = threading.RLock()
        self._flush_timer: threading.Timer | None = None
        self.lost = False
        self.finished = False
        # a job could not be written at all: the batch is not ended, so its
        # lease expires and the reaper puts that job back
        self.stuck = False
        self.run_seconds = 0.0
        self._started_at: dict[int, float] = {}
        self._run_histogram = metrics.sampled(metrics.JOB_RUN, batch.priority)
        self._run_times: list[tuple[float, ClaimedJob]] = []
        self.egress: EgressUsed | None = None
        self.host_calls: dict[str, Any] | None = None

    # -- what the executor reports ---------------------------------------
    def wall_seconds(self) -> float:
        """Host time since the batch started: the bound on any run time."""
        return max(0.0, time.monotonic() - self.began)

    def runnable(self) -> Batch:
        """The batch as the executor gets it: without undecodable payloads."""
        if not self.undecodable:
            return self.batch
        return replace(self.batch, jobs=tuple(j for j in self.batch.jobs if j.id not in self.undecodable))

    def fail_undecodable(self) -> None:
        """Jobs whose payload cannot be decoded fail at once, as dead: they
        would fail the same way on every attempt."""
        for job in self.batch.jobs:
            if isinstance(job.payload, jobs.UndecodablePayload):
                self.report(JobStarted(job.id))
                self.report(JobEnded(job.id, ok=False, error=job.payload.reason, retryable=False,
                                     seconds=0.0))
        if self.pending:
            self._write(end_outcome=None)

    def report(self, event: Event) -> None:
        with self._lock:
            self._report(event)

    def _report(self, event: Event) -> None:
        if self.finished:
            return  # a late event from an executor's thread: the batch is settled
        if isinstance(event, EgressUsed):
            self.egress = event  # written with the end of the batch
            return
        if isinstance(event, HostCallsUsed):
            # likewise; a batch with inline and sandboxed jobs has a gate for
            # each part, and reports twice: the record is their sum
            self.host_calls = merge_counts(self.host_calls, event.record)
            return
        job_id = event.job_id
        job = self.jobs.get(job_id)
        if job is None or job_id in self.ended:
            log.warning("batch %d: ignoring %s for job %r (%s)", self.batch.batch_id, type(event).__name__,
                        job_id, "not in this batch" if job is None else "already ended")
            return
        if isinstance(event, JobStarted):
            if job_id not in self.started:
                self.started.add(job_id)
                self._started_at[job_id] = time.monotonic()
            return
        self.started.add(job_id)  # an end implies a start
        self.ended.add(job_id)
        seconds = self._seconds(job_id, event.seconds)
        if job_id not in self.undecodable:
            self.run_seconds = min(self.run_seconds + seconds, self.wall_seconds())
        self._run_times.append((seconds, job))  # observed with the next write
        backoff = self.context.config.backoff
        cancelled = self.context.cancels.requested(job_id)
        if cancelled:
            # the host's own record of the request decides, whatever the
            # executor reported (rule H2); the attempt ends `cancelled`
            settlement = Settlement(job_id, "cancelled", error=cancelled_error(event.ok, event.error))
        elif event.ok:
            settlement = succeeded(job, event.result, backoff=backoff)
        else:
            settlement = failed(job, str(event.error or "failed"), backoff=backoff,
                                retryable=event.retryable is not False)
        self.pending.append(settlement if event.host_calls is None
                            else replace(settlement, host_calls=event.host_calls))
        since = time.monotonic() - self.last_flush
        if since >= self.context.config.flush_seconds or cancelled:
            self._write(end_outcome=None)
        elif self._flush_timer is None:
            wait = self.context.config.flush_seconds - since
            self._flush_timer = threading.Timer(wait, self._flush_deferred)
            self._flush_timer.daemon = True
            self._flush_timer.start()

    def _flush_deferred(self) -> None:
        with self._lock:
            self._flush_timer = None
            if self.pending and not self.finished and not self.lost:
                try:
                    self._write(end_outcome=None)
                except Exception:  # the batch's own end writes them, or the reaper
                    log.exception("batch %d: a deferred settle failed", self.batch.batch_id)

    def _seconds(self, job_id: int, reported: object) -> float:
        """A job's run time: what the executor reported if it is a finite
        number, else this host's clock since the job's start; either way
        within [0, the batch's wall time]."""
        now = time.monotonic()
        seconds = finite_or_none(reported)
        if seconds is None:
            seconds = now - self._started_at.get(job_id, now)
        return min(max(seconds, 0.0), self.wall_seconds())

    def fail_running(self, error: str) -> None:
        for job_id in sorted(self.started - self.ended):
            self.report(JobEnded(job_id, ok=False, error=error))

    def started_runnable(self) -> bool:
        """Did any job the executor got start (undecodable ones do not count)?"""
        return bool(self.started - self.undecodable)

    def fail_first(self, error: str) -> None:
        """The executor failed before any job of the batch started (a warmup,
        a sandbox that could not start): the batch's first job fails with
        that error, its attempt counted, so the failure shows on a job and
        ends in dead instead of a release loop; finish() releases the rest."""
        for job in self.batch.jobs:
            if job.id not in self.undecodable and job.id not in self.started:
                self.report(JobStarted(job.id))
                self.report(JobEnded(job.id, ok=False, error=error))
                return

    def finish(self, outcome: str) -> None:
        with self._lock:
            if self._flush_timer is not None:
                self._flush_timer.cancel()
                self._flush_timer = None
            self._finish(outcome)

    def _finish(self, outcome: str) -> None:
        unstarted = [job_id for job_id in self.jobs if job_id not in self.started]
        # a job cancelled before its turn came ends cancelled, not back in the queue
        for job_id in [j for j in unstarted if self.context.cancels.requested(j)]:
            unstarted.remove(job_id)
            self.started.add(job_id)
            self.ended.add(job_id)
            self.pending.append(Settlement(job_id, "cancelled", error="cancelled before it started"))
        self.context.cancels.forget(self.jobs)
        # a job that started and never reported an end (the runner died on it)
        self.fail_running("the runner stopped before the job ended")
        if unstarted and outcome == "ok":
            outcome = "released"
        self._write(end_outcome=outcome, release=unstarted)
        self.finished = True

    def abandon(self, reason: str) -> None:
        """Last resort after an unexpected error in this bookkeeping: fail
        the jobs that started and are not settled, release the others, end
        the lease; one try, no retry (if it fails, the lease expires and the
        reaper puts the jobs back)."""
        with self._lock:
            if self._flush_timer is not None:
                self._flush_timer.cancel()
                self._flush_timer = None
            self._abandon(reason)

    def _abandon(self, reason: str) -> None:
        self.finished = True
        if self.lost:
            return
        self.lost = True
        backoff = self.context.config.backoff
        failing = [failed(self.jobs[i], reason, backoff=backoff) for i in sorted(self.started - self.settled)]
        release = [i for i in self.jobs if i not in self.started]
        try:
            with self._pool().connection() as conn:
                applied = set(jobs.settle(conn, self.batch.batch_id, failing, release=release,
                                          end_outcome="failed"))
        except Exception as exc:
            log.error("batch %d could not be failed and released either (%s); its lease will expire",
                      self.batch.batch_id, first_line(exc))
            return
        self._count([s for s in failing if s.job_id in applied], released=len(release))

    # -- writing ----------------------------------------------------------
    def _pool(self) -> Pool:
        return self.context.pool

    def _end(self, outcome: str | None, release: Sequence[int], *, extras: bool = True) -> dict[str, Any]:
        """jobs.settle's arguments that end the batch (none for a flush).
        Without `extras`: no egress or host-call record and no runtime charge, the end
        that is left when Postgres refused those."""
        if outcome is None:
            return {}
        egress = self.egress if extras else None
        return {
            "release": list(release), "end_outcome": outcome,
            "run_seconds": min(self.run_seconds, self.wall_seconds()),
            "ran_jobs": len(self.ended - self.undecodable),
            "charge_runtime": extras and self.context.config.fair_by is Mode.RUNTIME,
            "egress": None if egress is None else (egress.record, egress.blocks),
            "host_calls": self.host_calls if extras else None,
        }

    def _store(self, settlements: Sequence[Settlement], end: dict[str, Any], conn: Conn) -> list[int]:
        return jobs.settle(conn, self.batch.batch_id, settlements, **end)

    def _retrying(self, op: Callable[[Conn], list[int]]) -> list[int]:
        """Run `op` on a pooled connection; retry transient errors while the
        lease could still be live. Other errors propagate."""
        deadline = time.monotonic() + self.context.config.lease_seconds
        attempt = 0
        while True:
            try:
                with self._pool().connection() as conn:
                    return op(conn)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                attempt += 1
                if time.monotonic() > deadline:
                    log.error("giving up settling batch %d after %d tries: %s", self.batch.batch_id, attempt,
                              first_line(exc))
                    self.lost = True
                    raise _GaveUp from exc
                time.sleep(min(0.1 * 2**attempt, 2.0))

    def _lose(self, exc: LeaseLost, refused_count: int) -> None:
        self.lost = True
        self.context.stats.add(refused=refused_count)
        log.warning("%s", exc)

    def _observe_run_times(self) -> None:
        """The run times of the jobs ended since the last write, in one go
        (SampledExemplars.observe_many)."""
        ended, self._run_times = self._run_times, []
        if ended:
            self._run_histogram.observe_many([seconds for seconds, _ in ended],
                                             metrics.job_exemplars([job for _, job in ended]))

    def _write(self, *, end_outcome: str | None, release: Sequence[int] = ()) -> None:
        self._observe_run_times()
        if self.lost:
            return
        # a cancel that came after the job's end was reported still wins
        # (the host's record, rule H2): no retry, no result
        settlements = [s if s.status == "cancelled" or not self.context.cancels.requested(s.job_id)
                       else Settlement(s.job_id, "cancelled", error="cancelled while running: it had ended",
                                       host_calls=s.host_calls)
                       for s in self.pending]
        self.pending = []
        self.last_flush = time.monotonic()
        try:
            applied = self._retrying(partial(self._store, settlements, self._end(end_outcome, release)))
        except LeaseLost as exc:
            self._lose(exc, len(settlements))
            return
        except _GaveUp:
            return
        except Exception as exc:
            log.warning("batch %d: the settle of %d job(s) was refused (%s: %s); settling them one by one",
                        self.batch.batch_id, len(settlements), type(exc).__name__, first_line(exc))
            self._one_by_one(settlements, end_outcome, release)
            return
        applied_ids = set(applied)
        self._count([s for s in settlements if s.job_id in applied_ids], released=len(release))

    def _one_by_one(self, settlements: Sequence[Settlement], end_outcome: str | None,
                    release: Sequence[int]) -> None:
        for index, settlement in enumerate(settlements):
            try:
                self._settle_alone(settlement)
            except LeaseLost as exc:
                self._lose(exc, len(settlements) - index)
                return
            except _GaveUp:
                return
        if end_outcome is None:
            return
        if self.stuck:
            # the batch is not ended: its lease expires and the reaper puts
            # the stuck job back; the unstarted jobs go back now
            ends = [{"release": list(release)}]
        else:
            # then without the egress and host-call records and the runtime charge
            ends = [self._end(end_outcome, release), self._end(end_outcome, release, extras=False)]
        for end in ends:
            try:
                self._retrying(partial(self._store, [], end))
            except LeaseLost as exc:
                self._lose(exc, 0)
                return
            except _GaveUp:
                return
            except Exception as exc:
                log.warning("batch %d: its end was refused (%s: %s)", self.batch.batch_id,
                            type(exc).__name__, first_line(exc))
                continue
            self._count([], released=len(release))
            return
        log.error("batch %d could not be ended; its lease will expire", self.batch.batch_id)

    def _settle_alone(self, settlement: Settlement) -> None:
        """One job in its own transaction; if Postgres refuses it, the same
        job as a failure that says why, then as a plain failure."""
        job = self.jobs[settlement.job_id]
        backoff = self.context.config.backoff
        candidate = settlement
        for step in range(3):
            try:
                applied = self._retrying(partial(self._store, [candidate], {}))
            except (LeaseLost, _GaveUp):
                raise
            except Exception as exc:
                log.warning("batch %d: job %d could not be stored (%s: %s)", self.batch.batch_id, job.id,
                            type(exc).__name__, first_line(exc))
                candidate = (unstorable(job, settlement, exc, backoff) if step == 0
                             else last_resort(job, settlement, exc, backoff))
                continue
            self._count([candidate] if candidate.job_id in applied else [], released=0)
            return
        log.error("batch %d: job %d could not be settled at all; its lease will expire",
                  self.batch.batch_id, job.id)
        self.stuck = True

    def _count(self, settled: Sequence[Settlement], *, released: int) -> None:
        self.settled.update(s.job_id for s in settled)
        stats = self.context.stats
        stats.add(
            done=sum(s.status == "done" for s in settled),
            retried=sum(s.status == "pending" for s in settled),
            dead=sum(s.status == "dead" for s in settled),
            released=released,
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
                self.context.alerts.fire(DeadJob(job.id, job.tenant_id, job.kind, job.attempt, s.error or ""))
                # the envelope in the record (JSON logs carry it as fields)
                log.warning("job %d (%s, tenant %s, actor %s) is dead after %d attempt(s)", job.id, job.kind,
                            job.tenant_id, job.actor or "-", job.attempt,
                            extra={"job_id": job.id, "tenant": job.tenant_id, "kind": job.kind,
                                   "actor": job.actor, "meta": job.meta})

