"""One batch on one guest runner, paced by the host one job at a time.

The host sends the batch command and the secrets, waits for `batch_ready`,
then hands out job k, waits for the one `job_end` of job k (bounded by the
handler's timeout plus grace, measured by the host), reports it, and only
then hands out job k+1; finally `end`, and the warm parent's `batch_end`.
So the job running when a sandbox dies is the one the host handed out
(rule H2: the host's own bookkeeping), jobs never handed out go back
without an attempt, run times are the host's clock (rule H4), and a guest
that stops talking is killed at the host's deadline (rule H5).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tenantq.dispatch.executors import records
from tenantq.dispatch.executors.contract import JobEnded, JobStarted, Report
from tenantq.dispatch.executors.records import ProtocolViolation
from tenantq.domain.records import Batch, ClaimedJob
from tenantq.guest.protocol import FrameError
from tenantq.registry import Registry
from tenantq.sandbox.channel import ChannelTimeout, GuestGone
from tenantq.sandbox.hostside import MAX_STDERR_BYTES
from tenantq.sandbox.spec import End, ProcessResult

log = logging.getLogger("tenantq.sandbox")

# how long past a handler's timeout the host waits for the guest's own
# enforcement (the job's timer, then the supervisor's kill) before it kills
# the sandbox
HOST_TIMEOUT_GRACE_SECONDS = 3.0
# a cold boot or restore must say ready / batch_ready within this long
BOOT_SECONDS = 120.0
# job errors after which the sandbox is not reused
TAINTING_REASONS = ("timeout", "oom", "crashed")
DEFAULT_TIMEOUT = 60.0


@dataclass
class SessionEnd:
    end: End
    result: ProcessResult | None  # set when the sandbox's process ended
    fatal: str | None = None   # the runner could not boot (app import, warmup)
    handed_out: int = 0        # jobs sent to the guest
    clean: bool = False        # the guest's batch_end arrived: reusable if ok
    tainted: bool = False


class BatchEnded(Exception):
    """The warm parent reported the batch's end while a job was in flight."""

    def __init__(self, end: End) -> None:
        super().__init__(end.reason())
        self.end = end


class BatchSession:
    def __init__(self, server: object, registry: Registry, report: Report, job_uid: int | None) -> None:
        from tenantq.dispatch.executors.warm import GuestServer

        assert isinstance(server, GuestServer)
        self.server = server
        self.channel = server.running.channel
        self.registry = registry
        self.report = report
        self.job_uid = job_uid
        self.current: int | None = None  # the job handed out and not yet ended
        self._t0 = 0.0
        self._ttl = 0.0
        # cancel requests (dispatch/cancels.py), from another thread: the
        # job in flight is stopped by its supervisor; one not yet handed
        # out is never handed out
        self._cancel_lock = threading.Lock()
        self._seq = -1
        self._skip: set[int] = set()
        # called with its id as each job ends (its processes are gone: rule
        # C2): cuts the host-function connections it made and returns its
        # calls for its attempt's record (host_calls.py)
        self.on_job_end: Callable[[int], dict[str, Any] | None] | None = None

    def cancel(self, job_id: int) -> None:
        """Stop a job of this batch: the one in flight gets a `cancel` frame
        (its supervisor kills its process and reports its end); a later one
        is skipped. What the job then reports ends it `cancelled` on the
        host's say (settle.py), never the guest's."""
        # Lock order: the cancel lock, then the channel's send lock (as in
        # _run_job). Sent under the cancel lock, which _end() takes to clear the job in
        # flight: a cancel frame is in the pipe before that job's end is
        # handled, so never after the batch's `end` (the warm parent between
        # batches takes only a `batch` command).
        with self._cancel_lock:
            if job_id != self.current:
                self._skip.add(job_id)
                return
            # if the channel fails, the sandbox is going anyway: the job ends with it
            with contextlib.suppress(ChannelTimeout, GuestGone):
                self.channel.send({"op": "cancel", "seq": self._seq}, time.monotonic() + 1.0)

    def running_now(self) -> int | None:
        """The job in flight (read by the egress proxy's thread)."""
        return self.current

    def _timeout(self, job: ClaimedJob) -> float:
        handler = self.registry.get(job.kind)
        return handler.timeout if handler is not None else DEFAULT_TIMEOUT

    def run(self, batch: Batch, secrets: Mapping[str, str], ttl: float, budget: float,
            should_stop: Callable[[], bool]) -> SessionEnd:
        out = SessionEnd(End("ok", exit_code=0), None)
        self._ttl = ttl
        started = time.monotonic()
        deadline = started + budget
        seq = -1
        job: ClaimedJob | None = None
        try:
            if self.server.needs_ready:
                fatal = records.boot(self.channel.receive(started + BOOT_SECONDS))
                self.server.needs_ready = False
                if fatal is not None:
                    out.fatal = fatal
                    return self._ended(out, "the runner could not boot")
            command = {"op": "batch", "ttl": ttl, "tenant": batch.tenant_id, "job_uid": self.job_uid}
            self.channel.send(command, started + BOOT_SECONDS)
            self.channel.send(dict(secrets), started + BOOT_SECONDS)
            records.batch_ready(self.channel.receive(started + BOOT_SECONDS))
            for seq, job in enumerate(batch.jobs):
                if should_stop():
                    break
                self._run_job(seq, job, deadline, out)
                job = None
            self.channel.send({"op": "end"}, deadline)
            out.end = records.batch_end(self.channel.receive(deadline), ttl)
            out.clean = True
            return out
        except ChannelTimeout as exc:
            if job is not None and self.current is not None:
                detail = f"after {self._timeout(job):g} s"
            else:
                detail = f"after {budget:g} s (batch budget)"
            out.result = self.server.running.stop(detail)
            out.end = out.result.end
            log.info("sandbox %s killed: %s", self.server.sandbox.id, exc)
        except GuestGone:
            running = self.server.running
            out.result = running.wait(10) or running.stop("after it closed its channel")
            out.end = out.result.end
        except BatchEnded as exc:
            out.end = exc.end if not exc.end.ok else End("crashed", detail="the batch ended mid-job")
        except (FrameError, ProtocolViolation) as exc:
            out.result = self.server.running.stop("for a protocol violation")
            out.end = End("crashed", exit_code=out.result.exit_code, detail=f"protocol violation: {exc}")
        out.tainted = True
        if self.current is not None:
            reason = out.end.reason() if not out.end.ok else "the sandbox ended while the job was running"
            self._end(JobEnded(self.current, ok=False, error=reason), out)
        return out

    def _run_job(self, seq: int, job: ClaimedJob, deadline: float, out: SessionEnd) -> None:
        self.report(JobStarted(job.id))
        self._t0 = time.monotonic()
        job_deadline = min(deadline, self._t0 + self._timeout(job) + HOST_TIMEOUT_GRACE_SECONDS)
        # Handed out under the cancel lock: a cancel() before this sees the
        # job not in flight and skips it; one after sends its frame after
        # the job's, never before it (the supervisor drops a cancel between jobs).
        with self._cancel_lock:
            if job.id in self._skip:
                self.report(JobEnded(job.id, ok=False, error="cancelled before it started"))
                return
            self.current, self._seq = job.id, seq
            out.handed_out += 1
            self.channel.send({"op": "job", "seq": seq, "job": {
                "id": job.id, "kind": job.kind, "payload": job.payload, "attempt": job.attempt,
                "max_attempts": job.max_attempts, "actor": job.actor, "meta": job.meta}}, job_deadline)
        record = self.channel.receive(job_deadline)
        if record.get("status") == "batch_end":
            # the supervisor died mid-job (the warm parent says how): the
            # batch is over, and this job is charged
            raise BatchEnded(records.batch_end(record, self._ttl))
        outcome = records.job_end(record, seq)
        if outcome.reason in TAINTING_REASONS:
            out.tainted = True
        error = outcome.error
        if error.startswith("killed by signal 9") and self.server.sandbox.oom_killed():
            # the kernel's OOM killer (process driver): the host's cgroup says so
            error = f"oom: exceeded {self.server.sandbox.spec.memory_mb} MiB (the sandbox's memory limit)"
        if outcome.ok:
            self._end(JobEnded(job.id, ok=True, result=outcome.result), out)
        else:
            self._end(JobEnded(job.id, ok=False, error=error), out)
        if self.server.running.stderr_size() > MAX_STDERR_BYTES:
            raise ProtocolViolation(f"the runner wrote more than {MAX_STDERR_BYTES} bytes to stderr")

    def _end(self, event: JobEnded, out: SessionEnd) -> None:
        # the host's clock, never the guest's (rule H4)
        seconds = max(0.0, time.monotonic() - self._t0)
        with self._cancel_lock:
            self.current = None
        calls = self.on_job_end(event.job_id) if self.on_job_end is not None else None
        self.report(JobEnded(event.job_id, ok=event.ok, result=event.result, error=event.error,
                             retryable=event.retryable, seconds=seconds, host_calls=calls))

    def _ended(self, out: SessionEnd, detail: str) -> SessionEnd:
        result = self.server.running.wait(10) or self.server.running.stop(detail)
        out.result = result
        out.end = result.end
        out.tainted = True
        return out
