"""Follow the guest's results file while a batch runs, and turn its lines
into the dispatcher's reports (JobStarted / JobEnded) as they appear."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from tenantq.sandbox.executor import JobEnded, JobStarted, Report
from tenantq.sandbox.spec import End, ExecResult

log = logging.getLogger("tenantq.sandbox")
# job errors after which the sandbox is not reused (it may be in a bad state)
TAINTING_REASONS = ("timeout", "oom")


class ResultTail:
    """Follows the guest's results file and turns lines into reports."""

    def __init__(self, path: Path, report: Report, job_ids: list[int]) -> None:
        self.path = path
        self.report = report
        self.job_ids = job_ids
        self.offset = 0
        # end of the last line handled: set after `running`, read before it
        # by running_now() on another thread
        self.handled = 0
        self.buffer = b""
        self.running: int | None = None
        self.fatal: str | None = None
        self.started: set[int] = set()
        self.ended: set[int] = set()
        self.running_since: float = 0.0
        # the guest parent's {"status": "batch_end", ...}: the batch child is gone
        self.batch_end: dict[str, Any] | None = None
        # a job timed out or ran out of memory: do not reuse the sandbox
        self.tainted = False

    def running_now(self) -> int | None:
        """The job running at this instant, for another thread (the egress
        proxy): reads what poll() has not reached yet, without reporting."""
        # `handled` before `running`: poll() sets them in the other order, so
        # lines it handles meanwhile are read again here, never skipped
        offset = self.handled
        running = self.running
        try:
            with open(self.path, "rb") as fh:
                fh.seek(offset)
                chunk = fh.read()
        except FileNotFoundError:
            return running
        for line in chunk.split(b"\n"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record, dict) or record.get("id") not in self.job_ids:
                continue
            running = int(record["id"]) if record.get("status") == "started" else None
        return running

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except FileNotFoundError:
            return
        self.offset += len(chunk)
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            try:
                record = json.loads(line)
                if isinstance(record, dict):
                    self._handle(record)
            except (ValueError, KeyError, TypeError):
                # the file is writable by the job's own code: a line that is
                # not the runner's is ignored, never trusted
                continue
        self.handled = self.offset - len(self.buffer)

    def read_fatal(self, stdout: str) -> None:
        """The runner could not boot (app import or warmup failed): it said
        why on stdout, before any batch."""
        for line in stdout.splitlines():
            if line.startswith('{"status": "fatal"'):
                try:
                    self.fatal = str(json.loads(line)["error"])
                except (ValueError, KeyError):
                    self.fatal = line[:2000]

    def end_from_guest(self) -> End | None:
        """How the batch child ended, as the guest parent reported it."""
        end = self.batch_end
        if end is None:
            return None
        if "timeout" in end:
            return End("timeout", detail=f"after {float(end['timeout']):g} s (batch TTL)")
        if end.get("signal") is not None:
            return End("signal", exit_code=128 + int(end["signal"]), signal=int(end["signal"]))
        code = int(end.get("exit", 0))
        return End("ok", exit_code=0) if code == 0 else End("exit", exit_code=code)

    def _handle(self, record: dict[str, Any]) -> None:
        status = record.get("status")
        if status == "batch_end":
            if "id" not in record:
                self.batch_end = record
            return
        job_id = int(str(record["id"]))
        if status == "started":
            if job_id in self.started or job_id not in self.job_ids:
                return
            self.running = job_id
            self.started.add(job_id)
            self.running_since = time.monotonic()
            self.report(JobStarted(job_id))
            return
        if job_id in self.ended or job_id not in self.job_ids:
            return  # never settle a job twice, nor one of another batch
        self.ended.add(job_id)
        self.running = None
        if record.get("reason") in TAINTING_REASONS:
            self.tainted = True
        seconds = float(str(record.get("seconds", 0.0)))
        if status == "ok":
            self.report(JobEnded(job_id, ok=True, result=record.get("result"), seconds=seconds))
        else:
            self.report(JobEnded(job_id, ok=False, error=str(record.get("error")), seconds=seconds))

    def finish(self, end: End, result: ExecResult | None) -> None:
        """The sandbox is gone: fail the job it died on with the reason."""
        if self.running is not None:
            reason = end.reason() if not end.ok else "the sandbox ended while the job was running"
            self.report(JobEnded(self.running, ok=False, error=reason,
                                 seconds=time.monotonic() - self.running_since))
            self.running = None
        if self.fatal:
            # the app cannot even be imported in the sandbox: every job of
            # the batch fails (and reaches dead after its attempts) instead of
            # being released into a hot loop
            for job_id in self.job_ids:
                if job_id not in self.started:
                    self.report(JobStarted(job_id))
                    self.report(JobEnded(job_id, ok=False, error=self.fatal))
        elif not self.started and not end.ok:
            # the sandbox itself failed before the first job: the jobs are
            # released by the dispatcher without losing an attempt
            log.error("sandbox failed before its first job: %s; stderr: %s", end.reason(),
                      result.stderr[-500:] if result else "")
