"""Run handlers in the dispatcher's own process: fast, and only for code the
operator trusts (a crash or OOM here takes the dispatcher with it, and a
handler's timeout cannot be enforced on a thread)."""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from tenantq.dispatch.executors.contract import HostCallsUsed, JobEnded, JobStarted, Report
from tenantq.domain.records import Batch, ClaimedJob
from tenantq.host_functions import Caller, CallGate, limits_from_settings
from tenantq.registry import Cancellation, JobContext, Registry

if TYPE_CHECKING:
    from tenantq.tenant_data import AppDatabase

TRACEBACK_LINES = 12


class WarmupFailed(RuntimeError):
    """A warmup of the batch's kinds raised (the cause is chained)."""


class InlineExecutor:
    name = "inline"

    def __init__(self, registry: Registry, *, app_db: AppDatabase | None = None) -> None:
        self.registry = registry
        # ctx.db(): the application's database, tenant-scoped (tenant_data.py)
        self.app_db = app_db
        # ctx.call's bounds per batch, inline and sandboxed (TENANTQ_HOST_CALL*)
        self.call_limits = limits_from_settings()
        self._warmed: set[str] = set()
        self._warm_lock = threading.Lock()
        # cancel requests (dispatch/cancels.py): the running jobs' flags,
        # and jobs asked to stop before they started
        self._cancel_lock = threading.Lock()
        self._running: dict[int, Cancellation] = {}
        self._cancelled: set[int] = set()

    def cancel(self, job_id: int) -> None:
        """Tell a running handler through `ctx.cancelled`; a job that has not
        started does not start."""
        with self._cancel_lock:
            flag = self._running.get(job_id)
            if flag is None:
                self._cancelled.add(job_id)
        if flag is not None:
            flag.set()

    def forget(self, job_ids: Iterable[int]) -> None:
        """Drop cancel requests for jobs that will not run here."""
        with self._cancel_lock:
            self._cancelled.difference_update(job_ids)

    def kinds(self) -> list[str]:
        """The kinds this executor can run (the worker claims only these):
        every registered kind except those that run only in a sandbox (the
        built-in tenantq.python among them)."""
        runnable = []
        for kind in self.registry.kinds():
            handler = self.registry.get(kind)
            if handler is not None and not handler.sandbox_only:
                runnable.append(kind)
        return runnable

    def _warm_up(self, kinds: list[str]) -> None:
        """Run the warmups of these kinds once in this process, before their
        first job. A warmup that raises fails the batch before any job
        started: the dispatcher fails its first job with this error."""
        with self._warm_lock:
            for name in self.registry.warmups(kinds):
                if name not in self._warmed:
                    try:
                        self.registry.resolve_warmup(name)()
                    except Exception as exc:
                        raise WarmupFailed(f"warmup {name!r} failed: {type(exc).__name__}: {exc}") from exc
                    self._warmed.add(name)

    def run(
        self,
        batch: Batch,
        *,
        env: Mapping[str, str],
        report: Report,
        should_stop: Callable[[], bool],
    ) -> None:
        try:
            self._run_jobs(batch, env=env, report=report, should_stop=should_stop)
        finally:
            self.forget(j.id for j in batch.jobs)  # requests for this batch's jobs are spent

    def _run_jobs(self, batch: Batch, *, env: Mapping[str, str], report: Report,
                  should_stop: Callable[[], bool]) -> None:
        self._warm_up(sorted({j.kind for j in batch.jobs}))
        running: list[ClaimedJob] = []
        gate = CallGate(self.registry, batch.tenant_id,
                        lambda: Caller(running[0].id, running[0].kind, running[0].actor) if running else None,
                        database=self.app_db, limits=self.call_limits, allowed=batch.host_functions)
        try:
            self._each_job(batch, gate, running, env=env, report=report, should_stop=should_stop)
        finally:
            gate.close()
            if (record := gate.batch_record()) is not None:
                report(HostCallsUsed(record))

    def _each_job(self, batch: Batch, gate: CallGate, running: list[ClaimedJob], *, env: Mapping[str, str],
                  report: Report, should_stop: Callable[[], bool]) -> None:
        for job in batch.jobs:
            if should_stop():
                return
            report(JobStarted(job.id))
            handler = self.registry.get(job.kind)
            if handler is None:
                known = ", ".join(self.registry.kinds()) or "none"
                report(JobEnded(job.id, ok=False,
                                error=f"unknown kind {job.kind!r}: no handler registered (known: {known})"))
                continue
            if handler.sandbox_only:
                report(JobEnded(job.id, ok=False, retryable=False,
                                error=f"kind {job.kind!r} runs only in a sandbox; this worker runs inline "
                                      "(start it with --sandbox auto|gvisor|process)"))
                continue
            flag = Cancellation()
            with self._cancel_lock:
                skip = job.id in self._cancelled
                self._cancelled.discard(job.id)
                if not skip:
                    self._running[job.id] = flag
            if skip:
                report(JobEnded(job.id, ok=False, error="cancelled before it started"))
                continue
            ctx = JobContext(tenant=batch.tenant_id, job_id=job.id, attempt=job.attempt,
                             kind=job.kind, max_attempts=job.max_attempts, env=dict(env),
                             actor=job.actor, meta=dict(job.meta or {}), cancelled=flag,
                             database=self.app_db,
                             caller=gate.inline_caller() if handler.host_functions else None)
            running[:] = [job]
            try:
                ended = JobEnded(job.id, ok=True, result=handler.call(job.payload, ctx))
            except Exception as exc:
                ended = JobEnded(job.id, ok=False, error=describe_exception(exc))
            finally:
                running.clear()  # a call made after the job's end is refused, not counted for it
                with self._cancel_lock:
                    self._running.pop(job.id, None)
            calls = gate.take_job(job.id)
            report(ended if calls is None else replace(ended, host_calls=calls))


def describe_exception(exc: BaseException) -> str:
    """`Type: message` plus the tail of the traceback."""
    head = f"{type(exc).__name__}: {exc}"
    tail = traceback.format_exception(exc)[-TRACEBACK_LINES:]
    return head + "\n" + "".join(tail).rstrip()
