"""Run a batch in a disposable sandbox and report each job as it goes.

The host writes the batch into the sandbox's private work dir, starts the
guest runner with the tenant's secrets on its stdin, and tails the runner's
results file while it runs, reporting every start and end at once. When the
sandbox ends, whatever started and never ended is the job the sandbox died
on: it fails with the classified reason (`oom: exceeded 256 MiB`, `timeout
after 5 s`, `crashed: SIGSEGV`, ...). Jobs that never started are left for
the dispatcher to release. The sandbox is destroyed every time.

Kinds whose handler is registered with isolation="inline" run in the
dispatcher process (trusted first-party code: the shared-fleet path); the
rest of the batch goes to the sandbox.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

from tenantq.observe import metrics
from tenantq.registry import Registry
from tenantq.sandbox.driver import GUEST_WORK_DIR, SandboxDriver
from tenantq.sandbox.executor import JobEnded, JobStarted, Report
from tenantq.sandbox.inline import InlineExecutor
from tenantq.sandbox.layout import GuestPython, guest_python
from tenantq.sandbox.spec import End, ExecResult, SandboxSpec
from tenantq.store.model import Batch, ClaimedJob

log = logging.getLogger("tenantq.sandbox")

# Memory for the sandbox beyond its largest handler's limit: the guest
# Python and (for gVisor) the sentry. The handler limit itself is RLIMIT_AS
# inside; this cgroup limit is the backstop.
SANDBOX_OVERHEAD_MB = 192
# Host-side budget beyond the sum of handler timeouts: sandbox start-up.
START_ALLOWANCE_SECONDS = 15.0
POLL_SECONDS = 0.01
# How long past a handler's timeout the host waits for the guest's own timer
# before it kills the sandbox.
HOST_TIMEOUT_GRACE_SECONDS = 2.0


class SandboxExecutor:
    def __init__(self, driver: SandboxDriver, registry: Registry, app_module: str, *,
                 tmp_mb: int = 64, max_pids: int = 512, cpus: float = 1.0) -> None:
        self.driver = driver
        self.name = driver.name
        self.registry = registry
        self.app_module = app_module
        self.guest: GuestPython = guest_python(app_module)
        self.inline = InlineExecutor(registry)
        self.tmp_mb, self.max_pids, self.cpus = tmp_mb, max_pids, cpus
        self.runner_path = str(_runner_path())

    def run(self, batch: Batch, *, env: Mapping[str, str], report: Report,
            should_stop: Callable[[], bool]) -> None:
        trusted = [j for j in batch.jobs if self._isolation(j) == "inline"]
        boxed = [j for j in batch.jobs if self._isolation(j) != "inline"]
        if trusted:
            self.inline.run(replace(batch, jobs=tuple(trusted)), env=env, report=report,
                            should_stop=should_stop)
        if boxed and not should_stop():
            self._run_sandboxed(replace(batch, jobs=tuple(boxed)), env, report, should_stop)

    def _overrun(self, batch: Batch, tail: ResultTail) -> str | None:
        """'after N s' when the running job is past its handler's timeout plus grace."""
        if tail.running is None:
            return None
        kind = next(j.kind for j in batch.jobs if j.id == tail.running)
        handler = self.registry.get(kind)
        limit = handler.timeout if handler is not None else 60.0
        if time.monotonic() - tail.running_since > limit + HOST_TIMEOUT_GRACE_SECONDS:
            return f"after {limit:g} s"
        return None

    def _isolation(self, job: ClaimedJob) -> str:
        handler = self.registry.get(job.kind)
        return handler.isolation if handler is not None else "sandbox"

    def _limits(self, jobs: tuple[ClaimedJob, ...]) -> tuple[int, float]:
        memory = [h.memory_mb for j in jobs if (h := self.registry.get(j.kind))]
        timeouts = [h.timeout if (h := self.registry.get(j.kind)) else 60.0 for j in jobs]
        return max(memory, default=256), sum(timeouts)

    def _run_sandboxed(self, batch: Batch, env: Mapping[str, str], report: Report,
                       should_stop: Callable[[], bool]) -> None:
        memory_mb, budget = self._limits(batch.jobs)
        budget += START_ALLOWANCE_SECONDS
        spec = SandboxSpec(tenant=batch.tenant_id, memory_mb=memory_mb + SANDBOX_OVERHEAD_MB, cpus=self.cpus,
                           max_pids=self.max_pids, ttl_seconds=budget + 30, tmp_mb=self.tmp_mb,
                           mounts=self.guest.mounts, labels={"batch": str(batch.batch_id)})
        created = time.monotonic()
        sandbox = self.driver.create(spec)
        metrics.SANDBOX_CREATE.labels(self.name).observe(time.monotonic() - created)
        try:
            sandbox.put_file("batch.json", json.dumps({
                "app": self.app_module, "tenant": batch.tenant_id,
                "sys_path": list(self.guest.sys_path), "site_dirs": list(self.guest.site_dirs),
                "jobs": [{"id": j.id, "kind": j.kind, "payload": j.payload, "attempt": j.attempt,
                          "max_attempts": j.max_attempts} for j in batch.jobs],
            }).encode())
            outcome: dict[str, ExecResult] = {}

            def start() -> None:
                outcome["result"] = sandbox.run(
                    [self.guest.executable, "-I", "-S", self.runner_path, GUEST_WORK_DIR,
                     "--ttl", f"{spec.ttl_seconds:.0f}"],
                    timeout=budget, stdin=(json.dumps(dict(env)) + "\n").encode(), self_limiting=True)

            runner = threading.Thread(target=start, name=f"sandbox-{sandbox.id}", daemon=True)
            runner.start()
            tail = ResultTail(sandbox.work_dir / "results.jsonl", report, [j.id for j in batch.jobs])
            asked_to_stop = False
            overrun: str | None = None
            while runner.is_alive():
                tail.poll()
                if not asked_to_stop and should_stop():
                    # finish the running job, start no other
                    sandbox.put_file("stop", b"")
                    asked_to_stop = True
                if overrun is None and (overrun := self._overrun(batch, tail)) is not None:
                    # the guest's own timer did not stop it (signals blocked,
                    # stuck in C code): the host ends the sandbox
                    sandbox.kill()
                runner.join(POLL_SECONDS)
            tail.poll()
            result = outcome.get("result")
            end = result.end if result is not None else End("crashed", detail="sandbox runner failed")
            if overrun is not None:
                end = End("timeout", detail=overrun)
            tail.finish(end, result)
            metrics.BATCH_OUTCOMES.labels(self.name, metrics.batch_reason(end.kind)).inc()
        finally:
            destroying = time.monotonic()
            sandbox.destroy()
            metrics.SANDBOX_DESTROY.labels(self.name).observe(time.monotonic() - destroying)


class ResultTail:
    """Follows the guest's results file and turns lines into reports."""

    def __init__(self, path: Path, report: Report, job_ids: list[int]) -> None:
        self.path = path
        self.report = report
        self.job_ids = job_ids
        self.offset = 0
        self.buffer = b""
        self.running: int | None = None
        self.fatal: str | None = None
        self.started: set[int] = set()
        self.ended: set[int] = set()
        self.running_since: float = 0.0

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
            if line.strip():
                self._handle(json.loads(line))

    def _handle(self, record: dict[str, object]) -> None:
        status = record.get("status")
        if status == "fatal":
            self.fatal = str(record.get("error"))
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


def _runner_path() -> Path:
    return Path(__file__).resolve().parent.parent / "guest" / "runner.py"
